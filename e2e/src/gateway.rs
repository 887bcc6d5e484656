//! A small HTTP/1.1 proxy that drives an endpoint picker the way Envoy's ext_proc
//! filter does under the Gateway API Inference Extension's configuration.
//!
//! Per request it opens one ext_proc stream, sends the request headers (with
//! `:method`, `:path`, `:authority`, `:scheme`, `x-request-id` and
//! `metadata_context`) and the body (FULL_DUPLEX_STREAMED: chunks sent without
//! waiting, `protocol_config` on the first message; or BUFFERED, or STREAMED),
//! applies header mutations, body mutations and immediate responses, forwards to
//! the first endpoint listed by the `envoy.lb` dynamic metadata
//! `x-gateway-destination-endpoint` (ORIGINAL_DST; the header of the same name is
//! the fallback) and, as Envoy's retry on connect failure does, to the next one
//! listed when a connection fails; streams the response back through ext_proc
//! (its headers' `metadata_context` naming the endpoint that served, GIE's
//! `x-gateway-destination-endpoint-served`) and on to the client, and fails open
//! or closed when the picker is unreachable. The ext_proc side is
//! `envoy-client`. `e2e/README.md` lists what it does not do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use axum::Router;
use bytes::Bytes;
use envoy_client::answer::{BodyChange, Changes, Immediate, Phase, SetHeader};
use envoy_client::message::{
    request_body, response_body, response_headers, served_endpoint, string_list, subset_hint,
    RequestHeaders,
};
use envoy_client::{Answers, ClientError, Decision, EnvoyStream, RequestBody, ResponseOutcome};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tracing::{debug, warn};

use crate::serve::Server;

pub use envoy_client::{DESTINATION_KEY, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};

/// How request and response bodies go to the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BodyMode {
    /// FULL_DUPLEX_STREAMED in both directions (GIE's configuration).
    FullDuplex,
    /// BUFFERED in both directions.
    Buffered,
    /// STREAMED in both directions (the body in chunks, an answer each).
    Streamed,
}

impl BodyMode {
    fn client(self) -> envoy_client::BodyMode {
        match self {
            BodyMode::FullDuplex => envoy_client::BodyMode::FullDuplex,
            BodyMode::Buffered => envoy_client::BodyMode::Buffered,
            BodyMode::Streamed => envoy_client::BodyMode::Streamed,
        }
    }
}

/// What to do when the picker cannot be reached or fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FailureMode {
    /// Forward to a fallback endpoint, unchanged.
    Open,
    /// Answer 503.
    Close,
}

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The picker's ext_proc address, `http://host:port` or `https://host:port`.
    pub ext_proc: String,
    /// PEM of a CA (or the self-signed certificate) to trust for `https://`.
    pub ext_proc_ca: Option<String>,
    /// TLS server name to check the certificate against.
    pub ext_proc_server_name: String,
    /// For `https://`: do not verify the picker's certificate at all (as GIE's
    /// Envoy configuration does with the EPP's self-signed certificate).
    pub ext_proc_insecure: bool,
    /// Body mode.
    pub body_mode: BodyMode,
    /// Fail open or closed.
    pub failure_mode: FailureMode,
    /// Endpoints used when failing open (round-robin).
    pub fallback: Vec<SocketAddr>,
    /// Request bodies are sent to the picker in chunks of at most this many bytes.
    pub chunk_size: usize,
    /// A subset hint to send in `metadata_context` (`None`: no hint).
    pub subset: Option<Vec<String>>,
    /// How long to wait for each picker answer (Envoy's `message_timeout`).
    pub message_timeout: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            ext_proc: "http://127.0.0.1:9002".into(),
            ext_proc_ca: None,
            ext_proc_server_name: "localhost".into(),
            ext_proc_insecure: false,
            body_mode: BodyMode::FullDuplex,
            failure_mode: FailureMode::Close,
            fallback: Vec::new(),
            chunk_size: 4096,
            subset: None,
            message_timeout: Duration::from_secs(5),
        }
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Bad ext_proc address or TLS settings.
    #[error("ext_proc client could not be set up")]
    Client(#[from] tonic::transport::Error),
    /// The listener could not bind.
    #[error("cannot bind {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
}

