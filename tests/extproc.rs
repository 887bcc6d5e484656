//! Loopback tests of the ext_proc server, driven the way Envoy drives it.
//!
//! The client side here builds every message by hand from the Envoy protos and
//! checks kvpick's answers against the ext_proc / GIE protocol, independently of
//! kvpick's own message builders.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, CommonResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvpick::endpoints::{Endpoint, Role};
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Streaming;

/// A kvpick ext_proc server on loopback.
struct Server {
    app: App,
    port: u16,
}

async fn start(endpoints: Vec<Endpoint>) -> Server {
    start_with(endpoints, ExtProcConfig::default()).await
}

async fn start_with(endpoints: Vec<Endpoint>, config: ExtProcConfig) -> Server {
    let app = App::new("test-pool");
    app.endpoints.replace(endpoints);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(listener, app.ext_proc(config), None));
    Server { app, port }
}

fn endpoint(addr: &str) -> Endpoint {
    Endpoint::new(addr.parse().unwrap())
}

fn pool(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| endpoint(&format!("10.0.0.{}:8000", i + 1)))
        .collect()
}

async fn channel(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// One ext_proc stream, as Envoy opens it.
struct EnvoyStream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl EnvoyStream {
    async fn open(ch: &Channel) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let rx = ExternalProcessorClient::new(ch.clone())
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        EnvoyStream { tx, rx }
    }

    /// Opens a stream and sends POST request headers for `path`, not ending the stream.
    async fn post(
        ch: &Channel,
        path: &str,
        extra: &[(&str, &str)],
        mode: Option<BodySendMode>,
        metadata: Option<Metadata>,
    ) -> Self {
        let s = Self::open(ch).await;
        s.send(req_headers(
            &post_headers(path, extra),
            false,
            mode,
            metadata,
        ))
        .await;
        s
    }

    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.next())
            .await
            .expect("kvpick did not answer within 5 s")
            .expect("stream ended")
            .expect("grpc error")
    }

    /// Nothing arrives within `ms`.
    async fn silent_for(&mut self, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), self.rx.next())
            .await
            .is_err()
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    }
}

fn post_headers(path: &str, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut h = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), path.to_string()),
        (":authority".to_string(), "gateway".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    h.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    h
}

fn req_headers(
    pairs: &[(String, String)],
    end_of_stream: bool,
    mode: Option<BodySendMode>,
    metadata: Option<Metadata>,
) -> ProcessingRequest {
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(headers(
            &refs,
            end_of_stream,
        ))),
        protocol_config: mode.map(|m| ProtocolConfiguration {
            request_body_mode: m as i32,
            response_body_mode: m as i32,
            ..Default::default()
        }),
        metadata_context: metadata,
        ..Default::default()
    }
}

fn body_msg(bytes: &[u8], end_of_stream: bool, response: bool) -> ProcessingRequest {
    let b = HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(if response {
            processing_request::Request::ResponseBody(b)
        } else {
            processing_request::Request::RequestBody(b)
        }),
        ..Default::default()
    }
}

fn resp_headers(status: &str, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(headers(
            &[(":status", status)],
            end_of_stream,
        ))),
        ..Default::default()
    }
}

fn chat_body(text: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "llama",
        "messages": [{"role": "user", "content": text}],
        "stream": true
    }))
    .unwrap()
}

/// What a request-headers or request-body answer decided.
#[derive(Debug, Default)]
struct Routing {
    set: Vec<(String, String)>,
    removed: Vec<String>,
    clear_route_cache: bool,
    metadata_destination: Option<String>,
}

