//! Flow control through the ext_proc server, driven the way Envoy drives it
//! (full-duplex streamed bodies): queued requests hold their answer, go in
//! priority order as capacity frees, and leave with 429 and a reason header when
//! their TTL runs out or they are sheddable; a cancelled stream leaves its queue;
//! 503 stays for "no endpoint".

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use kvpick::admission::{AdmissionConfig, Objectives, SaturationConfig};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Streaming;

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
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        None,
    ));
    let ch = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (app, ch, dispatcher)
}

struct EnvoyStream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

fn header_map(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    })
}

impl EnvoyStream {
    /// Sends a whole chat request (headers + one body chunk) in full-duplex mode.
    async fn request(ch: &Channel, extra: &[(&str, &str)], body: serde_json::Value) -> Self {
        let (tx, rx) = mpsc::channel(16);
        let rx = ExternalProcessorClient::new(ch.clone())
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut pairs = vec![
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
        ];
        pairs.extend_from_slice(extra);
        let mode = BodySendMode::FullDuplexStreamed as i32;
        let s = EnvoyStream { tx, rx };
        s.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: header_map(&pairs),
                end_of_stream: false,
                ..Default::default()
            })),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: mode,
                response_body_mode: mode,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
        s.send(ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: serde_json::to_vec(&body).unwrap(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        })
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

    /// Ends the request the way Envoy does when the response has no body.
    async fn finish(&self) {
        self.send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: header_map(&[(":status", "200")]),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
    }
}

fn chat(text: &str) -> serde_json::Value {
    serde_json::json!({"model": "llama", "messages": [{"role": "user", "content": text}]})
}

/// The destination of a routed request's headers answer.
fn routed(msg: &ProcessingResponse) -> String {
    let Some(processing_response::Response::RequestHeaders(h)) = &msg.response else {
        panic!("expected a routed request-headers answer, got {msg:?}");
    };
    let set = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    let dest = set
        .iter()
        .find(|h| h.header.as_ref().unwrap().key == "x-gateway-destination-endpoint")
        .expect("destination header");
    String::from_utf8(dest.header.as_ref().unwrap().raw_value.clone()).unwrap()
}

/// Status, JSON body and reason header of an immediate response.
fn immediate(msg: &ProcessingResponse) -> (i32, serde_json::Value, Option<String>) {
    let Some(processing_response::Response::ImmediateResponse(ir)) = &msg.response else {
        panic!("expected an immediate response, got {msg:?}");
    };
    let reason = ir.headers.as_ref().and_then(|h| {
        h.set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == "x-llm-d-request-dropped-reason")
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
    });
    (
        ir.status.as_ref().unwrap().code,
        serde_json::from_slice(&ir.body).expect("error body is JSON"),
        reason,
    )
}

#[tokio::test]
async fn queued_requests_are_routed_in_priority_order_as_capacity_frees() {
    let (app, ch, _d) = start(1, Duration::from_secs(30)).await;
    let mut first = EnvoyStream::request(&ch, &[], chat("first")).await;
    routed(&first.recv().await);
    // The worker is full: these wait, holding their answers.
    let mut low = EnvoyStream::request(&ch, &[], chat("low")).await;
    assert!(low.silent_for(100).await);
    let mut high = EnvoyStream::request(
        &ch,
        &[("x-gateway-inference-objective", "chat")],
        chat("high"),
    )
    .await;
    let mut hinted = EnvoyStream::request(
        &ch,
        &[],
        serde_json::json!({"model": "llama", "messages": [{"role": "user", "content": "mid"}],
                           "nvext": {"agent_hints": {"priority": 5}}}),
    )
    .await;
    assert!(high.silent_for(100).await && hinted.silent_for(1).await);
    assert_eq!(app.admission.queued(), 3);

    first.finish().await;
    routed(&high.recv().await);
    assert!(hinted.silent_for(100).await && low.silent_for(1).await);
    high.finish().await;
    routed(&hinted.recv().await);
    assert!(low.silent_for(100).await);
    hinted.finish().await;
    routed(&low.recv().await);
    assert_eq!(app.admission.queued(), 0);
}

#[tokio::test]
async fn ttl_expiry_is_429_with_a_json_body_and_the_reason() {
    let (app, ch, _d) = start(1, Duration::from_millis(150)).await;
    let mut first = EnvoyStream::request(&ch, &[], chat("first")).await;
    routed(&first.recv().await);
    let mut late = EnvoyStream::request(&ch, &[], chat("late")).await;
    let (code, body, reason) = immediate(&late.recv().await);
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
    let mut first = EnvoyStream::request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("first"),
    )
    .await;
    routed(&first.recv().await);
    let mut shed = EnvoyStream::request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("second"),
    )
    .await;
    let (code, _, reason) = immediate(&shed.recv().await);
    assert_eq!(code, 429);
    assert_eq!(reason.as_deref(), Some("rejected-saturated"));
    let text = app.metrics.render(&app.endpoints);
    assert!(text.contains("inference_objective_request_total{objective=\"batch\",model_name=\"llama\",target_model_name=\"llama\",priority=\"-1\"} 2"), "{text}");
}

#[tokio::test]
async fn a_cancelled_stream_leaves_its_queue_at_once() {
    let (app, ch, _d) = start(1, Duration::from_secs(30)).await;
    let mut first = EnvoyStream::request(&ch, &[], chat("first")).await;
    routed(&first.recv().await);
    let mut waiting = EnvoyStream::request(&ch, &[], chat("waiting")).await;
    assert!(waiting.silent_for(100).await);
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
    first.finish().await;
    let mut next = EnvoyStream::request(&ch, &[], chat("next")).await;
    routed(&next.recv().await);
}

#[tokio::test]
async fn no_endpoint_stays_503_with_flow_control_on() {
    let (app, ch, _d) = start(0, Duration::from_secs(30)).await;
    let mut s = EnvoyStream::request(
        &ch,
        &[("x-gateway-inference-objective", "batch")],
        chat("x"),
    )
    .await;
    let (code, _, reason) = immediate(&s.recv().await);
    assert_eq!(code, 503);
    assert_eq!(reason, None);
    assert_eq!(app.admission.queued(), 0);
}
