//! ext_proc-level scheduling tests: a real kvpick ext_proc server on loopback,
//! driven by `envoy-client` playing Envoy in FULL_DUPLEX_STREAMED mode.

use std::collections::HashMap;

use envoy_client::message::RequestHeaders;
use envoy_client::{BodyMode, Decision, EnvoyStream, RequestBody, ResponseOutcome};
use envoy_types::pb::envoy::service::ext_proc::v3::common_response::ResponseStatus;
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::scheduler::SchedulerConfig;
use kvpick::server::App;
use tonic::transport::Channel;

#[allow(dead_code)] // each test binary uses a part of it
mod support;
use support::channel;

/// A kvpick ext_proc server over `workers` fake endpoints.
async fn start(workers: usize, key: &[u8]) -> (App, u16) {
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
    let port = support::serve(&app, ExtProcConfig::default()).await;
    (app, port)
}

/// One request in flight, as Envoy sees it.
struct Call {
    stream: EnvoyStream,
    worker: u64,
}

/// Sends request headers + body and reads the routing decision and the body
/// streamed back.
async fn send(ch: &Channel, body: &str, extra: &[(&str, &str)]) -> Call {
    let headers = RequestHeaders::from_pairs([
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ])
    .headers(extra)
    .mode(BodyMode::FullDuplex);
    let mut stream = EnvoyStream::open(ch, headers.build(), support::ANSWER_TIMEOUT)
        .await
        .unwrap();
    let whole = RequestBody::Whole {
        bytes: body.as_bytes(),
        chunk: body.len(),
    };
    let Decision::Routed(r) = stream.decide(BodyMode::FullDuplex, whole).await.unwrap() else {
        panic!("expected a routed request");
    };
    assert_eq!(r.changes.status, ResponseStatus::Continue);
    let worker = r
        .changes
        .get("x-worker-instance-id")
        .unwrap()
        .parse()
        .unwrap();
    assert!(r.changes.get("x-gateway-destination-endpoint").is_some());
    assert!(r.changes.get("x-dp-rank").is_some());
    Call { stream, worker }
}

impl Call {
    /// Plays the upstream response (status, then a final body chunk) and returns
    /// the session token kvpick set on the response, if any. Once the final
    /// body chunk is answered, kvpick has finished the request.
    async fn finish(mut self, status: u16) -> Option<String> {
        let outcome = self
            .stream
            .respond(
                BodyMode::FullDuplex,
                &status.to_string(),
                &[],
                Some(b"{}"),
                64,
            )
            .await
            .unwrap();
        let ResponseOutcome::Forwarded { changes, .. } = outcome else {
            panic!("expected the response to go on, got {outcome:?}");
        };
        changes.get("x-kvpick-session").map(String::from)
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
    let c = channel(addr).await;
    let long = completion(&"You are a careful assistant. ".repeat(400), None);
    let first = send(&c, &long, &[]).await;
    let home = first.worker;
    first.finish(200).await;
    for _ in 0..6 {
        let again = send(&c, &long, &[]).await;
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
    let c = channel(addr).await;
    let mut held = Vec::new();
    let mut per_worker: HashMap<u64, usize> = HashMap::new();
    for i in 0..16 {
        let body = completion(&format!("{i:04} {}", "distinct ".repeat(100)), None);
        let call = send(&c, &body, &[]).await;
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
    let c = channel(addr).await;
    let open = send(
        &c,
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
        let other = send(&c, &completion(&format!("noise {turn}"), None), &[]).await;
        let body = completion(
            &format!("turn {turn} {}", "x".repeat(300)),
            Some(("agent-1", None)),
        );
        let call = send(&c, &body, &[]).await;
        assert_eq!(call.worker, home, "turn {turn}");
        assert!(call.finish(200).await.is_some());
        other.finish(200).await;
    }
    let close = send(
        &c,
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
    let (a, b, c) = (
        channel(addr_a).await,
        channel(addr_b).await,
        channel(addr_c).await,
    );
    let open = send(&a, &completion("hi", Some(("agent-2", Some("open")))), &[]).await;
    let home = open.worker;
    let token = open.finish(200).await.unwrap();
    let turn = completion("next", Some(("agent-2", None)));
    for _ in 0..4 {
        let call = send(&b, &turn, &[("x-kvpick-session", &token)]).await;
        assert_eq!(call.worker, home);
        call.finish(200).await;
    }
    // A replica with another key ignores the token (failed turns bind nothing),
    // and so does a replica with the right key for another session id.
    let mut seen = std::collections::HashSet::new();
    for i in 0..12 {
        let call = send(&c, &turn, &[("x-kvpick-session", &token)]).await;
        seen.insert(call.worker);
        call.finish(500).await;
        let other = completion("next", Some((&format!("agent-x{i}"), None)));
        let call = send(&b, &other, &[("x-kvpick-session", &token)]).await;
        seen.insert(call.worker);
        call.finish(500).await;
    }
    assert!(seen.len() > 2, "{seen:?}");
}
