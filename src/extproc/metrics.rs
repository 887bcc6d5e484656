//! The ext_proc server's own metrics: open streams, contained panics, spoofed
//! routing headers removed, bodies refused for the body budget, passive-health
//! ejections seen on responses. Registered into kvpick's registry by the
//! server state ([`ExtProcMetrics::register`]), as every subsystem registers
//! its own; the names are what dashboards query (`docs/observability.md`).

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::telemetry::Metrics;

/// The ext_proc counters and the open-stream gauge.
#[derive(Debug, Default)]
pub struct ExtProcMetrics {
    /// Requests whose client sent routing headers (removed).
    pub spoofed_headers: Counter,
    /// Request bodies refused (429) because the buffered-body budget was full.
    pub body_budget_rejections: Counter,
    /// Open ext_proc streams.
    pub streams: Gauge,
    /// Streams that ended in a panic (contained).
    pub stream_panics: Counter,
    /// Endpoints ejected by passive health (failing responses).
    pub endpoint_ejections: Counter,
}

impl ExtProcMetrics {
    /// Registers the ext_proc metrics into kvpick's registry.
    pub fn register(metrics: &Metrics) -> Arc<ExtProcMetrics> {
        let m = Arc::new(ExtProcMetrics::default());
        metrics.register(|r| {
            r.register(
                "kvpick_spoofed_routing_headers",
                "Requests that arrived with routing headers set by the client (removed)",
                m.spoofed_headers.clone(),
            );
            r.register(
                "kvpick_body_budget_rejections",
                "Request bodies answered 429 because the process-wide buffered-body budget was full",
                m.body_budget_rejections.clone(),
            );
            r.register(
                "kvpick_ext_proc_streams",
                "Open ext_proc streams",
                m.streams.clone(),
            );
            r.register(
                "kvpick_ext_proc_stream_panics",
                "ext_proc streams that ended in a contained panic",
                m.stream_panics.clone(),
            );
            r.register(
                "kvpick_endpoint_ejections",
                "Times an endpoint was taken out of the candidate set for failing responses (5xx, connect failures)",
                m.endpoint_ejections.clone(),
            );
        });
        m
    }
}
