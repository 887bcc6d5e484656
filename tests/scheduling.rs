//! ext_proc-level scheduling tests: a real kvpick ext_proc server on loopback,
//! driven by a tonic client that plays Envoy in FULL_DUPLEX_STREAMED mode.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, common_response::ResponseStatus, processing_request, processing_response,
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::messages::header_value;
use kvpick::extproc::ExtProcConfig;
use kvpick::scheduler::SchedulerConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

const LIMIT: Duration = Duration::from_secs(10);

/// A kvpick ext_proc server over `workers` fake endpoints.
async fn start(workers: usize, key: &[u8]) -> (App, SocketAddr) {
    let app = App::with_scheduler(
        "test",
        SchedulerConfig {
            session_key: key.to_vec(),
            ..Default::default()
        },
    );
    app.endpoints.replace(
        (1..=workers)
            .map(|i| Endpoint::new(format!("10.1.0.{i}:8000").parse().unwrap()))
            .collect(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = app.ext_proc(ExtProcConfig::default());
    tokio::spawn(serve_ext_proc(listener, service, None));
    (app, addr)
}

async fn client(addr: SocketAddr) -> ExternalProcessorClient<Channel> {
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    }
}

fn msg(r: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// One request in flight, as Envoy sees it.
struct Call {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    worker: u64,
}

async fn next(rx: &mut Streaming<ProcessingResponse>) -> ProcessingResponse {
    tokio::time::timeout(LIMIT, rx.message())
        .await
        .expect("kvpick answers in time")
        .expect("stream ok")
        .expect("stream open")
}

/// Sends request headers + body and reads the routing decision.
async fn send(
    c: &mut ExternalProcessorClient<Channel>,
    body: &str,
    extra: &[(&str, &str)],
) -> Call {
    let (tx, rx) = mpsc::channel(8);
    let mut rx = c
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut h = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    h.extend_from_slice(extra);
    let mut first = msg(processing_request::Request::RequestHeaders(headers(
        &h, false,
    )));
    let full = BodySendMode::FullDuplexStreamed as i32;
    first.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: full,
        response_body_mode: full,
        ..Default::default()
    });
    tx.send(first).await.unwrap();
    tx.send(msg(processing_request::Request::RequestBody(HttpBody {
        body: body.as_bytes().to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await
    .unwrap();
    let answer = next(&mut rx).await;
    let Some(processing_response::Response::RequestHeaders(h)) = answer.response else {
        panic!("expected a request headers answer, got {answer:?}");
    };
    let common = h.response.unwrap();
    assert_eq!(common.status, ResponseStatus::Continue as i32);
    let set: HashMap<String, String> = common
        .header_mutation
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .map(|v| (v.key.clone(), header_value(v)))
        .collect();
    let worker = set["x-worker-instance-id"].parse().unwrap();
    assert!(set.contains_key("x-gateway-destination-endpoint"));
    assert!(set.contains_key("x-dp-rank"));
    // The body streams back; wait for its last chunk.
    loop {
        let a = next(&mut rx).await;
        if let Some(processing_response::Response::RequestBody(b)) = a.response {
            let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
            if let body_mutation::Mutation::StreamedResponse(s) = m {
                if s.end_of_stream {
                    break;
                }
            }
        }
    }
    Call { tx, rx, worker }
}

impl Call {
    /// Plays the upstream response (status, then a final body chunk) and returns
    /// the session token kvpick set on the response, if any.
    async fn finish(mut self, status: u16) -> Option<String> {
        let st = status.to_string();
        self.tx
            .send(msg(processing_request::Request::ResponseHeaders(headers(
                &[(":status", &st)],
                false,
            ))))
            .await
            .unwrap();
        let a = next(&mut self.rx).await;
        let Some(processing_response::Response::ResponseHeaders(h)) = a.response else {
            panic!("expected a response headers answer, got {a:?}");
        };
        let token = h
            .response
            .and_then(|c| c.header_mutation)
            .into_iter()
            .flat_map(|m| m.set_headers)
            .filter_map(|o| o.header)
            .find(|v| v.key == "x-kvpick-session")
            .map(|v| header_value(&v));
        self.tx
            .send(msg(processing_request::Request::ResponseBody(HttpBody {
                body: b"{}".to_vec(),
                end_of_stream: true,
                ..Default::default()
            })))
            .await
            .unwrap();
        // Once the final body chunk is answered, kvpick has finished the request.
        let _ = next(&mut self.rx).await;
        token
    }
}

fn completion(prompt: &str, session: Option<(&str, Option<&str>)>) -> String {
    let mut body = serde_json::json!({"model": "m", "prompt": prompt});
    if let Some((id, action)) = session {
        let mut sc = serde_json::json!({"session_id": id, "timeout": 300});
        if let Some(a) = action {
            sc["action"] = a.into();
        }
        body["nvext"] = serde_json::json!({ "session_control": sc });
    }
    body.to_string()
}

#[tokio::test]
async fn repeated_long_prompt_returns_to_its_worker() {
    let (app, addr) = start(8, b"k").await;
    let mut c = client(addr).await;
    let long = completion(&"You are a careful assistant. ".repeat(400), None);
    let first = send(&mut c, &long, &[]).await;
    let home = first.worker;
    first.finish(200).await;
    for _ in 0..6 {
        let again = send(&mut c, &long, &[]).await;
        assert_eq!(again.worker, home);
        again.finish(200).await;
    }
    let stats = app.scheduler.stats();
    let asked = stats
        .blocks_queried
        .load(std::sync::atomic::Ordering::Relaxed);
    let hit = stats
        .blocks_matched
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(hit * 7, asked * 6, "every repeat is a full prefix hit");
}

#[tokio::test]
async fn distinct_prompts_under_load_spread_out() {
    let (_app, addr) = start(4, b"k").await;
    let mut c = client(addr).await;
    let mut held = Vec::new();
    let mut per_worker: HashMap<u64, usize> = HashMap::new();
    for i in 0..16 {
        let body = completion(&format!("{i:04} {}", "distinct ".repeat(100)), None);
        let call = send(&mut c, &body, &[]).await;
        *per_worker.entry(call.worker).or_default() += 1;
        held.push(call);
    }
    assert_eq!(per_worker.len(), 4, "{per_worker:?}");
    assert!(per_worker.values().all(|n| *n == 4), "{per_worker:?}");
    for call in held {
        call.finish(200).await;
    }
}

#[tokio::test]
async fn session_stays_put_from_open_to_close() {
    let (app, addr) = start(4, b"k").await;
    let mut c = client(addr).await;
    let open = send(
        &mut c,
        &completion("hello", Some(("agent-1", Some("open")))),
        &[],
    )
    .await;
    let home = open.worker;
    let token = open.finish(200).await;
    assert!(
        token.is_some(),
        "the opening response carries a session token"
    );
    assert_eq!(app.scheduler.sessions().len(), 1);
    for turn in 0..6 {
        // Each turn has an unrelated prompt and other traffic is in flight: without
        // the binding, turns would scatter over the four workers.
        let other = send(&mut c, &completion(&format!("noise {turn}"), None), &[]).await;
        let body = completion(
            &format!("turn {turn} {}", "x".repeat(300)),
            Some(("agent-1", None)),
        );
        let call = send(&mut c, &body, &[]).await;
        assert_eq!(call.worker, home, "turn {turn}");
        assert!(call.finish(200).await.is_some());
        other.finish(200).await;
    }
    let close = send(
        &mut c,
        &completion("bye", Some(("agent-1", Some("close")))),
        &[],
    )
    .await;
    assert_eq!(close.worker, home);
    assert!(close.finish(200).await.is_none(), "no token after close");
    assert!(app.scheduler.sessions().is_empty(), "close unbinds");
}

#[tokio::test]
async fn session_token_is_honoured_by_another_replica() {
    let key = b"replica shared key";
    let (_a, addr_a) = start(8, key).await;
    let (_b, addr_b) = start(8, key).await;
    let (_c, addr_c) = start(8, b"another key").await;
    let (mut a, mut b, mut c) = (
        client(addr_a).await,
        client(addr_b).await,
        client(addr_c).await,
    );
    let open = send(
        &mut a,
        &completion("hi", Some(("agent-2", Some("open")))),
        &[],
    )
    .await;
    let home = open.worker;
    let token = open.finish(200).await.unwrap();
    let turn = completion("next", Some(("agent-2", None)));
    for _ in 0..4 {
        let call = send(&mut b, &turn, &[("x-kvpick-session", &token)]).await;
        assert_eq!(call.worker, home);
        call.finish(200).await;
    }
    // A replica with another key ignores the token (failed turns bind nothing),
    // and so does a replica with the right key for another session id.
    let mut seen = std::collections::HashSet::new();
    for i in 0..12 {
        let call = send(&mut c, &turn, &[("x-kvpick-session", &token)]).await;
        seen.insert(call.worker);
        call.finish(500).await;
        let other = completion("next", Some((&format!("agent-x{i}"), None)));
        let call = send(&mut b, &other, &[("x-kvpick-session", &token)]).await;
        seen.insert(call.worker);
        call.finish(500).await;
    }
    assert!(seen.len() > 2, "{seen:?}");
}