impl Routing {
    fn get(&self, key: &str) -> Option<&str> {
        self.set
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn routing_of(common: Option<&CommonResponse>, msg: &ProcessingResponse) -> Routing {
    let mut r = Routing::default();
    if let Some(c) = common {
        r.clear_route_cache = c.clear_route_cache;
        if let Some(m) = &c.header_mutation {
            for h in m.set_headers.iter().filter_map(|o| o.header.as_ref()) {
                let v = if h.raw_value.is_empty() {
                    h.value.clone()
                } else {
                    String::from_utf8(h.raw_value.clone()).unwrap()
                };
                r.set.push((h.key.clone(), v));
            }
            r.removed = m.remove_headers.clone();
        }
    }
    r.metadata_destination = msg.dynamic_metadata.as_ref().and_then(|md| {
        let Some(Kind::StructValue(lb)) = md.fields.get("envoy.lb")?.kind.as_ref() else {
            return None;
        };
        match lb
            .fields
            .get("x-gateway-destination-endpoint")?
            .kind
            .as_ref()?
        {
            Kind::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    });
    r
}

fn expect_request_headers(msg: &ProcessingResponse) -> Routing {
    match &msg.response {
        Some(processing_response::Response::RequestHeaders(h)) => {
            routing_of(h.response.as_ref(), msg)
        }
        other => panic!("expected a request-headers answer, got {other:?}"),
    }
}

fn expect_request_body(msg: &ProcessingResponse) -> (Routing, Option<body_mutation::Mutation>) {
    match &msg.response {
        Some(processing_response::Response::RequestBody(b)) => (
            routing_of(b.response.as_ref(), msg),
            b.response
                .as_ref()
                .and_then(|c| c.body_mutation.clone())
                .and_then(|m| m.mutation),
        ),
        other => panic!("expected a request-body answer, got {other:?}"),
    }
}

/// Collects streamed body chunks until end_of_stream; returns (bytes, chunk sizes).
async fn collect_streamed(s: &mut EnvoyStream) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let mut sizes = Vec::new();
    loop {
        let msg = s.recv().await;
        let (_, mutation) = expect_request_body(&msg);
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) = mutation else {
            panic!("expected a streamed body chunk, got {mutation:?}");
        };
        sizes.push(chunk.body.len());
        bytes.extend_from_slice(&chunk.body);
        if chunk.end_of_stream {
            return (bytes, sizes);
        }
    }
}

fn immediate_status(msg: &ProcessingResponse) -> (i32, serde_json::Value) {
    match &msg.response {
        Some(processing_response::Response::ImmediateResponse(ir)) => (
            ir.status.as_ref().unwrap().code,
            serde_json::from_slice(&ir.body).expect("error body is JSON"),
        ),
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

/// Sends a full-duplex chat request; returns the routing and the echoed body.
async fn full_duplex(
    ch: &Channel,
    body: &[u8],
    extra_headers: &[(&str, &str)],
    metadata: Option<Metadata>,
) -> (EnvoyStream, Routing, Vec<u8>) {
    let mut s = EnvoyStream::post(
        ch,
        "/v1/chat/completions",
        extra_headers,
        Some(BodySendMode::FullDuplexStreamed),
        metadata,
    )
    .await;
    // Envoy streams the body in arbitrary chunks without waiting.
    let chunks: Vec<&[u8]> = body.chunks(16 * 1024).collect();
    for (i, c) in chunks.iter().enumerate() {
        s.send(body_msg(c, i + 1 == chunks.len(), false)).await;
    }
    let routing = expect_request_headers(&s.recv().await);
    let (echo, _) = collect_streamed(&mut s).await;
    (s, routing, echo)
}

#[tokio::test]
async fn full_duplex_routes_after_body_and_echoes_it() {
    let srv = start(pool(3)).await;
    let ch = channel(srv.port).await;
    let body = chat_body("hello there");
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/chat/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    // The headers answer is held until the body ends.
    assert!(
        s.silent_for(300).await,
        "headers answered before the body ended"
    );
    s.send(body_msg(&body[..5], false, false)).await;
    s.send(body_msg(&body[5..], true, false)).await;
    let r = expect_request_headers(&s.recv().await);
    assert!(r.clear_route_cache);
    let dest = r.get("x-gateway-destination-endpoint").unwrap().to_string();
    assert_eq!(r.metadata_destination.as_deref(), Some(dest.as_str()));
    let chosen = srv
        .app
        .endpoints
        .snapshot()
        .endpoints
        .iter()
        .find(|e| e.endpoint.address_string() == dest)
        .cloned()
        .expect("destination is a pool endpoint");
    assert_eq!(
        r.get("x-worker-instance-id").unwrap(),
        chosen.endpoint.instance_id.to_string()
    );
    assert_eq!(r.get("x-dp-rank"), Some("0"));
    assert_eq!(r.get("x-prefill-instance-id"), None);
    let (echo, sizes) = collect_streamed(&mut s).await;
    assert_eq!(echo, body, "body must come back unchanged");
    assert_eq!(sizes.len(), 1);
}

#[tokio::test]
async fn large_prompt_is_echoed_in_62000_byte_chunks() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let text: String = (0..50_000).map(|i| format!("w{} ", i % 977)).collect();
    let body = chat_body(&text);
    assert!(body.len() > 200_000);
    let (_, r, echo) = full_duplex(&ch, &body, &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    assert_eq!(echo, body);
    // Re-run to inspect chunk sizes.
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/chat/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    s.send(body_msg(&body, true, false)).await;
    expect_request_headers(&s.recv().await);
    let (echo, sizes) = collect_streamed(&mut s).await;
    assert_eq!(echo, body);
    assert_eq!(sizes.len(), body.len().div_ceil(62_000));
    assert!(sizes.iter().all(|n| *n <= 62_000));
    assert!(sizes[..sizes.len() - 1].iter().all(|n| *n == 62_000));
}

#[tokio::test]
async fn buffered_mode_answers_headers_then_decides_on_body() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::Buffered),
        None,
    )
    .await;
    let r = expect_request_headers(&s.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_none());
    s.send(body_msg(br#"{"model":"m","prompt":"hi"}"#, true, false))
        .await;
    let msg = s.recv().await;
    let (r, mutation) = expect_request_body(&msg);
    assert!(r.clear_route_cache);
    let dest = r.get("x-gateway-destination-endpoint").unwrap();
    assert_eq!(r.metadata_destination.as_deref(), Some(dest));
    assert!(r.get("x-worker-instance-id").is_some());
    assert!(mutation.is_none(), "an unchanged body is not mutated");
}

#[tokio::test]
async fn mode_is_inferred_without_protocol_config() {
    let config = ExtProcConfig {
        body_wait: Duration::from_millis(50),
        ..Default::default()
    };
    let srv = start_with(pool(2), config).await;
    let ch = channel(srv.port).await;
    // Buffered Envoy: waits for the headers answer before sending the body.
    let mut s = EnvoyStream::post(&ch, "/v1/completions", &[], None, None).await;
    // The headers answer names a worker picked without the body (Envoy may
    // forward the headers on it); the body's answer re-decides.
    let r = expect_request_headers(&s.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    s.send(body_msg(br#"{"model":"m","prompt":"hi"}"#, true, false))
        .await;
    let (r, _) = expect_request_body(&s.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_some());

    // Full-duplex Envoy: the body follows at once; kvpick holds the headers.
    let mut s = EnvoyStream::post(&ch, "/v1/completions", &[], None, None).await;
    s.send(body_msg(br#"{"model":"m","prompt":"hi"}"#, true, false))
        .await;
    let r = expect_request_headers(&s.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    let (echo, _) = collect_streamed(&mut s).await;
    assert_eq!(echo, br#"{"model":"m","prompt":"hi"}"#);
}

#[tokio::test]
async fn header_only_request_is_routed_at_once() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let mut s = EnvoyStream::open(&ch).await;
    let h = vec![
        (":method".to_string(), "GET".to_string()),
        (":path".to_string(), "/v1/models".to_string()),
    ];
    s.send(req_headers(
        &h,
        true,
        Some(BodySendMode::FullDuplexStreamed),
        None,
    ))
    .await;
    let r = expect_request_headers(&s.recv().await);
    assert!(r.clear_route_cache);
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    assert_eq!(
        r.metadata_destination.as_deref(),
        r.get("x-gateway-destination-endpoint")
    );
}

#[tokio::test]
async fn spoofed_routing_headers_are_overwritten_or_removed() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let spoof = [
        ("x-worker-instance-id", "999"),
        ("x-dp-rank", "7"),
        ("x-prefill-instance-id", "5"),
        ("x-prefill-dp-rank", "3"),
        ("x-gateway-destination-endpoint", "6.6.6.6:80"),
        ("x-gateway-destination-endpoint-served", "6.6.6.6:80"),
        ("X-Prefill-Bootstrap-Host", "6.6.6.6"),
    ];
    let (_, r, _) = full_duplex(&ch, &chat_body("x"), &spoof, None).await;
    let dest = r.get("x-gateway-destination-endpoint").unwrap();
    assert_ne!(dest, "6.6.6.6:80");
    assert_ne!(r.get("x-worker-instance-id"), Some("999"));
    assert_eq!(r.get("x-dp-rank"), Some("0"));
    let removed: HashSet<&str> = r.removed.iter().map(String::as_str).collect();
    for name in [
        "x-prefill-instance-id",
        "x-prefill-dp-rank",
        "x-gateway-destination-endpoint-served",
        "x-prefill-bootstrap-host",
    ] {
        assert!(removed.contains(name), "{name} not removed: {removed:?}");
    }
    // Every routing header the client sent is either set by kvpick or removed.
    for (name, _) in spoof {
        let name = name.to_ascii_lowercase();
        assert!(
            r.get(&name).is_some() || removed.contains(name.as_str()),
            "{name} leaks"
        );
    }
}

#[tokio::test]
async fn buffered_mode_strips_spoofed_headers_on_the_headers_answer() {
    let srv = start(pool(1)).await;
    let ch = channel(srv.port).await;
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[("x-prefill-instance-id", "1")],
        Some(BodySendMode::Buffered),
        None,
    )
    .await;
    let r = expect_request_headers(&s.recv().await);
    assert_eq!(r.removed, vec!["x-prefill-instance-id".to_string()]);
}

#[tokio::test]
async fn client_worker_choice_in_body_is_removed() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":{"backend_instance_id":12345,"session_control":{"session_id":"s"}}}"#;
    let (_, r, echo) = full_duplex(&ch, body, &[], None).await;
    let v: serde_json::Value = serde_json::from_slice(&echo).unwrap();
    assert!(v["nvext"].get("backend_instance_id").is_none());
    assert_eq!(v["nvext"]["session_control"]["session_id"], "s");
    assert_eq!(r.get("content-length").unwrap(), echo.len().to_string());
}

#[tokio::test]
async fn bad_bodies_get_400_with_a_json_error_naming_the_field() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let cases: [(&[u8], &str); 4] = [
        (b"{not json", "not valid JSON"),
        (br#"{"model":"m"}"#, "`messages`"),
        (
            br#"{"messages":[{"role":"user","content":"x"}]}"#,
            "`model`",
        ),
        (
            br#"{"model":"m","messages":[{"role":"user","content":3}]}"#,
            "messages[0].content",
        ),
    ];
    for (body, needle) in cases {
        let mut s = EnvoyStream::post(
            &ch,
            "/v1/chat/completions",
            &[],
            Some(BodySendMode::FullDuplexStreamed),
            None,
        )
        .await;
        s.send(body_msg(body, true, false)).await;
        let (code, err) = immediate_status(&s.recv().await);
        assert_eq!(code, 400);
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    // The server keeps serving.
    let (_, r, _) = full_duplex(&ch, &chat_body("ok"), &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
}

#[tokio::test]
async fn no_endpoint_is_503() {
    let srv = start(Vec::new()).await;
    let ch = channel(srv.port).await;
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/chat/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    s.send(body_msg(&chat_body("x"), true, false)).await;
    let (code, err) = immediate_status(&s.recv().await);
    assert_eq!(code, 503);
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no ready endpoint"));
}

fn subset_metadata(value: Kind) -> Metadata {
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        "envoy.lb.subset_hint".into(),
        Struct {
            fields: [(
                "x-gateway-destination-endpoint-subset".to_string(),
                Value { kind: Some(value) },
            )]
            .into_iter()
            .collect(),
        },
    );
    md
}

#[tokio::test]
async fn subset_hint_restricts_candidates() {
    let srv = start(pool(4)).await;
    let ch = channel(srv.port).await;
    let list = Kind::ListValue(ListValue {
        values: ["10.0.0.2:8000", "10.0.0.3:8000"]
            .iter()
            .map(|a| Value {
                kind: Some(Kind::StringValue(a.to_string())),
            })
            .collect(),
    });
    for _ in 0..10 {
        let (_, r, _) = full_duplex(
            &ch,
            &chat_body("x"),
            &[],
            Some(subset_metadata(list.clone())),
        )
        .await;
        let dest = r.get("x-gateway-destination-endpoint").unwrap();
        assert!(dest == "10.0.0.2:8000" || dest == "10.0.0.3:8000", "{dest}");
    }
    let csv = Kind::StringValue("10.0.0.4:8000, 10.0.0.9:8000".into());
    let (_, r, _) = full_duplex(&ch, &chat_body("x"), &[], Some(subset_metadata(csv))).await;
    assert_eq!(
        r.get("x-gateway-destination-endpoint"),
        Some("10.0.0.4:8000")
    );

    for empty in [
        Kind::StringValue("10.9.9.9:1".into()),
        Kind::ListValue(ListValue::default()),
    ] {
        let mut s = EnvoyStream::post(
            &ch,
            "/v1/chat/completions",
            &[],
            Some(BodySendMode::FullDuplexStreamed),
            Some(subset_metadata(empty)),
        )
        .await;
        s.send(body_msg(&chat_body("x"), true, false)).await;
        assert_eq!(immediate_status(&s.recv().await).0, 503);
    }
}

#[tokio::test]
async fn dp_ranks_and_prefill_headers() {
    let mut dp = endpoint("10.0.0.1:8000");
    dp.dp_size = 4;
    dp.role = Role::Decode;
    dp.instance_id = 77;
    let mut prefill = endpoint("10.0.0.2:8000");
    prefill.role = Role::Prefill;
    prefill.instance_id = 88;
    prefill.bootstrap_port = Some(8998);
    let srv = start(vec![dp, prefill]).await;
    let ch = channel(srv.port).await;
    let mut ranks = HashSet::new();
    let mut open = Vec::new();
    for _ in 0..4 {
        let (s, r, _) = full_duplex(&ch, &chat_body("x"), &[], None).await;
        assert_eq!(
            r.get("x-gateway-destination-endpoint"),
            Some("10.0.0.1:8000")
        );
        assert_eq!(r.get("x-worker-instance-id"), Some("77"));
        assert_eq!(r.get("x-prefill-instance-id"), Some("88"));
        assert_eq!(r.get("x-prefill-dp-rank"), Some("0"));
        assert_eq!(r.get("x-prefill-bootstrap-host"), Some("10.0.0.2"));
        assert_eq!(r.get("x-prefill-bootstrap-port"), Some("8998"));
        let room: u64 = r.get("x-prefill-bootstrap-room").unwrap().parse().unwrap();
        assert!(room < 1 << 63);
        ranks.insert(r.get("x-dp-rank").unwrap().to_string());
        open.push(s); // keep the requests in flight
    }
    assert_eq!(
        ranks.len(),
        4,
        "each in-flight request on its own rank: {ranks:?}"
    );
}

fn total_in_flight(app: &App) -> u32 {
    app.endpoints
        .snapshot()
        .endpoints
        .iter()
        .map(|e| e.in_flight_total())
        .sum()
}

async fn wait_in_flight(app: &App, want: u32) {
    for _ in 0..200 {
        if total_in_flight(app) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("in-flight stayed at {} (want {want})", total_in_flight(app));
}

#[tokio::test]
async fn response_path_releases_in_flight() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let (mut s, _, _) = full_duplex(&ch, &chat_body("x"), &[], None).await;
    assert_eq!(total_in_flight(&srv.app), 1);
    s.send(resp_headers("200", false)).await;
    match s.recv().await.response {
        Some(processing_response::Response::ResponseHeaders(_)) => {}
        other => panic!("expected a response-headers answer, got {other:?}"),
    }
    let sse = b"data: {\"choices\":[]}\n\n";
    s.send(body_msg(sse, false, true)).await;
    s.send(body_msg(b"data: [DONE]\n\n", true, true)).await;
    let mut echoed = Vec::new();
    for _ in 0..2 {
        match s.recv().await.response {
            Some(processing_response::Response::ResponseBody(b)) => {
                let Some(body_mutation::Mutation::StreamedResponse(c)) = b
                    .response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation)
                else {
                    panic!("full-duplex response body must be streamed back");
                };
                echoed.extend_from_slice(&c.body);
            }
            other => panic!("expected a response-body answer, got {other:?}"),
        }
    }
    assert_eq!(echoed, [&sse[..], b"data: [DONE]\n\n"].concat());
    wait_in_flight(&srv.app, 0).await;

    // A stream that ends early (client gone) also releases its slot.
    let (s, _, _) = full_duplex(&ch, &chat_body("y"), &[], None).await;
    assert_eq!(total_in_flight(&srv.app), 1);
    drop(s);
    wait_in_flight(&srv.app, 0).await;
}

#[tokio::test]
async fn five_hundred_concurrent_streams() {
    let srv = Arc::new(start(pool(8)).await);
    let ch = channel(srv.port).await;
    let mut tasks = Vec::new();
    for i in 0..500 {
        let ch = ch.clone();
        tasks.push(tokio::spawn(async move {
            let body = chat_body(&format!("request number {i}"));
            let (s, r, echo) = full_duplex(&ch, &body, &[], None).await;
            assert_eq!(echo, body);
            (
                s,
                r.get("x-gateway-destination-endpoint").unwrap().to_string(),
            )
        }));
    }
    let mut streams = Vec::new();
    let mut per_dest = std::collections::HashMap::<String, usize>::new();
    for t in tasks {
        let (s, dest) = t.await.unwrap();
        *per_dest.entry(dest).or_default() += 1;
        streams.push(s);
    }
    assert_eq!(total_in_flight(&srv.app), 500);
    // Fewest in-flight keeps 500 open requests spread evenly over 8 endpoints.
    assert_eq!(per_dest.len(), 8);
    assert!(
        per_dest.values().all(|n| (45..=80).contains(n)),
        "{per_dest:?}"
    );
    drop(streams);
    wait_in_flight(&srv.app, 0).await;
}

#[tokio::test]
async fn tls_is_served_with_a_self_signed_certificate() {
    let app = App::new("tls");
    app.endpoints.replace(pool(1));
    let (tls, cert_pem) = kvpick::tls::self_signed(&["localhost"]).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        Some(tls),
    ));
    let client_tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(cert_pem))
        .domain_name("localhost");
    let ch = Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(client_tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (_, r, _) = full_duplex(&ch, &chat_body("secure"), &[], None).await;
    assert_eq!(
        r.get("x-gateway-destination-endpoint"),
        Some("10.0.0.1:8000")
    );
    // Plaintext gRPC against the TLS port fails.
    let plain = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(plain) = plain {
        let (_tx, rx) = mpsc::channel::<ProcessingRequest>(1);
        assert!(ExternalProcessorClient::new(plain)
            .process(ReceiverStream::new(rx))
            .await
            .is_err());
    }
}

/// A chat body carrying `nvext`.
fn chat_with_nvext(text: &str, nvext: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "llama",
        "messages": [{"role": "user", "content": text}],
        "nvext": nvext,
    }))
    .unwrap()
}

