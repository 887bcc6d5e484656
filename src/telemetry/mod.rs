//! Telemetry: the Prometheus registry, the endpoints that serve it and gRPC
//! health, logs, and OpenTelemetry traces.
//!
//! Metric names follow the GIE EPP where one exists
//! (`inference_extension_scheduler_e2e_duration_seconds`, `inference_pool_ready_pods`);
//! kvpick's own carry the `kvpick_` prefix.
//!
//! - [`registry`]: [`Metrics`] owns the registry and holds the request, decision
//!   and GIE-named pool and endpoint families. Every other subsystem keeps its
//!   metrics beside itself and registers them into it at start-up through
//!   [`Metrics::register`] (`admission::metrics`, `scheduler::metrics`,
//!   `multimodal::metrics`, `extproc::metrics`, `kvevents::metrics`,
//!   `scrape::metrics`, `replica_sync::metrics`, `server::tls::TlsMetrics`).
//! - [`http`]: `/metrics`, in OpenMetrics or the Prometheus text format.
//! - [`health`]: gRPC health, driven by the endpoint set and shutdown.
//! - [`logging`]: the global tracing subscriber.
//! - [`tracing_export`]: request spans exported over OTLP.

pub mod health;
pub mod http;
pub mod logging;
pub mod registry;
pub mod tracing_export;

#[cfg(test)]
mod dashboard_tests;
#[cfg(test)]
mod tests;

pub use health::{drive_health, HEALTH_SERVICES};
pub use http::{
    prometheus_text, serve_metrics, wants_openmetrics, OPENMETRICS_CONTENT_TYPE,
    PROMETHEUS_TEXT_CONTENT_TYPE,
};
pub use logging::{init_logging, LogFormat};
pub use registry::{Metrics, RequestResult};