/// Why a request could not be processed by the picker.
#[derive(Debug, thiserror::Error)]
enum PickerFailure {
    #[error("ext_proc stream")]
    Stream(#[from] ClientError),
    #[error("upstream body")]
    UpstreamBody(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// An error and its sources, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(&format!(": {s}"));
        next = s.source();
    }
    out
}

/// Live counters, for tests.
#[derive(Debug, Default)]
pub struct GatewayStats {
    /// Requests routed by the picker.
    pub routed: AtomicU64,
    /// Immediate responses from the picker.
    pub immediate: AtomicU64,
    /// Requests that failed open to a fallback endpoint.
    pub failed_open: AtomicU64,
    /// Requests refused because the picker failed (fail-close).
    pub failed_closed: AtomicU64,
    /// Upstream connection failures.
    pub upstream_errors: AtomicU64,
    /// Connection failures retried on the next listed endpoint.
    pub retries: AtomicU64,
}

struct Gateway {
    config: GatewayConfig,
    channel: Channel,
    http: Client<HttpConnector, Full<Bytes>>,
    next_id: AtomicU64,
    next_fallback: AtomicUsize,
    stats: Arc<GatewayStats>,
}

/// A running gateway.
pub struct GatewayHandle {
    server: Server,
    stats: Arc<GatewayStats>,
}

impl GatewayHandle {
    /// Starts a gateway listening on `addr`.
    pub async fn start(addr: SocketAddr, config: GatewayConfig) -> Result<Self, GatewayError> {
        let https = config.ext_proc.starts_with("https://");
        let channel = if https && config.ext_proc_insecure {
            // Our own TLS connector under a plain-http endpoint, so tonic adds none.
            let plain = config.ext_proc.replacen("https://", "http://", 1);
            Endpoint::from_shared(plain)?
                .connect_timeout(Duration::from_secs(1))
                .connect_with_connector_lazy(insecure_tls::connector(
                    config.ext_proc_server_name.clone(),
                ))
        } else {
            let mut endpoint = Endpoint::from_shared(config.ext_proc.clone())?
                .connect_timeout(Duration::from_secs(1))
                .tcp_nodelay(true);
            if https {
                let mut tls =
                    ClientTlsConfig::new().domain_name(config.ext_proc_server_name.clone());
                if let Some(pem) = &config.ext_proc_ca {
                    tls = tls.ca_certificate(Certificate::from_pem(pem));
                }
                endpoint = endpoint.tls_config(tls)?;
            }
            // Lazy: connects on first use and reconnects after the picker restarts.
            endpoint.connect_lazy()
        };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| GatewayError::Bind(addr, e))?;
        let stats = Arc::new(GatewayStats::default());
        let gw = Arc::new(Gateway {
            config,
            channel,
            http: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(crate::serve::nodelay_connector()),
            next_id: AtomicU64::new(1),
            next_fallback: AtomicUsize::new(0),
            stats: Arc::clone(&stats),
        });
        let router = Router::new().fallback(move |req: Request<Body>| {
            let gw = Arc::clone(&gw);
            async move { gw.proxy(req).await }
        });
        Ok(GatewayHandle {
            server: Server::start(listener, router),
            stats,
        })
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Counters.
    pub fn stats(&self) -> &GatewayStats {
        &self.stats
    }

    /// Serves until aborted.
    pub async fn wait(self) {
        self.server.wait().await;
    }
}

/// The client request as the filter sees it.
struct Downstream {
    method: http::Method,
    path: String,
    authority: String,
    headers: HeaderMap,
    /// The whole body (empty while it is being streamed to the picker).
    body: Bytes,
    /// The request has no body.
    header_only: bool,
}

/// The picker's verdict on the request path.
enum Verdict {
    /// Answer the client directly.
    Immediate(Response<Body>),
    /// Forward upstream.
    Forward {
        headers: HeaderMap,
        path: String,
        body: Bytes,
        /// In the order retries try them; empty when the picker named none.
        destination: Vec<String>,
    },
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    let body =
        serde_json::json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("static response parts are valid")
}

fn header_pairs(headers: &HeaderMap) -> impl Iterator<Item = (&str, &[u8])> {
    headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes()))
}