/// Answers a routed stream's response with `status` and ends it.
async fn complete(mut s: EnvoyStream, status: &str) {
    s.send(resp_headers(status, true)).await;
    let _ = s.recv().await;
}

#[tokio::test]
async fn rehomed_session_turn_is_forwarded_as_an_open_with_its_timeout() {
    let srv = start(pool(3)).await;
    let ch = channel(srv.port).await;
    let sc = |action: Option<&str>| {
        let mut v = serde_json::json!({"session_id": "agent-1"});
        if let Some(a) = action {
            v["action"] = a.into();
            v["timeout"] = 1200.into();
        }
        serde_json::json!({ "session_control": v })
    };
    let open = chat_with_nvext("plan", sc(Some("open")));
    let (s, r, echo) = full_duplex(&ch, &open, &[], None).await;
    assert_eq!(echo, open);
    let home = r.get("x-gateway-destination-endpoint").unwrap().to_string();
    complete(s, "200").await;
    wait_in_flight(&srv.app, 0).await;

    // The session's worker goes away.
    let rest: Vec<Endpoint> = srv
        .app
        .endpoints
        .snapshot()
        .endpoints
        .iter()
        .filter(|e| e.endpoint.address_string() != home)
        .map(|e| e.endpoint.clone())
        .collect();
    srv.app.endpoints.replace(rest);

    let mid = chat_with_nvext("tool result", sc(None));
    let (s, r, echo) = full_duplex(&ch, &mid, &[], None).await;
    let new_home = r.get("x-gateway-destination-endpoint").unwrap().to_string();
    assert_ne!(new_home, home);
    let v: serde_json::Value = serde_json::from_slice(&echo).unwrap();
    assert_eq!(v["nvext"]["session_control"]["action"], "open");
    assert_eq!(v["nvext"]["session_control"]["timeout"], 1200);
    assert_eq!(v["nvext"]["session_control"]["session_id"], "agent-1");
    assert_eq!(v["messages"][0]["content"], "tool result");
    assert_eq!(r.get("content-length").unwrap(), echo.len().to_string());
    complete(s, "200").await;
    wait_in_flight(&srv.app, 0).await;

    // The following turns stick to the new worker, unchanged.
    for i in 0..3 {
        let next = chat_with_nvext(&format!("turn {i}"), sc(None));
        let (s, r, echo) = full_duplex(&ch, &next, &[], None).await;
        assert_eq!(
            r.get("x-gateway-destination-endpoint"),
            Some(new_home.as_str())
        );
        assert_eq!(echo, next);
        complete(s, "200").await;
    }
    let metrics = srv.app.metrics.render(&srv.app.endpoints);
    assert!(
        metrics.contains("kvpick_session_rehomes_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn agent_hints_and_cache_control_bodies_pass_unchanged() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "llama",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "long context", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ]}],
        "nvext": {
            "agent_hints": {"priority": 5, "osl": 512, "speculative_prefill": true, "future_hint": [1, 2]},
            "session_control": {"session_id": "s-hints", "action": "open", "timeout": 600}
        }
    }))
    .unwrap();
    let (_, r, echo) = full_duplex(&ch, &body, &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    assert_eq!(echo, body, "forwarded byte for byte");
    assert!(r.get("content-length").is_none());
}

