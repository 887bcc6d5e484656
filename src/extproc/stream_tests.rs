//! Socket-free tests of the stream state machine.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;

use std::collections::HashSet;

use super::*;
use crate::endpoints::{Endpoint, Engine};
use crate::extproc::messages::DESTINATION_KEY;
use crate::extproc::ExtProcConfig;

fn app() -> crate::server::App {
    let app = crate::server::App::new("t");
    app.endpoints.replace(vec![
        Endpoint::new("10.0.0.1:8000".parse().unwrap()),
        Endpoint::new("10.0.0.2:8000".parse().unwrap()),
    ]);
    app
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    let value = |&(key, v): &(&str, &str)| HeaderValue {
        key: key.into(),
        raw_value: v.into(),
        ..Default::default()
    };
    HeaderMap {
        headers: pairs.iter().map(value).collect(),
    }
}

/// Request headers of a POST with a body to follow, without `protocol_config`.
fn post_headers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&[
                (":method", "POST"),
                (":path", "/v1/completions"),
            ])),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body_chunk(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(status: &str) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(&[(":status", status)])),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The destination an answer sets, from its header mutation.
fn destination(answer: &ProcessingResponse) -> Option<String> {
    let common = match answer.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == DESTINATION_KEY)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

fn booked(app: &crate::server::App) -> u64 {
    let snap = app.endpoints.snapshot();
    snap.endpoints.iter().map(|e| e.active_load(0).blocks).sum()
}

#[test]
fn headers_answered_after_the_body_wait_carry_a_destination() {
    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let mut s = StreamState::new(Arc::clone(&service.shared));
    assert!(s.handle(post_headers()).is_empty());
    assert!(s.waiting_to_infer_mode());

    // The wait ran out: Envoy may forward the headers on this answer (full
    // duplex with a slow client, or STREAMED), so it must name a worker.
    let out = s.body_wait_expired();
    assert_eq!(out.len(), 1);
    assert!(matches!(out[0].response, Some(Response::RequestHeaders(_))));
    let early = destination(&out[0]).expect("headers answered without a destination");
    assert!(out[0].dynamic_metadata.is_some());
    assert!(!s.waiting_to_infer_mode());

    // A buffered body that follows is routed on its content and re-decides on
    // its own answer; the decision made on the headers alone is withdrawn.
    let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "words ".repeat(40));
    let body = body.as_bytes();
    let out = s.handle(body_chunk(body, true));
    assert_eq!(out.len(), 1);
    assert!(matches!(out[0].response, Some(Response::RequestBody(_))));
    let routed = destination(&out[0]).expect("body answer without a destination");
    let d = s.flow.decision().unwrap();
    assert_eq!(booked(&app), d.load_blocks + d.decode_blocks);
    assert!(d.prompt_blocks > 0, "routed on the body, not the headers");
    assert!([early.as_str(), routed.as_str()]
        .iter()
        .all(|a| a.starts_with("10.0.0.")));

    // The response ends the request: nothing stays booked, and it counted once.
    s.handle(response_headers("200"));
    assert!(s.is_done());
    assert_eq!(booked(&app), 0);
    let page = service.shared.metrics.render(&app.endpoints);
    let routed_line = page
        .lines()
        .find(|l| l.starts_with("kvpick_requests_total{") && l.contains("routed"))
        .unwrap();
    assert!(routed_line.ends_with(" 1"), "{routed_line}");
}

