//! Socket-free tests of the stream state machine.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;

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
    let d = &s.routed.as_ref().unwrap().decision;
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
    let ep = Arc::clone(&s.routed.as_ref().unwrap().decision.decode.state);
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
    let decision = |s: &StreamState| s.routed.as_ref().unwrap().decision.clone();
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
