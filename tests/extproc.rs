//! Loopback tests of the ext_proc server, driven the way Envoy drives it.
//!
//! The client side is `envoy-client`, which builds every message from the Envoy
//! protos and reads kvpick's answers against the ext_proc / GIE protocol,
//! independently of kvpick's own message builders.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use envoy_client::message::{
    request_body, request_trailers, response_body, response_headers, response_trailers,
    string_list, subset_hint, RequestHeaders,
};
use envoy_client::{
    Answer, BodyChange, BodyMode, Changes, ClientError, EnvoyStream, Phase, ResponseOutcome,
};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{value::Kind, ListValue};
use kvpick::endpoints::{Endpoint, Role};
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tonic::transport::Channel;

#[allow(dead_code)] // each test binary uses a part of it
mod support;
use support::{changes, channel, immediate, post, routed_chat, ANSWER_TIMEOUT};

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
    let port = support::serve(&app, config).await;
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

fn chat_body(text: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "llama",
        "messages": [{"role": "user", "content": text}],
        "stream": true
    }))
    .unwrap()
}

/// Collects the body streamed back in `phase` answers until end_of_stream;
/// returns (bytes, chunk sizes).
async fn collect_streamed(s: &mut EnvoyStream, phase: Phase) -> (Vec<u8>, Vec<usize>) {
    let mut sizes = Vec::new();
    let echo = s
        .streamed_body(phase, &mut Changes::default(), &mut sizes)
        .await
        .unwrap()
        .expect("a streamed body, not an immediate response");
    (echo, sizes)
}

/// (status, JSON body) of the next answer, an immediate response.
async fn immediate_status(s: &mut EnvoyStream) -> (u16, serde_json::Value) {
    let (i, json) = immediate(s).await;
    (i.status, json)
}

/// Opens a stream with POST request headers for `path` announcing `mode`.
async fn open_post(ch: &Channel, path: &str, mode: BodyMode) -> EnvoyStream {
    post(ch, path, &[], Some(mode), None).await
}

/// Sends a full-duplex chat request; returns the routing and the echoed body.
async fn full_duplex(
    ch: &Channel,
    body: &[u8],
    extra_headers: &[(&str, &str)],
    metadata: Option<Metadata>,
) -> (EnvoyStream, Changes, Vec<u8>) {
    let (s, r) = routed_chat(ch, body, extra_headers, metadata).await;
    (s, r.changes, r.body.expect("the body streamed back"))
}

#[tokio::test]
async fn full_duplex_routes_after_body_and_echoes_it() {
    let srv = start(pool(3)).await;
    let ch = channel(srv.port).await;
    let body = chat_body("hello there");
    let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
    // The headers answer is held until the body ends.
    assert!(
        s.silent_for(Duration::from_millis(300)).await,
        "headers answered before the body ended"
    );
    s.send(request_body(&body[..5], false)).await.unwrap();
    s.send(request_body(&body[5..], true)).await.unwrap();
    let r = changes(&mut s, Phase::RequestHeaders).await;
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
    let (echo, sizes) = collect_streamed(&mut s, Phase::RequestBody).await;
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
    let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
    s.send(request_body(&body, true)).await.unwrap();
    changes(&mut s, Phase::RequestHeaders).await;
    let (echo, sizes) = collect_streamed(&mut s, Phase::RequestBody).await;
    assert_eq!(echo, body);
    assert_eq!(sizes.len(), body.len().div_ceil(62_000));
    assert!(sizes.iter().all(|n| *n <= 62_000));
    assert!(sizes[..sizes.len() - 1].iter().all(|n| *n == 62_000));
}