/// Applies a processor's header changes to a request (`path` is `:path`) or response.
fn apply_changes(c: &Changes, headers: &mut HeaderMap, path: Option<&mut String>) {
    let mut path = path;
    for name in &c.removed {
        if !name.starts_with(':') {
            headers.remove(name.as_str());
        }
    }
    for SetHeader { key, value, action } in &c.set {
        if key == ":path" {
            if let Some(p) = path.as_deref_mut() {
                *p = String::from_utf8_lossy(value).into_owned();
            }
            continue;
        }
        if key.starts_with(':') {
            continue;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        match action {
            HeaderAppendAction::AddIfAbsent if headers.contains_key(&name) => {}
            HeaderAppendAction::OverwriteIfExists if !headers.contains_key(&name) => {}
            HeaderAppendAction::AppendIfExistsOrAdd => {
                headers.append(name, value);
            }
            _ => {
                headers.insert(name, value);
            }
        }
    }
}

/// Where ORIGINAL_DST sends the request, in the order retries try them: the
/// `envoy.lb` metadata's list, else the header of the same name (GIE's protocol).
fn destinations(metadata: Option<&str>, headers: &HeaderMap) -> Vec<String> {
    let Some(list) = metadata.or_else(|| headers.get(DESTINATION_KEY)?.to_str().ok()) else {
        return Vec::new();
    };
    list.split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .collect()
}

fn immediate(r: Immediate) -> Response<Body> {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::OK);
    let mut headers = HeaderMap::new();
    apply_changes(&r.headers, &mut headers, None);
    let mut resp = Response::builder()
        .status(status)
        .body(Body::from(r.body))
        .expect("a status and a body make a response");
    *resp.headers_mut() = headers;
    resp
}

/// Hop-by-hop headers a proxy does not forward.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
];

