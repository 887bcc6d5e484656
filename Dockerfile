# syntax=docker/dockerfile:1
#
# Images (BuildKit):
#   docker build --target kvpick      -t kvpick/kvpick:dev .
#   docker build --target mock-worker -t kvpick/mock-worker:dev .
# Both compile from the locked workspace (Cargo.lock) and run as a non-root
# user on a distroless base with no shell.

ARG RUST_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

# ---- build: kvpick --------------------------------------------------------
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# The registry and target caches persist between builds on the same builder;
# the binary is copied out of the cache mount within the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvpick --bin kvpick \
    && install -D -m 0755 target/release/kvpick /out/kvpick

# ---- build: mock-worker (from the e2e crate) -------------------------------
FROM build AS build-mock-worker
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p e2e --bin mock-worker \
    && install -D -m 0755 target/release/mock-worker /out/mock-worker

# ---- runtime: mock-worker (tests and demos only) ---------------------------
FROM ${RUNTIME_IMAGE} AS mock-worker
COPY --from=build-mock-worker /out/mock-worker /usr/local/bin/mock-worker
USER 65532:65532
# 8000 OpenAI-compatible API, /health, /metrics, /debug/seen; 5557 KV events (ZMQ)
EXPOSE 8000 5557
ENTRYPOINT ["/usr/local/bin/mock-worker"]

# ---- runtime: kvpick (last, so a plain `docker build .` makes kvpick) ------
FROM ${RUNTIME_IMAGE} AS kvpick
COPY --from=build /out/kvpick /usr/local/bin/kvpick
USER 65532:65532
# 9002 ext_proc (gRPC, TLS by default), 9003 gRPC health (plaintext), 9090 /metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["/usr/local/bin/kvpick"]