/// Log lines written while `f` runs under a subscriber at `level`.
fn logged(level: tracing::Level, f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = sink.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn a_routed_request_logs_nothing_at_info() {
    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let route_one = || {
        let mut s = StreamState::new(Arc::clone(&service.shared));
        s.handle(post_headers());
        let out = s.handle(body_chunk(br#"{"model":"m","prompt":"hi"}"#, true));
        assert!(destination(&out[0]).is_some());
        s.handle(response_headers("200"));
    };
    let info = logged(tracing::Level::INFO, route_one);
    assert!(info.is_empty(), "per-request lines at INFO: {info}");
    // The decision is still there for whoever turns DEBUG on.
    let debug = logged(tracing::Level::DEBUG, route_one);
    assert!(debug.contains("routed"), "{debug}");
}

/// Request headers of a chat POST whose body Envoy streams full duplex.
fn chat_headers_full_duplex() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
            ])),
            ..Default::default()
        })),
        protocol_config: Some(
            envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration {
                request_body_mode: BodySendMode::FullDuplexStreamed as i32,
                ..Default::default()
            },
        ),
        ..Default::default()
    }
}

/// Serves one PNG (a 224×224 header) for any URL.
struct OnePng;

impl crate::multimodal::remote::ImageFetcher for OnePng {
    fn fetch<'a>(
        &'a self,
        _url: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<Vec<u8>, crate::multimodal::remote::FetchError>>
    {
        Box::pin(async { Ok(png_224()) })
    }
}

fn png_224() -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    b.extend_from_slice(&224u32.to_be_bytes());
    b.extend_from_slice(&224u32.to_be_bytes());
    b.extend_from_slice(&[8, 6, 0, 0, 0]);
    b
}

#[tokio::test]
async fn an_sglang_worker_is_told_the_content_hash_of_a_fetched_image() {
    use crate::multimodal::identity::{content_identity, sglang_mm_hash};
    use crate::multimodal::remote::{FetchLimits, RemoteImages};
    use crate::multimodal::{VisionFamily, VisionPrompt};
    use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation;

    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen-vl-tokenizer");
    let tokenizer = crate::tokenize::Tokenizer::load(dir)
        .unwrap()
        .with_vision(VisionPrompt::new(VisionFamily::Qwen2Vl))
        .unwrap();
    let remote = Arc::new(RemoteImages::new(Arc::new(OnePng), FetchLimits::default()));
    let mut app = crate::server::App::new("t");
    let mut sglang = Endpoint::new("10.0.0.1:8000".parse().unwrap());
    sglang.engine = Engine::Sglang;
    app.endpoints.replace(vec![sglang]);
    app.tokenizer =
        Some(crate::tokenize::TokenizerPool::new(tokenizer, 1).with_remote_images(remote));
    let service = app.ext_proc(ExtProcConfig::default());
    let mut s = StreamState::new(Arc::clone(&service.shared));

    assert!(s.handle(chat_headers_full_duplex()).is_empty());
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://img.example/cat.png"}},
    ]}]});
    let out = s.handle(body_chunk(&serde_json::to_vec(&body).unwrap(), true));
    assert!(out.is_empty(), "waits for its tokens");
    let job = s.take_tokenize_job().expect("a tokenize job");
    let out = s.tokenized(job.run().await);
    assert!(destination(&out[0]).is_some());
    let mut routed = Vec::new();
    while let Some(msg) = s.next_echo() {
        if let Some(Response::RequestBody(b)) = msg.response {
            let mutation = b
                .response
                .and_then(|c| c.body_mutation)
                .and_then(|m| m.mutation);
            if let Some(body_mutation::Mutation::StreamedResponse(chunk)) = mutation {
                routed.extend_from_slice(&chunk.body);
            }
        }
    }
    let routed: serde_json::Value = serde_json::from_slice(&routed).unwrap();
    assert_eq!(
        routed["nvext"]["mm_hashes"],
        serde_json::json!([sglang_mm_hash(content_identity(&png_224()).mm_hash)]),
        "the hash of the fetched bytes, as for the same file sent as a data: URL"
    );
}

