//! Flow control through the ext_proc server, driven the way Envoy drives it
//! (full-duplex streamed bodies): queued requests hold their answer, go in
//! priority order as capacity frees, and leave with 429 and a reason header when
//! their TTL runs out or they are sheddable; a cancelled stream leaves its queue;
//! 503 stays for "no endpoint".

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_client::message::{request_body, response_headers};
use envoy_client::{BodyMode, EnvoyStream, Phase, DESTINATION_KEY};
use kvpick::admission::{AdmissionConfig, Objectives, SaturationConfig};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::App;
use tonic::transport::Channel;

#[allow(dead_code)] // each test binary uses a part of it
mod support;
use support::{changes, channel, immediate, post};

/// A kvpick with flow control on over `workers` workers that are full at one
/// request in flight each; objectives `chat` = 10 and `batch` = -1.
async fn start(workers: usize, ttl: Duration) -> (App, Channel, tokio::task::JoinHandle<()>) {
    let mut app = App::new("test-pool");
    app.endpoints.replace(
        (0..workers)
            .map(|i| Endpoint::new(format!("10.0.0.{}:8000", i + 1).parse().unwrap()))
            .collect(),
    );
    let config = AdmissionConfig {
        enabled: true,
        ttl,
        saturation: SaturationConfig {
            max_in_flight_per_rank: 1,
            ..SaturationConfig::default()
        },
        ..AdmissionConfig::default()
    };
    let objectives = Objectives::new(HashMap::from([
        ("chat".to_string(), 10),
        ("batch".to_string(), -1),
    ]));
    app.set_admission(config, Arc::new(objectives));
    let dispatcher = app.spawn_admission();
    let port = support::serve(&app, ExtProcConfig::default()).await;
    (app, channel(port).await, dispatcher)
}

/// Sends a whole chat request (headers + one body chunk) in full-duplex mode.
async fn request(ch: &Channel, extra: &[(&str, &str)], body: serde_json::Value) -> EnvoyStream {
    let s = post(
        ch,
        "/v1/chat/completions",
        extra,
        Some(BodyMode::FullDuplex),
        None,
    )
    .await;
    s.send(request_body(&serde_json::to_vec(&body).unwrap(), true))
        .await
        .unwrap();
    s
}

/// Ends the request the way Envoy does when the response has no body.
async fn finish(s: &EnvoyStream) {
    s.send(response_headers("200", &[], true)).await.unwrap();
}

/// Nothing arrives within `ms`.
async fn silent_for(s: &mut EnvoyStream, ms: u64) -> bool {
    s.silent_for(Duration::from_millis(ms)).await
}

fn chat(text: &str) -> serde_json::Value {
    serde_json::json!({"model": "llama", "messages": [{"role": "user", "content": text}]})
}

/// The destination of a routed request's headers answer.
async fn routed(s: &mut EnvoyStream) -> String {
    changes(s, Phase::RequestHeaders)
        .await
        .get(DESTINATION_KEY)
        .expect("destination header")
        .to_string()
}

/// Status, JSON body and reason header of an immediate response.
async fn rejected(s: &mut EnvoyStream) -> (u16, serde_json::Value, Option<String>) {
    let (i, json) = immediate(s).await;
    let reason = i
        .headers
        .get("x-llm-d-request-dropped-reason")
        .map(String::from);
    (i.status, json, reason)
}