#[tokio::test]
async fn dp_rank_fields_in_body_are_stripped() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let body = chat_with_nvext(
        "hi",
        serde_json::json!({"dp_rank": 3, "prefill_dp_rank": 1, "session_control": {"session_id": "s"}}),
    );
    let (_, r, echo) = full_duplex(&ch, &body, &[], None).await;
    let v: serde_json::Value = serde_json::from_slice(&echo).unwrap();
    assert!(v["nvext"].get("dp_rank").is_none(), "{v}");
    assert!(v["nvext"].get("prefill_dp_rank").is_none(), "{v}");
    assert_eq!(v["nvext"]["session_control"]["session_id"], "s");
    assert_eq!(r.get("x-dp-rank"), Some("0"));
}

#[tokio::test]
async fn sglang_prefill_without_bootstrap_annotation_gets_port_8998() {
    use kvpick::endpoints::Engine;
    let mut decode = endpoint("10.0.0.1:8000");
    decode.role = Role::Decode;
    let mut prefill = endpoint("10.0.0.2:8000");
    prefill.role = Role::Prefill;
    prefill.engine = Engine::Sglang;
    let srv = start(vec![decode.clone(), prefill.clone()]).await;
    let ch = channel(srv.port).await;
    let (_, r, _) = full_duplex(&ch, &chat_body("x"), &[], None).await;
    assert_eq!(r.get("x-prefill-bootstrap-host"), Some("10.0.0.2"));
    assert_eq!(r.get("x-prefill-bootstrap-port"), Some("8998"));
    assert!(r.get("x-prefill-bootstrap-room").is_some());
    // A vLLM prefill worker without the annotation gets no bootstrap headers.
    prefill.engine = Engine::Vllm;
    srv.app.endpoints.replace(vec![decode, prefill]);
    let (_, r, _) = full_duplex(&ch, &chat_body("y"), &[], None).await;
    assert!(r.get("x-prefill-instance-id").is_some());
    assert_eq!(r.get("x-prefill-bootstrap-port"), None);
}