impl Gateway {
    async fn proxy(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let (parts, client_body) = req.into_parts();
        let header_only = http_body::Body::is_end_stream(&client_body);
        // Full duplex streams the client body to the picker as it arrives; buffered
        // mode (like Envoy) reads it whole first.
        let streaming = self.config.body_mode == BodyMode::FullDuplex && !header_only;
        let (body, client_body) = if streaming {
            (Bytes::new(), Some(client_body))
        } else {
            match client_body.collect().await {
                Ok(b) => (b.to_bytes(), None),
                Err(e) => {
                    return error_response(StatusCode::BAD_REQUEST, "bad_request", &e.to_string())
                }
            }
        };
        let mut headers = parts.headers;
        for h in HOP_BY_HOP {
            headers.remove(*h);
        }
        let authority = headers
            .get(http::header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if !headers.contains_key("x-request-id") {
            let id = format!("gw-{:016x}", self.next_id.fetch_add(1, Ordering::Relaxed));
            headers.insert(
                "x-request-id",
                HeaderValue::from_str(&id).expect("hex is ASCII"),
            );
        }
        let mut down = Downstream {
            method: parts.method,
            path: parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| "/".into()),
            authority,
            headers,
            body,
            header_only,
        };
        let mut stream = match self.open_stream(&down).await {
            Ok(s) => s,
            Err(e) => {
                if let Some(b) = client_body {
                    match b.collect().await {
                        Ok(b) => down.body = b.to_bytes(),
                        Err(e) => {
                            return error_response(
                                StatusCode::BAD_REQUEST,
                                "bad_request",
                                &e.to_string(),
                            )
                        }
                    }
                }
                return self.picker_failed(&down, e.into()).await;
            }
        };
        let chunk = self.config.chunk_size.max(1);
        let pump = match (client_body, stream.sender()) {
            (Some(b), Some(tx)) => Some(tokio::spawn(pump_request_body(b, tx, chunk))),
            _ => None,
        };
        let body = if down.header_only {
            RequestBody::None
        } else if pump.is_some() {
            RequestBody::Pumped
        } else {
            RequestBody::Whole {
                bytes: &down.body,
                chunk,
            }
        };
        let decided = stream.decide(self.config.body_mode.client(), body).await;
        let verdict = match (decided, pump) {
            (Ok(d), pump) => {
                // The pump is done once the picker routed on the whole body; an
                // immediate answer leaves the rest of the client body unread.
                if let Some(p) = pump {
                    match &d {
                        Decision::Routed(_) => {
                            let _ = p.await;
                        }
                        Decision::Immediate(_) => p.abort(),
                    }
                }
                verdict(d, &down)
            }
            (Err(e), pump) => {
                if let Some(p) = pump {
                    match p.await {
                        Ok(Ok(b)) => down.body = b,
                        _ => {
                            return error_response(
                                StatusCode::BAD_REQUEST,
                                "bad_request",
                                "the client body failed",
                            )
                        }
                    }
                }
                return self.picker_failed(&down, e.into()).await;
            }
        };
        match verdict {
            Verdict::Immediate(resp) => {
                self.stats.immediate.fetch_add(1, Ordering::Relaxed);
                resp
            }
            Verdict::Forward {
                headers,
                path,
                body,
                destination,
            } => {
                if destination.is_empty() {
                    // ORIGINAL_DST with no destination: Envoy has no host to pick.
                    return error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_healthy_upstream",
                        "the picker named no destination endpoint",
                    );
                }
                self.stats.routed.fetch_add(1, Ordering::Relaxed);
                self.forward(stream, &down.method, &destination, &path, headers, body)
                    .await
            }
        }
    }

    /// Opens the request's ext_proc stream with its headers as Envoy sends them
    /// (pseudo-headers first, `protocol_config`, the subset hint).
    async fn open_stream(&self, down: &Downstream) -> Result<EnvoyStream, ClientError> {
        let pseudo: [(&str, &[u8]); 4] = [
            (":method", down.method.as_str().as_bytes()),
            (":path", down.path.as_bytes()),
            (":authority", down.authority.as_bytes()),
            (":scheme", b"http"),
        ];
        let pairs = pseudo
            .into_iter()
            .chain(header_pairs(&down.headers).filter(|(k, _)| *k != "host"));
        let mut headers = RequestHeaders::from_pairs(pairs)
            .end_of_stream(down.header_only)
            .mode(self.config.body_mode.client());
        if let Some(subset) = &self.config.subset {
            headers = headers.metadata(subset_hint(string_list(subset)));
        }
        EnvoyStream::open(&self.channel, headers.build(), self.config.message_timeout).await
    }

    /// Sends the request upstream, to the next of `dests` while connecting
    /// fails, and runs the response path.
    async fn forward(
        &self,
        s: EnvoyStream,
        method: &http::Method,
        dests: &[String],
        path: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Response<Body> {
        headers.remove(http::header::CONTENT_LENGTH);
        let mut tries = dests.iter().peekable();
        let (dest, resp) = loop {
            let Some(dest) = tries.next() else {
                unreachable!("forward is called with at least one destination");
            };
            let uri = format!("http://{dest}{path}");
            let mut up = Request::builder().method(method.clone()).uri(&uri);
            *up.headers_mut().expect("builder is valid so far") = headers.clone();
            let up = match up.body(Full::new(body.clone())) {
                Ok(r) => r,
                Err(e) => {
                    return error_response(StatusCode::BAD_GATEWAY, "bad_gateway", &e.to_string())
                }
            };
            match self.http.request(up).await {
                Err(e) if tries.peek().is_some() => {
                    self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    warn!(%dest, error = %e, "upstream connect error; retrying on the next endpoint");
                }
                r => break (dest, r),
            }
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                warn!(%dest, error = %e, "upstream connect error");
                // Envoy's router answers with a local 503, which runs through the
                // ext_proc filter's response path like an upstream response.
                let (parts, _) = Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .header("content-type", "text/plain")
                    .header("server", "envoy")
                    .body(())
                    .expect("static response parts are valid")
                    .into_parts();
                let body = Full::new(Bytes::from(format!(
                    "upstream connect error or disconnect/reset before headers. \
                     reset reason: connection failure ({dest}: {e})"
                )));
                return match self.response_path(s, parts, body, dest).await {
                    Ok(r) => r,
                    Err(e) => {
                        error_response(StatusCode::BAD_GATEWAY, "ext_proc_error", &error_chain(&e))
                    }
                };
            }
        };
        let (parts, upstream) = resp.into_parts();
        match self.response_path(s, parts, upstream, dest).await {
            Ok(r) => r,
            Err(e) => {
                // Envoy resets the downstream when ext_proc fails mid-response.
                let e = error_chain(&e);
                warn!(error = %e, "ext_proc failed on the response path");
                error_response(StatusCode::BAD_GATEWAY, "ext_proc_error", &e)
            }
        }
    }

    /// Runs the response from `served` through the picker and on to the client.
    async fn response_path<B>(
        &self,
        mut s: EnvoyStream,
        parts: http::response::Parts,
        upstream: B,
        served: &str,
    ) -> Result<Response<Body>, PickerFailure>
    where
        B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut headers = parts.headers;
        for h in HOP_BY_HOP {
            headers.remove(*h);
        }
        let builder = |mut headers: HeaderMap, body: Body| {
            headers.remove(http::header::CONTENT_LENGTH);
            let mut r = Response::builder()
                .status(parts.status)
                .body(body)
                .expect("status and body make a response");
            *r.headers_mut() = headers;
            r
        };
        let mode = self.config.body_mode;
        if mode != BodyMode::FullDuplex {
            // Buffered and streamed: Envoy has the whole body before the picker sees it.
            let whole = upstream
                .collect()
                .await
                .map_err(|e| PickerFailure::UpstreamBody(e.into()))?
                .to_bytes();
            let pairs: Vec<_> = header_pairs(&headers).collect();
            let outcome = s
                .respond_with(
                    mode.client(),
                    parts.status.as_str(),
                    &pairs,
                    Some(&whole),
                    self.config.chunk_size.max(1),
                    Some(served_endpoint(served)),
                )
                .await?;
            return Ok(match outcome {
                ResponseOutcome::Immediate(i) => immediate(i),
                ResponseOutcome::Forwarded { changes, body } => {
                    apply_changes(&changes, &mut headers, None);
                    builder(headers, Body::from(body))
                }
            });
        }
        let pairs: Vec<_> = header_pairs(&headers).collect();
        let mut first = response_headers(parts.status.as_str(), &pairs, false);
        first.metadata_context = Some(served_endpoint(served));
        s.send(first).await?;
        match s.phase(Phase::ResponseHeaders).await? {
            Ok(c) => apply_changes(&c, &mut headers, None),
            Err(i) => return Ok(immediate(i)),
        }
        // Full duplex: upstream chunks go to the picker while its answers stream to the client.
        let (tx, answers) = s.into_parts();
        let tx = tx.ok_or(ClientError::Closed)?;
        Ok(builder(
            headers,
            Body::from_stream(streamed_response(upstream, tx, answers)),
        ))
    }

    /// The picker failed: forward unchanged to a fallback (fail-open) or refuse (fail-close).
    async fn picker_failed(&self, down: &Downstream, e: PickerFailure) -> Response<Body> {
        warn!(error = %error_chain(&e), mode = ?self.config.failure_mode, "endpoint picker unavailable");
        if self.config.failure_mode == FailureMode::Close || self.config.fallback.is_empty() {
            self.stats.failed_closed.fetch_add(1, Ordering::Relaxed);
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "ext_proc_unavailable",
                &format!("endpoint picker unavailable: {}", error_chain(&e)),
            );
        }
        self.stats.failed_open.fetch_add(1, Ordering::Relaxed);
        let i = self.next_fallback.fetch_add(1, Ordering::Relaxed) % self.config.fallback.len();
        let dest = self.config.fallback[i];
        let uri = format!("http://{dest}{}", down.path);
        let mut up = Request::builder().method(down.method.clone()).uri(&uri);
        *up.headers_mut().expect("builder is valid so far") = down.headers.clone();
        let Ok(up) = up.body(Full::new(down.body.clone())) else {
            return error_response(StatusCode::BAD_GATEWAY, "bad_gateway", "bad request parts");
        };
        match self.http.request(up).await {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                for h in HOP_BY_HOP {
                    parts.headers.remove(*h);
                }
                Response::from_parts(parts, Body::new(body))
            }
            Err(e) => {
                self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "upstream_connect_error",
                    &format!("fallback {dest}: {e}"),
                )
            }
        }
    }
}

