//! A small HTTP/1.1 proxy that drives an endpoint picker the way Envoy's ext_proc
//! filter does under the Gateway API Inference Extension's configuration.
//!
//! Per request it opens one ext_proc stream, sends the request headers (with
//! `:method`, `:path`, `:authority`, `:scheme`, `x-request-id` and
//! `metadata_context`) and the body (FULL_DUPLEX_STREAMED: chunks sent without
//! waiting, `protocol_config` on the first message; or BUFFERED), applies header
//! mutations, body mutations and immediate responses, forwards to the endpoint
//! named by the `envoy.lb` dynamic metadata `x-gateway-destination-endpoint`
//! (ORIGINAL_DST; the header of the same name is the fallback), streams the
//! response back through ext_proc and on to the client, and fails open or closed
//! when the picker is unreachable. `e2e/README.md` lists what it does not do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use axum::Router;
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as PbHeaderMap, HeaderValue as PbHeaderValue, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request, processing_response, CommonResponse,
    HeaderMutation, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Streaming;
use tracing::{debug, warn};

use crate::serve::Server;

/// Dynamic-metadata namespace of the ORIGINAL_DST load balancer.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Key naming the destination (metadata key and header).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// Metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// How request and response bodies go to the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BodyMode {
    /// FULL_DUPLEX_STREAMED in both directions (GIE's configuration).
    FullDuplex,
    /// BUFFERED in both directions.
    Buffered,
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
    #[error("ext_proc client: {0}")]
    Client(#[from] tonic::transport::Error),
    /// The listener could not bind.
    #[error("cannot bind {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
}

/// Why a request could not be processed by the picker.
#[derive(Debug, thiserror::Error)]
enum PickerFailure {
    #[error("ext_proc call failed: {0}")]
    Status(#[from] tonic::Status),
    #[error("ext_proc stream closed early")]
    Closed,
    #[error("ext_proc answer timed out")]
    Timeout,
    #[error("ext_proc protocol error: {0}")]
    Protocol(String),
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
}

struct Gateway {
    config: GatewayConfig,
    ext_proc: ExternalProcessorClient<Channel>,
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
            ext_proc: ExternalProcessorClient::new(channel),
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
        destination: Option<String>,
    },
}

/// The open ext_proc stream of one request.
struct ExtProcStream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    timeout: Duration,
}

impl ExtProcStream {
    async fn send(&self, msg: ProcessingRequest) -> Result<(), PickerFailure> {
        self.tx.send(msg).await.map_err(|_| PickerFailure::Closed)
    }