#[tokio::test]
async fn queued_requests_are_routed_in_priority_order_as_capacity_frees() {
    let (app, ch, _d) = start(1, Duration::from_secs(30)).await;
    let mut first = request(&ch, &[], chat("first")).await;
    routed(&mut first).await;
    // The worker is full: these wait, holding their answers.
    let mut low = request(&ch, &[], chat("low")).await;
    assert!(silent_for(&mut low, 100).await);
    let mut high = request(
        &ch,
        &[("x-gateway-inference-objective", "chat")],
        chat("high"),
    )
    .await;
    let mut hinted = request(
        &ch,
        &[],
        serde_json::json!({"model": "llama", "messages": [{"role": "user", "content": "mid"}],
                           "nvext": {"agent_hints": {"priority": 5}}}),
    )
    .await;
    assert!(silent_for(&mut high, 100).await && silent_for(&mut hinted, 1).await);
    assert_eq!(app.admission.queued(), 3);

    finish(&first).await;
    routed(&mut high).await;
    assert!(silent_for(&mut hinted, 100).await && silent_for(&mut low, 1).await);
    finish(&high).await;
    routed(&mut hinted).await;
    assert!(silent_for(&mut low, 100).await);
    finish(&hinted).await;
    routed(&mut low).await;
    assert_eq!(app.admission.queued(), 0);
}

#[tokio::test]
async fn ttl_expiry_is_429_with_a_json_body_and_the_reason() {
    let (app, ch, _d) = start(1, Duration::from_millis(150)).await;
    let mut first = request(&ch, &[], chat("first")).await;
    routed(&mut first).await;
    let mut late = request(&ch, &[], chat("late")).await;
    let (code, body, reason) = rejected(&mut late).await;
    assert_eq!(code, 429);
    assert_eq!(reason.as_deref(), Some("rejected-ttl-expired"));
    assert!(body["error"]["message"].as_str().unwrap().contains("TTL"));
    assert_eq!(app.admission.queued(), 0);
    let text = app.metrics.render(&app.endpoints);
    assert!(text.contains("inference_extension_flow_control_request_queue_duration_seconds_count{fairness_id=\"llama\",priority=\"0\",outcome=\"EvictedTTL\""), "{text}");
    assert!(text.contains("inference_objective_request_error_total{objective=\"\",model_name=\"llama\",target_model_name=\"llama\",error_code=\"ResourceExhausted\"} 1"), "{text}");
}

#[tokio::test]
async fn sheddable_requests_get_429_at_once_when_saturated() {
    let (app, ch, _d) = start(1, Duration::from_secs(30)).await;
    // Not saturated: a sheddable request goes on.
    let mut first = request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("first"),
    )
    .await;
    routed(&mut first).await;
    let mut shed = request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("second"),
    )
    .await;
    let (code, _, reason) = rejected(&mut shed).await;
    assert_eq!(code, 429);
    assert_eq!(reason.as_deref(), Some("rejected-saturated"));
    let text = app.metrics.render(&app.endpoints);
    assert!(text.contains("inference_objective_request_total{objective=\"batch\",model_name=\"llama\",target_model_name=\"llama\",priority=\"-1\"} 2"), "{text}");
}

#[tokio::test]
async fn a_cancelled_stream_leaves_its_queue_at_once() {
    let (app, ch, _d) = start(1, Duration::from_secs(30)).await;
    let mut first = request(&ch, &[], chat("first")).await;
    routed(&mut first).await;
    let mut waiting = request(&ch, &[], chat("waiting")).await;
    assert!(silent_for(&mut waiting, 100).await);
    assert_eq!(app.admission.queued(), 1);
    let text = app.metrics.render(&app.endpoints);
    assert!(text.contains("inference_extension_flow_control_queue_size{fairness_id=\"llama\",priority=\"0\",inference_pool=\"test-pool\"} 1"), "{text}");
    // Envoy resets the stream (the client went away).
    drop(waiting);
    for _ in 0..100 {
        if app.admission.queued() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(app.admission.queued(), 0, "still queued after 500 ms");
    // The cancelled request holds no place: once the first finishes, a new one goes.
    finish(&first).await;
    let mut next = request(&ch, &[], chat("next")).await;
    routed(&mut next).await;
}

#[tokio::test]
async fn no_endpoint_stays_503_with_flow_control_on() {
    let (app, ch, _d) = start(0, Duration::from_secs(30)).await;
    let mut s = request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("x"),
    )
    .await;
    let (code, _, reason) = rejected(&mut s).await;
    assert_eq!(code, 503);
    assert_eq!(reason, None);
    assert_eq!(app.admission.queued(), 0);
}