/// Streams the client body to the picker as it arrives (chunks of at most
/// `chunk` bytes, then an empty end-of-stream chunk, as Envoy sends), and returns
/// the whole body.
async fn pump_request_body(
    mut body: Body,
    tx: mpsc::Sender<ProcessingRequest>,
    chunk: usize,
) -> Result<Bytes, axum::Error> {
    let mut whole = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not forwarded
                };
                for piece in data.chunks(chunk) {
                    // A closed stream means the picker already answered or failed.
                    let _ = tx.send(request_body(piece, false)).await;
                }
                whole.extend_from_slice(&data);
            }
            Some(Err(e)) => return Err(e),
            None => {
                let _ = tx.send(request_body(&[], true)).await;
                return Ok(whole.freeze());
            }
        }
    }
}

/// Sends the upstream response body to the picker as it arrives (then an empty
/// end-of-stream chunk); stops when the picker's side closes.
async fn pump_response_body<B>(mut upstream: B, tx: mpsc::Sender<ProcessingRequest>)
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let (chunk, eos) = match upstream.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => (data, false),
                Err(_) => continue, // trailers are not forwarded
            },
            Some(Err(e)) => {
                debug!(error = %e.into(), "upstream body failed");
                return;
            }
            None => (Bytes::new(), true),
        };
        if tx.send(response_body(&chunk, eos)).await.is_err() || eos {
            return;
        }
    }
}