#[tokio::test]
async fn session_turn_with_a_u64_max_timeout_is_a_400_not_a_crash() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let open = chat_with_nvext(
        "x",
        serde_json::json!({"session_control": {"session_id": "big", "action": "open"}}),
    );
    let (s, _, _) = full_duplex(&ch, &open, &[], None).await;
    complete(s, "200").await;
    let turn = chat_with_nvext(
        "y",
        serde_json::json!({"session_control": {"session_id": "big", "timeout": 18446744073709551615u64}}),
    );
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/chat/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    s.send(body_msg(&turn, true, false)).await;
    let (code, err) = immediate_status(&s.recv().await);
    assert_eq!(code, 400, "{err}");
    assert!(err.to_string().contains("timeout"), "{err}");
    // The stream and the server keep working.
    let (_, r, _) = full_duplex(&ch, &chat_body("z"), &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
}

/// A completions body of about `bytes` bytes.
fn big_body(bytes: usize) -> Vec<u8> {
    format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(bytes)).into_bytes()
}

#[tokio::test]
async fn oversized_bodies_get_413_in_every_body_mode() {
    let cap = 5 << 20;
    let config = ExtProcConfig {
        max_body_bytes: cap,
        ..Default::default()
    };
    let srv = start_with(pool(2), config).await;
    let ch = channel(srv.port).await;
    let over = big_body(cap + 1024);

    // Full duplex: chunks without waiting; the one crossing the cap gets 413.
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    let chunks: Vec<&[u8]> = over.chunks(1 << 20).collect();
    for (i, c) in chunks.iter().enumerate() {
        s.send(body_msg(c, i + 1 == chunks.len(), false)).await;
    }
    let (status, json) = immediate_status(&s.recv().await);
    assert_eq!(status, 413);
    assert!(json["error"]["message"].as_str().unwrap().contains("limit"));

    // Buffered: one message above tonic's 4 MiB default still reaches kvpick.
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::Buffered),
        None,
    )
    .await;
    expect_request_headers(&s.recv().await);
    s.send(body_msg(&over, true, false)).await;
    assert_eq!(immediate_status(&s.recv().await).0, 413);

    // Streamed: one answer per chunk until the cap is crossed.
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::Streamed),
        None,
    )
    .await;
    expect_request_headers(&s.recv().await);
    let mut status = None;
    for (i, c) in chunks.iter().enumerate() {
        s.send(body_msg(c, i + 1 == chunks.len(), false)).await;
        let msg = s.recv().await;
        if let Some(processing_response::Response::ImmediateResponse(_)) = &msg.response {
            status = Some(immediate_status(&msg).0);
            break;
        }
    }
    assert_eq!(status, Some(413));

    // A buffered body above 4 MiB but within the cap is routed, not a gRPC error.
    let fits = big_body(cap - 4096);
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::Buffered),
        None,
    )
    .await;
    expect_request_headers(&s.recv().await);
    s.send(body_msg(&fits, true, false)).await;
    let (r, _) = expect_request_body(&s.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_some());
}