    async fn recv(&mut self) -> Result<ProcessingResponse, PickerFailure> {
        match tokio::time::timeout(self.timeout, self.rx.next()).await {
            Err(_) => Err(PickerFailure::Timeout),
            Ok(None) => Err(PickerFailure::Closed),
            Ok(Some(Err(status))) => Err(status.into()),
            Ok(Some(Ok(msg))) => Ok(msg),
        }
    }
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

fn pb_headers(pairs: impl IntoIterator<Item = (String, Vec<u8>)>) -> PbHeaderMap {
    PbHeaderMap {
        headers: pairs
            .into_iter()
            .map(|(key, raw_value)| PbHeaderValue {
                key,
                value: String::new(),
                raw_value,
            })
            .collect(),
    }
}

fn header_pairs(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn pb_value(h: &PbHeaderValue) -> Vec<u8> {
    if h.raw_value.is_empty() {
        h.value.as_bytes().to_vec()
    } else {
        h.raw_value.clone()
    }
}

/// Applies a header mutation to a request (`path` is `:path`) or response.
fn apply_mutation(m: &HeaderMutation, headers: &mut HeaderMap, path: Option<&mut String>) {
    let mut path = path;
    for name in &m.remove_headers {
        if !name.starts_with(':') {
            headers.remove(name.as_str());
        }
    }
    for opt in &m.set_headers {
        let Some(h) = &opt.header else { continue };
        let value = pb_value(h);
        if h.key == ":path" {
            if let Some(p) = path.as_deref_mut() {
                *p = String::from_utf8_lossy(&value).into_owned();
            }
            continue;
        }
        if h.key.starts_with(':') {
            continue;
        }
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.key.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) else {
            continue;
        };
        // 0 APPEND_IF_EXISTS_OR_ADD, 1 ADD_IF_ABSENT, 2 OVERWRITE_IF_EXISTS_OR_ADD, 3 OVERWRITE_IF_EXISTS.
        match opt.append_action {
            1 if headers.contains_key(&name) => {}
            3 if !headers.contains_key(&name) => {}
            0 => {
                headers.append(name, value);
            }
            _ => {
                headers.insert(name, value);
            }
        }
    }
}

fn destination_from(metadata: Option<&Struct>) -> Option<String> {
    let lb = metadata?.fields.get(LB_NAMESPACE)?;
    let Some(Kind::StructValue(inner)) = &lb.kind else {
        return None;
    };
    match &inner.fields.get(DESTINATION_KEY)?.kind {
        // GIE allows a comma-separated list of fallbacks; Envoy tries the first.
        Some(Kind::StringValue(s)) => s.split(',').next().map(|s| s.trim().to_string()),
        _ => None,
    }
}

fn immediate(r: ImmediateResponse) -> Response<Body> {
    let status = r
        .status
        .and_then(|s| StatusCode::from_u16(s.code as u16).ok())
        .unwrap_or(StatusCode::OK);
    let mut headers = HeaderMap::new();
    if let Some(m) = &r.headers {
        apply_mutation(m, &mut headers, None);
    }
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
        let opened = match self.open_stream().await {
            Ok(mut s) => self.send_request_headers(&mut s, &down).await.map(|_| s),
            Err(e) => Err(e),
        };
        let mut stream = match opened {
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
                return self.picker_failed(&down, e).await;
            }
        };
        let pump = client_body.map(|b| {
            tokio::spawn(pump_request_body(
                b,
                stream.tx.clone(),
                self.config.chunk_size.max(1),
            ))
        });
        let verdict = self.request_answers(&mut stream, &down).await;
        let verdict = match verdict {
            Ok(v) => v,
            Err(e) => {
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
                return self.picker_failed(&down, e).await;
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
                let Some(dest) = destination else {
                    // ORIGINAL_DST with no destination: Envoy has no host to pick.
                    return error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no_healthy_upstream",
                        "the picker named no destination endpoint",
                    );
                };
                self.stats.routed.fetch_add(1, Ordering::Relaxed);
                self.forward(stream, &down.method, &dest, &path, headers, body)
                    .await
            }
        }
    }

    async fn open_stream(&self) -> Result<ExtProcStream, PickerFailure> {
        let (tx, rx) = mpsc::channel::<ProcessingRequest>(64);
        let mut client = self.ext_proc.clone();
        let call = client.process(ReceiverStream::new(rx));
        let resp = tokio::time::timeout(self.config.message_timeout, call)
            .await
            .map_err(|_| PickerFailure::Timeout)??;
        Ok(ExtProcStream {
            tx,
            rx: resp.into_inner(),
            timeout: self.config.message_timeout,
        })
    }

    fn protocol_config(&self) -> ProtocolConfiguration {
        let mode = match self.config.body_mode {
            BodyMode::FullDuplex => BodySendMode::FullDuplexStreamed,
            BodyMode::Buffered => BodySendMode::Buffered,
        };
        ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            send_body_without_waiting_for_header_response: false,
        }
    }

    fn metadata_context(&self) -> Metadata {
        let mut md = Metadata::default();
        if let Some(subset) = &self.config.subset {
            let list = Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: subset
                        .iter()
                        .map(|s| Value {
                            kind: Some(Kind::StringValue(s.clone())),
                        })
                        .collect(),
                })),
            };
            md.filter_metadata.insert(
                SUBSET_NAMESPACE.into(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), list)].into_iter().collect(),
                },
            );
        }
        md
    }

    /// Sends the request headers (the first message of the stream).
    async fn send_request_headers(
        &self,
        s: &mut ExtProcStream,
        down: &Downstream,
    ) -> Result<(), PickerFailure> {
        let mut pairs = vec![
            (
                ":method".to_string(),
                down.method.as_str().as_bytes().to_vec(),
            ),
            (":path".to_string(), down.path.as_bytes().to_vec()),
            (":authority".to_string(), down.authority.as_bytes().to_vec()),
            (":scheme".to_string(), b"http".to_vec()),
        ];
        pairs.extend(
            header_pairs(&down.headers)
                .into_iter()
                .filter(|(k, _)| k != "host"),
        );
        s.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(pb_headers(pairs)),
                end_of_stream: down.header_only,
                ..Default::default()
            })),
            metadata_context: Some(self.metadata_context()),
            protocol_config: Some(self.protocol_config()),
            ..Default::default()
        })
        .await
    }

    /// Reads the picker's answers on the request path (sending the body first in
    /// buffered mode) and returns the verdict.
    async fn request_answers(
        &self,
        s: &mut ExtProcStream,
        down: &Downstream,
    ) -> Result<Verdict, PickerFailure> {
        let header_only = down.header_only;
        let mut headers = down.headers.clone();
        let mut path = down.path.clone();
        let mut destination = None;
        let full_duplex = self.config.body_mode == BodyMode::FullDuplex;
        // The headers answer.
        let msg = s.recv().await?;
        merge_destination(&mut destination, msg.dynamic_metadata.as_ref());
        match msg.response {
            Some(processing_response::Response::ImmediateResponse(r)) => {
                return Ok(Verdict::Immediate(immediate(r)))
            }
            Some(processing_response::Response::RequestHeaders(h)) => {
                apply_common(h.response.as_ref(), &mut headers, &mut path);
            }
            other => {
                return Err(PickerFailure::Protocol(format!(
                    "expected a request headers answer, got {other:?}"
                )))
            }
        }
        if header_only {
            return Ok(forward_verdict(headers, path, Bytes::new(), destination));
        }
        if !full_duplex {
            s.send(request_body_msg(&down.body, true)).await?;
        }
        // Body answers until the body is complete.
        let mut body: Option<Vec<u8>> = None;
        loop {
            let msg = s.recv().await?;
            merge_destination(&mut destination, msg.dynamic_metadata.as_ref());
            let common = match msg.response {
                Some(processing_response::Response::ImmediateResponse(r)) => {
                    return Ok(Verdict::Immediate(immediate(r)))
                }
                Some(processing_response::Response::RequestBody(b)) => b.response,
                other => {
                    return Err(PickerFailure::Protocol(format!(
                        "expected a request body answer, got {other:?}"
                    )))
                }
            };
            apply_common(common.as_ref(), &mut headers, &mut path);
            let mutation = common
                .and_then(|c| c.body_mutation)
                .and_then(|m| m.mutation);
            match mutation {
                Some(Mutation::StreamedResponse(chunk)) => {
                    body.get_or_insert_with(Vec::new)
                        .extend_from_slice(&chunk.body);
                    if chunk.end_of_stream {
                        break;
                    }
                }
                Some(Mutation::Body(b)) => {
                    body = Some(b);
                    break;
                }
                Some(Mutation::ClearBody(true)) => {
                    body = Some(Vec::new());
                    break;
                }
                _ if full_duplex => {
                    return Err(PickerFailure::Protocol(
                        "full-duplex body answer without a streamed body".into(),
                    ))
                }
                _ => break,
            }
        }
        let body = body.map(Bytes::from).unwrap_or_else(|| down.body.clone());
        Ok(forward_verdict(headers, path, body, destination))
    }

    /// Sends the request upstream and runs the response path.
    async fn forward(
        &self,
        s: ExtProcStream,
        method: &http::Method,
        dest: &str,
        path: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Response<Body> {
        headers.remove(http::header::CONTENT_LENGTH);
        let uri = format!("http://{dest}{path}");
        let mut up = Request::builder().method(method.clone()).uri(&uri);
        *up.headers_mut().expect("builder is valid so far") = headers;
        let up = match up.body(Full::new(body)) {
            Ok(r) => r,
            Err(e) => {
                return error_response(StatusCode::BAD_GATEWAY, "bad_gateway", &e.to_string())
            }
        };
        let resp = match self.http.request(up).await {
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
                return match self.response_path(s, parts, body).await {
                    Ok(r) => r,
                    Err(e) => {
                        error_response(StatusCode::BAD_GATEWAY, "ext_proc_error", &e.to_string())
                    }
                };
            }
        };
        let (parts, upstream) = resp.into_parts();
        match self.response_path(s, parts, upstream).await {
            Ok(r) => r,
            Err(e) => {
                // Envoy resets the downstream when ext_proc fails mid-response.
                warn!(error = %e, "ext_proc failed on the response path");
                error_response(StatusCode::BAD_GATEWAY, "ext_proc_error", &e.to_string())
            }
        }
    }

    async fn response_path<B>(
        &self,
        mut s: ExtProcStream,
        parts: http::response::Parts,
        upstream: B,
    ) -> Result<Response<Body>, PickerFailure>
    where
        B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: std::fmt::Display,
    {
        let mut headers = parts.headers;
        for h in HOP_BY_HOP {
            headers.remove(*h);
        }
        let mut pairs = vec![(
            ":status".to_string(),
            parts.status.as_str().as_bytes().to_vec(),
        )];
        pairs.extend(header_pairs(&headers));
        let full_duplex = self.config.body_mode == BodyMode::FullDuplex;
        s.send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(pb_headers(pairs)),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await?;
        let answer = s.recv().await?;
        match answer.response {
            Some(processing_response::Response::ResponseHeaders(h)) => {
                let mut ignored = String::new();
                apply_common(h.response.as_ref(), &mut headers, &mut ignored);
            }
            Some(processing_response::Response::ImmediateResponse(r)) => return Ok(immediate(r)),
            other => {
                return Err(PickerFailure::Protocol(format!(
                    "expected a response headers answer, got {other:?}"
                )))
            }
        }
        headers.remove(http::header::CONTENT_LENGTH);
        let builder = |headers: HeaderMap, body: Body| {
            let mut r = Response::builder()
                .status(parts.status)
                .body(body)
                .expect("status and body make a response");
            *r.headers_mut() = headers;
            r
        };
        if !full_duplex {
            let whole = upstream
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| PickerFailure::Protocol(format!("upstream body: {e}")))?;
            s.send(ProcessingRequest {
                request: Some(processing_request::Request::ResponseBody(HttpBody {
                    body: whole.to_vec(),
                    end_of_stream: true,
                    ..Default::default()
                })),
                ..Default::default()
            })
            .await?;
            let answer = s.recv().await?;
            let body = match answer.response {
                Some(processing_response::Response::ResponseBody(b)) => {
                    apply_common(b.response.as_ref(), &mut headers, &mut String::new());
                    match b
                        .response
                        .and_then(|c| c.body_mutation)
                        .and_then(|m| m.mutation)
                    {
                        Some(Mutation::Body(b)) => Bytes::from(b),
                        Some(Mutation::ClearBody(true)) => Bytes::new(),
                        _ => whole,
                    }
                }
                Some(processing_response::Response::ImmediateResponse(r)) => {
                    return Ok(immediate(r))
                }
                other => {
                    return Err(PickerFailure::Protocol(format!(
                        "expected a response body answer, got {other:?}"
                    )))
                }
            };
            return Ok(builder(headers, Body::from(body)));
        }
        // Full duplex: pump upstream chunks to the picker, stream its answers to the client.
        let ExtProcStream {
            tx,
            mut rx,
            timeout,
        } = s;
        let keep_tx = tx.clone();
        tokio::spawn(async move {
            let mut upstream = upstream;
            loop {
                let (chunk, eos) = match upstream.frame().await {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => (data, false),
                        Err(_) => continue, // trailers are not forwarded
                    },
                    Some(Err(e)) => {
                        debug!(error = %e, "upstream body failed");
                        return;
                    }
                    None => (Bytes::new(), true),
                };
                let msg = ProcessingRequest {
                    request: Some(processing_request::Request::ResponseBody(HttpBody {
                        body: chunk.to_vec(),
                        end_of_stream: eos,
                        ..Default::default()
                    })),
                    ..Default::default()
                };
                if tx.send(msg).await.is_err() || eos {
                    return;
                }
            }
        });
        let (out_tx, out_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        tokio::spawn(async move {
            let _keep_open = keep_tx;
            loop {
                let next = match tokio::time::timeout(timeout, rx.next()).await {
                    Ok(Some(Ok(msg))) => msg,
                    Ok(Some(Err(e))) => {
                        let _ = out_tx.send(Err(std::io::Error::other(e.to_string()))).await;
                        return;
                    }
                    Ok(None) | Err(_) => {
                        let _ = out_tx
                            .send(Err(std::io::Error::other("ext_proc stream ended early")))
                            .await;
                        return;
                    }
                };
                let Some(processing_response::Response::ResponseBody(b)) = next.response else {
                    continue;
                };
                let Some(Mutation::StreamedResponse(chunk)) = b
                    .response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation)
                else {
                    continue;
                };
                if !chunk.body.is_empty() && out_tx.send(Ok(Bytes::from(chunk.body))).await.is_err()
                {
                    return;
                }
                if chunk.end_of_stream {
                    return;
                }
            }
        });
        Ok(builder(
            headers,
            Body::from_stream(ReceiverStream::new(out_rx)),
        ))
    }

    /// The picker failed: forward unchanged to a fallback (fail-open) or refuse (fail-close).
    async fn picker_failed(&self, down: &Downstream, e: PickerFailure) -> Response<Body> {
        warn!(error = %e, mode = ?self.config.failure_mode, "endpoint picker unavailable");
        if self.config.failure_mode == FailureMode::Close || self.config.fallback.is_empty() {
            self.stats.failed_closed.fetch_add(1, Ordering::Relaxed);
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "ext_proc_unavailable",
                &format!("endpoint picker unavailable: {e}"),
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

fn request_body_msg(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Streams the client body to the picker as it arrives (chunks of at most
/// `chunk` bytes, then an empty end-of-stream chunk, as Envoy sends), and returns
/// the whole body.
async fn pump_request_body(
    mut body: Body,
    tx: mpsc::Sender<ProcessingRequest>,
    chunk: usize,
) -> Result<Bytes, String> {
    let mut whole = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not forwarded
                };
                for piece in data.chunks(chunk) {
                    // A closed stream means the picker already answered or failed.
                    let _ = tx.send(request_body_msg(piece, false)).await;
                }
                whole.extend_from_slice(&data);
            }
            Some(Err(e)) => return Err(e.to_string()),
            None => {
                let _ = tx.send(request_body_msg(&[], true)).await;
                return Ok(whole.freeze());
            }
        }
    }
}