/// The response body the picker streams back, while `upstream` is pumped to
/// it: one stream owning both, so both stop when the client goes away.
fn streamed_response<B>(
    upstream: B,
    tx: mpsc::Sender<ProcessingRequest>,
    answers: Answers,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use futures::future::FusedFuture;
    use futures::FutureExt;
    let pump = Box::pin(pump_response_body(upstream, tx).fuse());
    futures::stream::unfold(Some((answers, pump)), |state| async move {
        let (mut answers, mut pump) = state?;
        loop {
            let answer = tokio::select! {
                () = &mut pump, if !pump.is_terminated() => continue,
                a = answers.phase(Phase::ResponseBody) => a,
            };
            let (body, end_of_stream) = match answer {
                Ok(Ok(Changes {
                    body:
                        BodyChange::Streamed {
                            body,
                            end_of_stream,
                        },
                    ..
                })) => (body, end_of_stream),
                Ok(Ok(c)) => {
                    let e = format!("full-duplex response answer without a streamed body: {c:?}");
                    return Some((Err(std::io::Error::other(e)), None));
                }
                Ok(Err(i)) => {
                    let e = format!("immediate response {} mid-body", i.status);
                    return Some((Err(std::io::Error::other(e)), None));
                }
                Err(e) => return Some((Err(std::io::Error::other(e)), None)),
            };
            let next = (!end_of_stream).then_some((answers, pump));
            if !body.is_empty() {
                return Some((Ok(Bytes::from(body)), next));
            }
            let (a, p) = next?;
            answers = a;
            pump = p;
        }
    })
}