#[tokio::test]
async fn a_body_over_the_budget_gets_429_and_the_server_keeps_serving() {
    let config = ExtProcConfig {
        body_budget_bytes: 1 << 20,
        ..Default::default()
    };
    let srv = start_with(pool(2), config).await;
    let ch = channel(srv.port).await;
    // A holds 768 KiB of an unfinished 900 KiB body.
    let held = big_body(900 << 10);
    let mut a = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    a.send(body_msg(&held[..768 << 10], false, false)).await;
    assert!(a.silent_for(100).await);
    // B does not fit next to it.
    let mut b = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    b.send(body_msg(&big_body(512 << 10), true, false)).await;
    let (status, json) = immediate_status(&b.recv().await);
    assert_eq!(status, 429);
    assert!(json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("budget"));
    // Small requests still route, and A finishes normally.
    let (_, r, _) = full_duplex(&ch, &chat_body("small"), &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    a.send(body_msg(&held[768 << 10..], true, false)).await;
    let r = expect_request_headers(&a.recv().await);
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    assert_eq!(srv.app.metrics.body_budget_rejections.get(), 1);
}

#[tokio::test]
async fn a_body_that_stops_arriving_gets_408() {
    let config = ExtProcConfig {
        body_deadline: Duration::from_millis(200),
        ..Default::default()
    };
    let srv = start_with(pool(2), config).await;
    let ch = channel(srv.port).await;
    let mut s = EnvoyStream::post(
        &ch,
        "/v1/completions",
        &[],
        Some(BodySendMode::FullDuplexStreamed),
        None,
    )
    .await;
    s.send(body_msg(br#"{"model":"m","pro"#, false, false))
        .await;
    let (status, json) = immediate_status(&s.recv().await);
    assert_eq!(status, 408);
    assert_eq!(json["error"]["code"], 408);
    // The server still serves.
    let (_, r, _) = full_duplex(&ch, &chat_body("next"), &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
}

/// A routed request whose response ends with the engine's `usage` (streamed SSE) is
/// counted in GIE's `inference_objective_*` size and token histograms.
#[tokio::test]
async fn response_usage_and_sizes_feed_the_objective_metrics() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let body = chat_body("count my tokens");
    let (mut s, _, _) = full_duplex(&ch, &body, &[], None).await;
    s.send(resp_headers("200", false)).await;
    let _ = s.recv().await;
    let chunks: [&[u8]; 3] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":21,\"completion_tokens\":5}}\n\n",
        b"data: [DONE]\n\n",
    ];
    for (i, c) in chunks.iter().enumerate() {
        s.send(body_msg(c, i + 1 == chunks.len(), true)).await;
        let _ = s.recv().await;
    }
    wait_in_flight(&srv.app, 0).await;
    let text = srv.app.metrics.render(&srv.app.endpoints);
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
            .to_string()
    };
    assert!(line("inference_objective_input_tokens_sum").ends_with(" 21.0"));
    assert!(line("inference_objective_output_tokens_sum").ends_with(" 5.0"));
    let response_bytes: usize = chunks.iter().map(|c| c.len()).sum();
    assert!(
        line("inference_objective_response_sizes_sum").ends_with(&format!(" {response_bytes}.0"))
    );
    assert!(line("inference_objective_request_sizes_sum").ends_with(&format!(" {}.0", body.len())));
}