#[tokio::test]
async fn buffered_mode_answers_headers_then_decides_on_body() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let mut s = post(&ch, "/v1/completions", &[], Some(BodyMode::Buffered), None).await;
    let r = changes(&mut s, Phase::RequestHeaders).await;
    assert!(r.get("x-gateway-destination-endpoint").is_none());
    s.send(request_body(br#"{"model":"m","prompt":"hi"}"#, true))
        .await
        .unwrap();
    let r = changes(&mut s, Phase::RequestBody).await;
    assert!(r.clear_route_cache);
    let dest = r.get("x-gateway-destination-endpoint").unwrap();
    assert_eq!(r.metadata_destination.as_deref(), Some(dest));
    assert!(r.get("x-worker-instance-id").is_some());
    assert_eq!(
        r.body,
        BodyChange::Unchanged,
        "an unchanged body is not mutated"
    );
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
    let mut s = post(&ch, "/v1/completions", &[], None, None).await;
    // The headers answer names a worker picked without the body (Envoy may
    // forward the headers on it); the body's answer re-decides.
    let r = changes(&mut s, Phase::RequestHeaders).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    s.send(request_body(br#"{"model":"m","prompt":"hi"}"#, true))
        .await
        .unwrap();
    let r = changes(&mut s, Phase::RequestBody).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());

    // Full-duplex Envoy: the body follows at once; kvpick holds the headers.
    let mut s = post(&ch, "/v1/completions", &[], None, None).await;
    s.send(request_body(br#"{"model":"m","prompt":"hi"}"#, true))
        .await
        .unwrap();
    let r = changes(&mut s, Phase::RequestHeaders).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    let (echo, _) = collect_streamed(&mut s, Phase::RequestBody).await;
    assert_eq!(echo, br#"{"model":"m","prompt":"hi"}"#);
}

#[tokio::test]
async fn header_only_request_is_routed_at_once() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let headers = RequestHeaders::from_pairs([(":method", "GET"), (":path", "/v1/models")])
        .end_of_stream(true)
        .mode(BodyMode::FullDuplex);
    let mut s = EnvoyStream::open(&ch, headers.build(), ANSWER_TIMEOUT)
        .await
        .unwrap();
    let r = changes(&mut s, Phase::RequestHeaders).await;
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
    let mut s = post(
        &ch,
        "/v1/completions",
        &[("x-prefill-instance-id", "1")],
        Some(BodyMode::Buffered),
        None,
    )
    .await;
    let r = changes(&mut s, Phase::RequestHeaders).await;
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
        let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
        s.send(request_body(body, true)).await.unwrap();
        let (code, err) = immediate_status(&mut s).await;
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
    let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
    s.send(request_body(&chat_body("x"), true)).await.unwrap();
    let (code, err) = immediate_status(&mut s).await;
    assert_eq!(code, 503);
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no ready endpoint"));
}

#[tokio::test]
async fn subset_hint_restricts_candidates() {
    let srv = start(pool(4)).await;
    let ch = channel(srv.port).await;
    let list = string_list(["10.0.0.2:8000", "10.0.0.3:8000"]);
    for _ in 0..10 {
        let (_, r, _) =
            full_duplex(&ch, &chat_body("x"), &[], Some(subset_hint(list.clone()))).await;
        let dest = r.get("x-gateway-destination-endpoint").unwrap();
        assert!(dest == "10.0.0.2:8000" || dest == "10.0.0.3:8000", "{dest}");
    }
    let csv = Kind::StringValue("10.0.0.4:8000, 10.0.0.9:8000".into());
    let (_, r, _) = full_duplex(&ch, &chat_body("x"), &[], Some(subset_hint(csv))).await;
    assert_eq!(
        r.get("x-gateway-destination-endpoint"),
        Some("10.0.0.4:8000")
    );

    for empty in [
        Kind::StringValue("10.9.9.9:1".into()),
        Kind::ListValue(ListValue::default()),
    ] {
        let mut s = post(
            &ch,
            "/v1/chat/completions",
            &[],
            Some(BodyMode::FullDuplex),
            Some(subset_hint(empty)),
        )
        .await;
        s.send(request_body(&chat_body("x"), true)).await.unwrap();
        assert_eq!(immediate_status(&mut s).await.0, 503);
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
    s.send(response_headers("200", &[], false)).await.unwrap();
    changes(&mut s, Phase::ResponseHeaders).await;
    let sse = b"data: {\"choices\":[]}\n\n";
    s.send(response_body(sse, false)).await.unwrap();
    s.send(response_body(b"data: [DONE]\n\n", true))
        .await
        .unwrap();
    let (echoed, sizes) = collect_streamed(&mut s, Phase::ResponseBody).await;
    assert_eq!(sizes.len(), 2, "one answer per chunk");
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
    let (tls, cert_pem) = kvpick::server::tls::self_signed(&["localhost"]).unwrap();
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
        // The stream opens without waiting; the call's failure is its first answer.
        let mut opened = EnvoyStream::open(
            &plain,
            RequestHeaders::get("/v1/models").build(),
            ANSWER_TIMEOUT,
        )
        .await
        .unwrap();
        assert!(matches!(opened.recv().await, Err(ClientError::Status(_))));
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
    let outcome = s
        .respond(BodyMode::FullDuplex, status, &[], None, 0)
        .await
        .unwrap();
    assert!(matches!(outcome, ResponseOutcome::Forwarded { .. }));
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
    let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
    s.send(request_body(&turn, true)).await.unwrap();
    let (code, err) = immediate_status(&mut s).await;
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
    let mut s = open_post(&ch, "/v1/completions", BodyMode::FullDuplex).await;
    let chunks: Vec<&[u8]> = over.chunks(1 << 20).collect();
    for (i, c) in chunks.iter().enumerate() {
        s.send(request_body(c, i + 1 == chunks.len()))
            .await
            .unwrap();
    }
    let (status, json) = immediate_status(&mut s).await;
    assert_eq!(status, 413);
    assert!(json["error"]["message"].as_str().unwrap().contains("limit"));

    // Buffered: one message above tonic's 4 MiB default still reaches kvpick.
    let mut s = post(&ch, "/v1/completions", &[], Some(BodyMode::Buffered), None).await;
    changes(&mut s, Phase::RequestHeaders).await;
    s.send(request_body(&over, true)).await.unwrap();
    assert_eq!(immediate_status(&mut s).await.0, 413);

    // Streamed: one answer per chunk until the cap is crossed.
    let mut s = post(&ch, "/v1/completions", &[], Some(BodyMode::Streamed), None).await;
    changes(&mut s, Phase::RequestHeaders).await;
    let mut status = None;
    for (i, c) in chunks.iter().enumerate() {
        s.send(request_body(c, i + 1 == chunks.len()))
            .await
            .unwrap();
        if let Answer::Immediate(i) = s.answer().await.unwrap() {
            status = Some(i.status);
            break;
        }
    }
    assert_eq!(status, Some(413));

    // A buffered body above 4 MiB but within the cap is routed, not a gRPC error.
    let fits = big_body(cap - 4096);
    let mut s = post(&ch, "/v1/completions", &[], Some(BodyMode::Buffered), None).await;
    changes(&mut s, Phase::RequestHeaders).await;
    s.send(request_body(&fits, true)).await.unwrap();
    let r = changes(&mut s, Phase::RequestBody).await;
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
    let mut a = open_post(&ch, "/v1/completions", BodyMode::FullDuplex).await;
    a.send(request_body(&held[..768 << 10], false))
        .await
        .unwrap();
    assert!(a.silent_for(Duration::from_millis(100)).await);
    // B does not fit next to it.
    let mut b = open_post(&ch, "/v1/completions", BodyMode::FullDuplex).await;
    b.send(request_body(&big_body(512 << 10), true))
        .await
        .unwrap();
    let (status, json) = immediate_status(&mut b).await;
    assert_eq!(status, 429);
    assert!(json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("budget"));
    // Small requests still route, and A finishes normally.
    let (_, r, _) = full_duplex(&ch, &chat_body("small"), &[], None).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    a.send(request_body(&held[768 << 10..], true))
        .await
        .unwrap();
    let r = changes(&mut a, Phase::RequestHeaders).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    assert_eq!(srv.app.extproc_metrics.body_budget_rejections.get(), 1);
}

#[tokio::test]
async fn a_body_that_stops_arriving_gets_408() {
    let config = ExtProcConfig {
        body_deadline: Duration::from_millis(200),
        ..Default::default()
    };
    let srv = start_with(pool(2), config).await;
    let ch = channel(srv.port).await;
    let mut s = open_post(&ch, "/v1/completions", BodyMode::FullDuplex).await;
    s.send(request_body(br#"{"model":"m","pro"#, false))
        .await
        .unwrap();
    let (status, json) = immediate_status(&mut s).await;
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
    s.send(response_headers("200", &[], false)).await.unwrap();
    s.recv().await.unwrap();
    let chunks: [&[u8]; 3] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":21,\"completion_tokens\":5}}\n\n",
        b"data: [DONE]\n\n",
    ];
    for (i, c) in chunks.iter().enumerate() {
        s.send(response_body(c, i + 1 == chunks.len()))
            .await
            .unwrap();
        s.recv().await.unwrap();
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

/// Trailers end a body the way `end_of_stream` does: request trailers after an
/// unfinished full-duplex body route the request, then the body streams back and
/// the trailers are answered; response trailers end the response and the request.
#[tokio::test]
async fn trailers_end_the_request_and_the_response() {
    let srv = start(pool(2)).await;
    let ch = channel(srv.port).await;
    let mut s = open_post(&ch, "/v1/chat/completions", BodyMode::FullDuplex).await;
    let body = chat_body("with trailers");
    s.send(request_body(&body, false)).await.unwrap();
    assert!(s.silent_for(Duration::from_millis(200)).await);
    s.send(request_trailers(&[("x-checksum", "1")]))
        .await
        .unwrap();
    let r = changes(&mut s, Phase::RequestHeaders).await;
    assert!(r.get("x-gateway-destination-endpoint").is_some());
    // The body comes back without `end_of_stream` (the trailers end it), then
    // the trailers' answer.
    let mut echo = Vec::new();
    loop {
        match s.answer().await.unwrap() {
            Answer::Continue(Phase::RequestBody, c) => match c.body {
                BodyChange::Streamed {
                    body,
                    end_of_stream: false,
                } => echo.extend_from_slice(&body),
                other => panic!("expected a streamed chunk, got {other:?}"),
            },
            Answer::Continue(Phase::RequestTrailers, _) => break,
            other => panic!("expected the body or the trailers' answer, got {other:?}"),
        }
    }
    assert_eq!(echo, body);
    assert_eq!(total_in_flight(&srv.app), 1);

    s.send(response_headers("200", &[], false)).await.unwrap();
    changes(&mut s, Phase::ResponseHeaders).await;
    s.send(response_body(b"data: [DONE]\n\n", false))
        .await
        .unwrap();
    changes(&mut s, Phase::ResponseBody).await;
    s.send(response_trailers(&[("grpc-status", "0")]))
        .await
        .unwrap();
    changes(&mut s, Phase::ResponseTrailers).await;
    wait_in_flight(&srv.app, 0).await;
}