#[test]
fn repeated_or_early_response_headers_change_nothing() {
    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let mut s = StreamState::new(Arc::clone(&service.shared));
    s.handle(post_headers());
    let out = s.handle(body_chunk(br#"{"model":"m","prompt":"hi"}"#, true));
    let to = destination(&out[0]).unwrap();
    let ep = Arc::clone(&s.flow.decision().unwrap().decode.state);
    // One real failure, then forged repeats of it on the same stream: enough to
    // eject the worker (3 failures) if each counted.
    let not_last = |status: &str| {
        let mut r = response_headers(status);
        if let Some(Request::ResponseHeaders(h)) = r.request.as_mut() {
            h.end_of_stream = false;
        }
        r
    };
    for _ in 0..5 {
        s.handle(not_last("503"));
    }
    assert_eq!(ep.health().failures(), 1, "only the first response counts");
    assert!(
        ep.health().available(Instant::now()),
        "{to} ejected by forged responses"
    );

    // Response headers before the request went out (body still arriving) do
    // not count either.
    let mut early = StreamState::new(Arc::clone(&service.shared));
    early.handle(post_headers());
    early.body_wait_expired();
    early.handle(not_last("503"));
    let failures: u32 = app
        .endpoints
        .snapshot()
        .endpoints
        .iter()
        .map(|e| e.health().failures())
        .sum();
    assert_eq!(failures, 1);
}

#[test]
fn images_routed_without_a_tokenizer_are_counted_by_identity() {
    use crate::multimodal::identity::IdentitySource;
    use crate::multimodal::MmRouting;

    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let mut s = StreamState::new(Arc::clone(&service.shared));
    s.handle(chat_headers_full_duplex());
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://img.example/cat.png"}},
    ]}]});
    let out = s.handle(body_chunk(&serde_json::to_vec(&body).unwrap(), true));
    assert!(destination(&out[0]).is_some());
    assert_eq!(app.mm_stats.images(IdentitySource::Content), 1);
    assert_eq!(app.mm_stats.images(IdentitySource::Url), 1);
    assert_eq!(app.mm_stats.requests(MmRouting::Approximate), 1);
}

fn response_chunk(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[test]
fn the_first_response_body_chunk_ends_the_prefill_once() {
    let app = crate::server::App::new("t");
    app.endpoints
        .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
    let service = app.ext_proc(ExtProcConfig::default());
    let route = |text: &str| {
        let mut s = StreamState::new(Arc::clone(&service.shared));
        s.handle(post_headers());
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, text.repeat(64 * 10));
        s.handle(body_chunk(body.as_bytes(), true));
        s
    };
    let (mut first, second) = (route("a"), route("b"));
    let decision = |s: &StreamState| s.flow.decision().unwrap().clone();
    let (d1, d2) = (decision(&first), decision(&second));
    let load = || d1.decode.state.active_load(d1.decode.rank);
    assert!(d1.uncached_blocks >= 10 && d2.uncached_blocks >= 10);
    assert_eq!(load().uncached, d1.uncached_blocks + d2.uncached_blocks);
    // Streamed response headers may precede the first token: no signal yet.
    let mut headers = response_headers("200");
    if let Some(Request::ResponseHeaders(h)) = headers.request.as_mut() {
        h.end_of_stream = false;
    }
    first.handle(headers);
    assert_eq!(load().uncached, d1.uncached_blocks + d2.uncached_blocks);
    // The first token: the first's uncached blocks go, and only they, however
    // many chunks follow; the rest of its load stays until the end.
    for chunk in [&b"data: {\"x\":1}\n\n"[..], b"data: {\"x\":2}\n\n"] {
        first.handle(response_chunk(chunk, false));
        assert_eq!(load().uncached, d2.uncached_blocks);
        assert_eq!(
            load().blocks,
            d1.decode_load().blocks + d2.decode_load().blocks
        );
    }
    first.handle(response_chunk(b"data: [DONE]\n\n", true));
    assert!(first.is_done());
    assert_eq!(load(), d2.decode_load());
}