/// Where the picker's decision sends the request.
fn verdict(decision: Decision, down: &Downstream) -> Verdict {
    match decision {
        Decision::Immediate(i) => Verdict::Immediate(immediate(i)),
        Decision::Routed(r) => {
            let mut headers = down.headers.clone();
            let mut path = down.path.clone();
            apply_changes(&r.changes, &mut headers, Some(&mut path));
            let destination = destinations(r.changes.metadata_destination.as_deref(), &headers);
            Verdict::Forward {
                headers,
                path,
                body: r.body.map(Bytes::from).unwrap_or_else(|| down.body.clone()),
                destination,
            }
        }
    }
}

/// TLS towards the picker without certificate verification.
mod insecure_tls {
    use std::sync::Arc;

    use http::Uri;
    use hyper_util::rt::TokioIo;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};
    use tokio::net::TcpStream;
    use tokio_rustls::TlsConnector;

    /// Accepts any certificate; still checks the handshake signatures.
    #[derive(Debug)]
    struct AcceptAny(Arc<CryptoProvider>);

    impl ServerCertVerifier for AcceptAny {
        fn verify_server_cert(
            &self,
            _end_entity: &CertificateDer<'_>,
            _intermediates: &[CertificateDer<'_>],
            _server_name: &ServerName<'_>,
            _ocsp: &[u8],
            _now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// A connector speaking TLS (ALPN h2) to the URI's host and port.
    pub fn connector(
        server_name: String,
    ) -> impl tower::Service<
        Uri,
        Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
           + Send
           + 'static {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tls = TlsConnector::from(Arc::new(config));
        tower::service_fn(move |uri: Uri| {
            let tls = tls.clone();
            let server_name = server_name.clone();
            async move {
                let host = uri.host().unwrap_or("127.0.0.1").to_string();
                let port = uri.port_u16().unwrap_or(443);
                let tcp = TcpStream::connect((host.as_str(), port)).await?;
                tcp.set_nodelay(true)?;
                let name = ServerName::try_from(server_name)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                Ok(TokioIo::new(tls.connect(name, tcp).await?))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(key: &str, value: &str, action: HeaderAppendAction) -> SetHeader {
        SetHeader {
            key: key.into(),
            value: value.as_bytes().to_vec(),
            action,
        }
    }

    #[test]
    fn mutations_overwrite_add_and_remove() {
        let mut h = HeaderMap::new();
        h.insert("x-worker-instance-id", HeaderValue::from_static("666"));
        h.insert("x-spoof", HeaderValue::from_static("1"));
        h.insert("keep", HeaderValue::from_static("a"));
        let c = Changes {
            set: vec![
                set(
                    "x-worker-instance-id",
                    "42",
                    HeaderAppendAction::OverwriteIfExistsOrAdd,
                ),
                set("keep", "b", HeaderAppendAction::AddIfAbsent),
                set(":path", "/v2", HeaderAppendAction::OverwriteIfExistsOrAdd),
            ],
            removed: vec!["x-spoof".into(), ":method".into()],
            ..Default::default()
        };
        let mut path = "/v1".to_string();
        apply_changes(&c, &mut h, Some(&mut path));
        assert_eq!(h.get("x-worker-instance-id").unwrap(), "42");
        assert_eq!(h.get_all("x-worker-instance-id").iter().count(), 1);
        assert_eq!(h.get("keep").unwrap(), "a", "ADD_IF_ABSENT keeps the value");
        assert!(h.get("x-spoof").is_none());
        assert_eq!(path, "/v2");
    }

    #[test]
    fn destinations_come_from_envoy_lb_metadata_then_the_header() {
        let mut h = HeaderMap::new();
        assert_eq!(
            destinations(Some("10.0.0.1:8000,10.0.0.2:8000"), &h),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        assert!(destinations(None, &h).is_empty());
        h.insert(
            DESTINATION_KEY,
            HeaderValue::from_static("10.0.0.3:8000, 10.0.0.4:8000"),
        );
        assert_eq!(destinations(None, &h), ["10.0.0.3:8000", "10.0.0.4:8000"]);
        assert_eq!(destinations(Some("10.0.0.1:8000"), &h), ["10.0.0.1:8000"]);
    }
}
