//! OpenTelemetry traces end to end: client → test gateway → kvpick (tracing on)
//! → mock workers, with a real OTLP/gRPC receiver (the official protocol's
//! `TraceService`) collecting kvpick's spans.
//!
//! One test per binary: tracing is process-wide (the global subscriber and the
//! exporter's `OTEL_*` variables).

use std::collections::HashMap;
use std::time::Duration;

use e2e::otlp::OtlpReceiver;
use e2e::stack::{Stack, StackOptions};
use kvpick::telemetry::tracing_export::{Exporter, TraceSettings};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;

/// A span's attributes as `key → value` strings.
fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .filter_map(|kv| {
            let v = match kv.value.as_ref()?.value.as_ref()? {
                Any::StringValue(s) => s.clone(),
                Any::IntValue(i) => i.to_string(),
                Any::DoubleValue(d) => d.to_string(),
                Any::BoolValue(b) => b.to_string(),
                _ => return None,
            };
            Some((kv.key.clone(), v))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `traceparent` as `(trace id, parent id, flags)`.
fn parse_traceparent(v: &str) -> (String, String, String) {
    let parts: Vec<&str> = v.split('-').collect();
    assert_eq!(parts.len(), 4, "{v}");
    assert_eq!(parts[0], "00", "{v}");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

/// Waits until the receiver holds `n` spans (flushing kvpick's queue).
async fn spans(exporter: &Exporter, receiver: &OtlpReceiver, n: usize) -> Vec<(String, Span)> {
    for _ in 0..100 {
        exporter.flush();
        if receiver.received() >= n as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    receiver.spans()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvpick_continues_the_callers_trace_and_passes_its_own_span_on() {
    let receiver = OtlpReceiver::keeping();
    let otlp = receiver.start().await.unwrap();
    // The standard variables, as a Deployment sets them (read at start).
    std::env::set_var(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        format!("http://{otlp}"),
    );
    std::env::remove_var("OTEL_SERVICE_NAME");
    let settings = TraceSettings::from_env(Some(true))
        .unwrap()
        .expect("on with --tracing");
    let exporter = Exporter::start(&settings).unwrap();
    kvpick::telemetry::init_logging(kvpick::telemetry::LogFormat::Text, "warn", Some(&exporter));

    let s = Stack::start(StackOptions::default()).await.unwrap();
    let c = s.client();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let sampled = format!("00-{trace_id}-{caller_span}-01");
    let prompt = "tell me about tracing ".repeat(40);
    let body = |action: &str| {
        json!({"model": "mock-model", "max_tokens": 2, "prompt": prompt,
               "nvext": {"session_control": {"session_id": "sess-1", "action": action}}})
    };
    // Two turns of one session with the same prompt: the second finds its
    // prefix on the worker the first went to.
    for action in ["open", "close"] {
        let r = c
            .post_json(
                "/v1/completions",
                &body(action),
                &[("traceparent", &sampled), ("tracestate", "vendor=abc")],
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // A body kvpick rejects: its span says so.
    let r = c
        .post_json(
            "/v1/completions",
            &json!({"prompt": 5}),
            &[("traceparent", &sampled)],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    // A caller's trace that was not sampled: no span, but the context goes on.
    let unsampled_trace = "0af7651916cd43dd8448eb211c80319c";
    let unsampled = format!("00-{unsampled_trace}-b7ad6b7169203331-00");
    let r = c
        .post_json(
            "/v1/completions",
            &json!({"model": "mock-model", "max_tokens": 2, "prompt": "hello"}),
            &[("traceparent", &unsampled)],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);

    let got = spans(&exporter, &receiver, 3).await;
    assert_eq!(got.len(), 3, "two routed turns and one rejection: {got:#?}");
    for (service, span) in &got {
        assert_eq!(service, "kvpick");
        assert_eq!(span.name, "kvpick.route");
        assert_eq!(span.kind, SpanKind::Server as i32);
        assert_eq!(hex(&span.trace_id), trace_id, "the caller's trace goes on");
        assert_eq!(
            hex(&span.parent_span_id),
            caller_span,
            "child of the caller's span"
        );
    }
    let routed: Vec<&Span> = got
        .iter()
        .map(|(_, s)| s)
        .filter(|s| attributes(s).get("kvpick.outcome").map(String::as_str) == Some("routed"))
        .collect();
    assert_eq!(routed.len(), 2, "{got:#?}");

    // Each forwarded request carried kvpick's span as its parent.
    let seen: Vec<_> = s.workers.iter().flat_map(|w| w.seen().requests).collect();
    assert_eq!(seen.len(), 3, "{seen:#?}");
    for span in &routed {
        let a = attributes(span);
        let id = &a["kvpick.worker.instance_id"];
        let forwarded = seen
            .iter()
            .find(|r| {
                r.traceparent
                    .as_deref()
                    .is_some_and(|t| parse_traceparent(t).1 == hex(&span.span_id))
            })
            .unwrap_or_else(|| panic!("no request carried span {}: {seen:#?}", hex(&span.span_id)));
        let (t, _, flags) = parse_traceparent(forwarded.traceparent.as_deref().unwrap());
        assert_eq!((t.as_str(), flags.as_str()), (trace_id, "01"));
        assert_eq!(forwarded.worker_instance_id.as_deref(), Some(id.as_str()));
        assert_eq!(
            a["kvpick.worker.address"],
            forwarded.destination.clone().unwrap()
        );
        assert_eq!(a["kvpick.worker.dp_rank"], "0");
        assert_eq!(a["kvpick.session.id"], "sess-1");
        assert_eq!(a["http.response.status_code"], "200");
        assert!(
            a["kvpick.prefix.prompt_blocks"].parse::<u64>().unwrap() > 0,
            "{a:?}"
        );
        let terms: f64 = ["prefill", "decode_load", "queue", "kv_usage"]
            .iter()
            .map(|t| a[&format!("kvpick.cost.{t}")].parse::<f64>().unwrap())
            .sum();
        let total: f64 = a["kvpick.cost.total"].parse().unwrap();
        assert!((terms - total).abs() < 1e-9, "{a:?}");
    }
    let second = attributes(routed[1]);
    assert_eq!(second["kvpick.session.action"], "close");
    assert_eq!(
        second["kvpick.prefix.overlap_blocks"], second["kvpick.prefix.prompt_blocks"],
        "the second turn's prompt was all cached on its worker: {second:?}"
    );
    let rejected = got
        .iter()
        .map(|(_, s)| attributes(s))
        .find(|a| a["kvpick.outcome"] != "routed")
        .unwrap();
    assert_eq!(rejected["kvpick.outcome"], "bad_request");
    assert_eq!(rejected["http.response.status_code"], "400");

    // The unsampled request went on with its caller's trace, not sampled.
    let forwarded = seen
        .iter()
        .filter_map(|r| r.traceparent.as_deref())
        .map(parse_traceparent)
        .find(|(t, _, _)| t == unsampled_trace)
        .expect("the unsampled trace went on");
    assert_eq!(forwarded.2, "00");
}