/// Routes a completions body whose request headers carry `tenant` (as
/// `x-tenant-id`) and returns the prefix blocks it found cached.
fn overlap_of(service: &crate::extproc::ExtProcService, tenant: Option<&str>, body: &str) -> usize {
    let mut headers = vec![(":method", "POST"), (":path", "/v1/completions")];
    headers.extend(tenant.map(|t| (crate::pipeline::TENANT_HEADER, t)));
    let mut s = StreamState::new(Arc::clone(&service.shared));
    s.handle(ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&headers)),
            ..Default::default()
        })),
        ..Default::default()
    });
    let out = s.handle(body_chunk(body.as_bytes(), true));
    assert!(destination(&out[0]).is_some(), "not routed: {out:?}");
    let overlap = s.flow.decision().unwrap().overlap_blocks;
    s.handle(response_headers("200"));
    overlap
}

#[test]
fn the_tenant_header_seeds_the_prefix_above_the_body_salt() {
    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let text = "words ".repeat(40);
    let body = |salt: &str| format!(r#"{{"model":"m","prompt":"{text}","cache_salt":"{salt}"}}"#);
    assert_eq!(overlap_of(&service, Some("tenant-a"), &body("x")), 0);
    let blocks = overlap_of(&service, Some("tenant-a"), &body("y"));
    assert!(
        blocks > 0,
        "the header, not the body's salt, names the tenant"
    );
    assert_eq!(
        overlap_of(&service, None, &body("x")),
        0,
        "the body's salt alone"
    );
    assert_eq!(overlap_of(&service, Some("tenant-b"), &body("x")), 0);
    assert_eq!(overlap_of(&service, None, &body("tenant-a")), blocks);
}

/// GIE's conformance scenarios, message by message as Envoy sends them: the
/// selection header restricts the pick (every port of a listed pod, for
/// data-parallel pools), a list naming no pod restricts nothing, and the
/// response reports the gateway's served endpoint, not kvpick's pick.
#[test]
fn conformance_hooks_restrict_by_the_selection_header_and_echo_the_served_endpoint() {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

    let app = crate::server::App::new("t");
    // A data-parallel pod with three target ports, and two single-port pods.
    let addrs = [
        "10.0.0.1:8000",
        "10.0.0.1:8001",
        "10.0.0.1:8002",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
    ];
    app.endpoints.replace(
        addrs
            .iter()
            .map(|a| Endpoint::new(a.parse().unwrap()))
            .collect(),
    );
    let hooks = |on: bool| {
        app.ext_proc(ExtProcConfig {
            conformance_test_hooks: on,
            ..ExtProcConfig::default()
        })
    };
    let served_md = |value: Option<&str>| {
        let mut md = Metadata::default();
        let fields = value
            .map(|v| {
                let v = Value {
                    kind: Some(Kind::StringValue(v.into())),
                };
                (conformance::SERVED_KEY.to_string(), v)
            })
            .into_iter()
            .collect();
        md.filter_metadata
            .insert(messages::LB_NAMESPACE.into(), Struct { fields });
        md
    };
    // One request (header-only, as the suite's GETs) with `selection`; the
    // response headers carry `metadata`. Returns (destination, served header).
    let run = |service: &crate::extproc::ExtProcService,
               selection: Option<&str>,
               metadata: Option<Metadata>| {
        let mut pairs = vec![(":method", "GET"), (":path", "/v1/models")];
        pairs.extend(selection.map(|s| (conformance::SELECTION_HEADER, s)));
        let mut s = StreamState::new(Arc::clone(&service.shared));
        let out = s.handle(ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&pairs)),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        });
        let picked = destination(&out[0]).expect("routed");
        let mut response = response_headers("200");
        response.metadata_context = metadata;
        let out = s.handle(response);
        let Some(Response::ResponseHeaders(h)) = &out[0].response else {
            panic!("not a response-headers answer: {out:?}");
        };
        let served = h
            .response
            .as_ref()
            .and_then(|c| c.header_mutation.as_ref())
            .and_then(|m| {
                m.set_headers
                    .iter()
                    .filter_map(|o| o.header.as_ref())
                    .find(|h| h.key == conformance::SERVED_HEADER)
            })
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
        (picked, served)
    };

    let on = hooks(true);
    let mut ports = HashSet::new();
    for _ in 0..60 {
        let (picked, _) = run(&on, Some("10.0.0.1"), None);
        assert!(picked.starts_with("10.0.0.1:"), "{picked}");
        ports.insert(picked);
        let (picked, _) = run(&on, Some("10.0.0.9, 10.0.0.3"), None);
        assert_eq!(picked, "10.0.0.3:8000");
        let (picked, _) = run(&on, Some("10.0.0.1:8002"), None);
        assert_eq!(picked, "10.0.0.1:8002");
    }
    assert_eq!(ports.len(), 3, "every data-parallel port is a candidate");
    let mut anywhere = HashSet::new();
    for _ in 0..60 {
        anywhere.insert(run(&on, Some("10.9.9.9"), None).0);
    }
    assert!(anywhere.len() > 1, "a list naming no pod restricts nothing");

    // The gateway's served endpoint is echoed as given, even where it differs
    // from the pick; missing metadata is reported as a failure.
    let (_, served) = run(&on, None, Some(served_md(Some("10.0.0.2:8000"))));
    assert_eq!(served.as_deref(), Some("10.0.0.2:8000"));
    let (_, served) = run(&on, None, Some(served_md(None)));
    assert_eq!(
        served.as_deref(),
        Some("fail: missing destination endpoint served metadata")
    );
    let (_, served) = run(&on, None, None);
    assert_eq!(served.as_deref(), Some("fail: missing envoy lb metadata"));

    // Off (the default): the header steers nothing and nothing is echoed.
    let off = hooks(false);
    let mut picked = HashSet::new();
    for _ in 0..60 {
        let (p, served) = run(&off, Some("10.0.0.3"), Some(served_md(Some("x"))));
        assert_eq!(served, None);
        picked.insert(p);
    }
    assert!(picked.len() > 1, "the header is ignored without the hooks");
}

