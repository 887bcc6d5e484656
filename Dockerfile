# syntax=docker/dockerfile:1
#
# Images:
#   docker build --target kvpick      -t kvpick/kvpick:dev .
#   docker build --target mock-worker -t kvpick/mock-worker:dev .
# Both build from the locked workspace (Cargo.lock) and run as a non-root user
# on a distroless base with no shell.

ARG RUST_VERSION=1.85

# ---- build: compile the workspace once, both binaries ----------------------
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# Manifests first, with empty targets, so the dependency layer is cached until
# Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
COPY e2e/Cargo.toml e2e/Cargo.toml
RUN mkdir -p src e2e/src \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && touch e2e/src/lib.rs \
    && cargo fetch --locked
COPY . .
# Touch the real sources so cargo does not reuse the placeholder builds.
RUN find src e2e/src -name '*.rs' -exec touch {} + \
    && cargo build --release --locked -p kvpick --bin kvpick \
    && cp target/release/kvpick /kvpick

FROM build AS build-mock-worker
RUN cargo build --release --locked -p e2e --bin mock-worker \
    && cp target/release/mock-worker /mock-worker

# ---- runtime: kvpick ------------------------------------------------------
FROM gcr.io/distroless/cc-debian12:nonroot AS kvpick
COPY --from=build /kvpick /usr/local/bin/kvpick
USER 65532:65532
# 9002 ext_proc (gRPC, TLS by default), 9003 gRPC health, 9090 /metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["/usr/local/bin/kvpick"]

# ---- runtime: mock-worker (tests and demos only) ---------------------------
FROM gcr.io/distroless/cc-debian12:nonroot AS mock-worker
COPY --from=build-mock-worker /mock-worker /usr/local/bin/mock-worker
USER 65532:65532
# 8000 OpenAI-compatible API, /health and /metrics; 5557 KV events (ZMQ)
EXPOSE 8000 5557
ENTRYPOINT ["/usr/local/bin/mock-worker"]