fn merge_destination(dest: &mut Option<String>, metadata: Option<&Struct>) {
    if let Some(d) = destination_from(metadata) {
        *dest = Some(d);
    }
}

fn apply_common(common: Option<&CommonResponse>, headers: &mut HeaderMap, path: &mut String) {
    if let Some(m) = common.and_then(|c| c.header_mutation.as_ref()) {
        apply_mutation(m, headers, Some(path));
    }
}

fn forward_verdict(
    headers: HeaderMap,
    path: String,
    body: Bytes,
    destination: Option<String>,
) -> Verdict {
    // ORIGINAL_DST reads the metadata; the header of the same name is GIE's fallback.
    let destination = destination.or_else(|| {
        headers
            .get(DESTINATION_KEY)
            .and_then(|v| v.to_str().ok())
            .map(|s| s.split(',').next().unwrap_or(s).trim().to_string())
    });
    Verdict::Forward {
        headers,
        path,
        body,
        destination,
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
    use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;

    fn opt(key: &str, value: &str, action: i32) -> HeaderValueOption {
        HeaderValueOption {
            header: Some(PbHeaderValue {
                key: key.into(),
                value: String::new(),
                raw_value: value.as_bytes().to_vec(),
            }),
            append_action: action,
            ..Default::default()
        }
    }

    #[test]
    fn mutations_overwrite_add_and_remove() {
        let mut h = HeaderMap::new();
        h.insert("x-worker-instance-id", HeaderValue::from_static("666"));
        h.insert("x-spoof", HeaderValue::from_static("1"));
        h.insert("keep", HeaderValue::from_static("a"));
        let m = HeaderMutation {
            set_headers: vec![
                opt("x-worker-instance-id", "42", 2),
                opt("keep", "b", 1),
                opt(":path", "/v2", 2),
            ],
            remove_headers: vec!["x-spoof".into(), ":method".into()],
        };
        let mut path = "/v1".to_string();
        apply_mutation(&m, &mut h, Some(&mut path));
        assert_eq!(h.get("x-worker-instance-id").unwrap(), "42");
        assert_eq!(h.get_all("x-worker-instance-id").iter().count(), 1);
        assert_eq!(h.get("keep").unwrap(), "a", "ADD_IF_ABSENT keeps the value");
        assert!(h.get("x-spoof").is_none());
        assert_eq!(path, "/v2");
    }

    #[test]
    fn destination_comes_from_envoy_lb_metadata() {
        let inner = Struct {
            fields: [(
                DESTINATION_KEY.to_string(),
                Value {
                    kind: Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into())),
                },
            )]
            .into_iter()
            .collect(),
        };
        let md = Struct {
            fields: [(
                LB_NAMESPACE.to_string(),
                Value {
                    kind: Some(Kind::StructValue(inner)),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            destination_from(Some(&md)).as_deref(),
            Some("10.0.0.1:8000")
        );
        assert_eq!(destination_from(Some(&Struct::default())), None);
    }
}