/// With fallbacks (`--max-endpoints 2`), the gateway may serve a request from
/// the second endpoint (the first refused it); the response's `envoy.lb`
/// metadata says which. The in-flight count and the booked load move there,
/// and the request's end releases them there; a response served by the first
/// pick moves nothing.
#[test]
fn a_request_served_by_a_fallback_moves_its_booking_there() {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

    let app = crate::server::App::with_scheduler(
        "t",
        crate::scheduler::SchedulerConfig {
            max_endpoints: 2,
            ..Default::default()
        },
    );
    app.endpoints.replace(vec![
        Endpoint::new("10.0.0.1:8000".parse().unwrap()),
        Endpoint::new("10.0.0.2:8000".parse().unwrap()),
    ]);
    let service = app.ext_proc(ExtProcConfig::default());
    let load = |addr: &str| {
        let snap = app.endpoints.snapshot();
        let e = snap
            .endpoints
            .iter()
            .find(|e| e.endpoint.address.to_string() == addr)
            .unwrap();
        (e.in_flight(0), e.active_load(0).blocks)
    };
    for serve_second in [true, false] {
        let mut s = StreamState::new(Arc::clone(&service.shared));
        let out = s.handle(ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&[(":method", "GET"), (":path", "/v1/models")])),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        });
        let listed = destination(&out[0]).expect("routed");
        let [first, second] = listed.split(',').collect::<Vec<_>>()[..] else {
            panic!("expected a pick and one fallback: {listed}");
        };
        assert_eq!(load(first).0, 1);
        assert_eq!(load(second), (0, 0));
        let booked = load(first).1;
        assert!(booked > 0);
        let served = if serve_second { second } else { first };
        let mut md = Metadata::default();
        md.filter_metadata.insert(
            messages::LB_NAMESPACE.into(),
            Struct {
                fields: [(
                    messages::SERVED_KEY.to_string(),
                    Value {
                        kind: Some(Kind::StringValue(served.into())),
                    },
                )]
                .into_iter()
                .collect(),
            },
        );
        let mut response = response_headers("200");
        if let Some(Request::ResponseHeaders(h)) = &mut response.request {
            h.end_of_stream = false;
        }
        response.metadata_context = Some(md);
        s.handle(response);
        let other = if serve_second { first } else { second };
        assert_eq!(load(served), (1, booked), "served {served} of {listed}");
        assert_eq!(load(other), (0, 0), "not served: {other} of {listed}");
        s.handle(response_chunk(b"", true));
        assert_eq!(load(served), (0, 0));
        assert_eq!(load(other), (0, 0));
    }
}

/// Counts what a flow observer is told.
#[derive(Default)]
struct Counted(parking_lot::Mutex<Vec<&'static str>>);

impl crate::flow::FlowObserver for Counted {
    fn routed(&self, _: crate::flow::FlowId, _: &crate::scheduler::Decision, _: Instant) {
        self.0.lock().push("routed");
    }

    fn first_chunk(
        &self,
        _: crate::flow::FlowId,
        _: &crate::scheduler::Decision,
        _: Instant,
        _: usize,
    ) {
        self.0.lock().push("first");
    }

    fn chunk(&self, _: crate::flow::FlowId, _: &crate::scheduler::Decision, _: Instant, _: usize) {
        self.0.lock().push("chunk");
    }

    fn ended(
        &self,
        _: crate::flow::FlowId,
        _: &crate::scheduler::Decision,
        _: Instant,
        end: crate::flow::FlowEnd,
    ) {
        self.0.lock().push(match end {
            crate::flow::FlowEnd::Finished { .. } => "finished",
            crate::flow::FlowEnd::Cancelled => "cancelled",
        });
    }
}

#[test]
fn the_observers_in_shared_see_each_stream_end_once() {
    let app = app();
    let service = app.ext_proc(ExtProcConfig::default());
    let counted = Arc::new(Counted::default());
    let base = &service.shared;
    let flow = crate::flow::FlowContext::new(
        Arc::clone(&app.endpoints),
        Arc::clone(&app.scheduler),
        base.flow.pipeline.clone(),
        base.flow.admission.clone(),
    )
    .observed_by(Arc::clone(&counted) as _);
    let shared = Arc::new(crate::extproc::Shared {
        flow: Arc::new(flow),
        metrics: Arc::clone(&base.metrics),
        extproc_metrics: Arc::clone(&base.extproc_metrics),
        config: base.config.clone(),
        admission_metrics: None,
        body_budget: base.body_budget.clone(),
    });
    let routed = || {
        let mut s = StreamState::new(Arc::clone(&shared));
        s.handle(post_headers());
        s.handle(body_chunk(br#"{"model":"m","prompt":"hi"}"#, true));
        let mut headers = response_headers("200");
        if let Some(Request::ResponseHeaders(h)) = headers.request.as_mut() {
            h.end_of_stream = false;
        }
        s.handle(headers);
        s.handle(response_chunk(b"data: 1\n\n", false));
        s
    };
    // The body's end of stream, then trailers: the request ends once.
    let mut s = routed();
    s.handle(response_chunk(b"data: [DONE]\n\n", true));
    s.handle(ProcessingRequest {
        request: Some(Request::ResponseTrailers(Default::default())),
        ..Default::default()
    });
    drop(s);
    // A stream gone mid-response: cancelled, and nothing stays in flight.
    drop(routed());
    assert_eq!(
        *counted.0.lock(),
        [
            "routed",
            "first",
            "chunk",
            "finished",
            "routed",
            "first",
            "cancelled"
        ]
    );
    let snapshot = app.endpoints.snapshot();
    assert!(snapshot.endpoints.iter().all(|e| e.in_flight(0) == 0));
    assert_eq!(booked(&app), 0);
}
