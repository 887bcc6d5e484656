//! kvpick: a KV-cache-aware endpoint picker (EPP) for the Kubernetes Gateway API
//! Inference Extension.
//!
//! The routing core lives in the `kvpick-core` crate and is re-exported here under
//! its module names ([`request`], [`endpoints`], [`kv`], [`sessions`], [`scheduler`],
//! [`admission`], ...). This crate is the glue: [`extproc`] (Envoy's protocol),
//! [`discovery`] (Kubernetes or a file), [`kvevents`] and [`scrape`] (the workers),
//! [`replica_sync`] (routing state shared between replicas through Redis),
//! [`telemetry`] and [`tracing_export`] (OpenTelemetry traces), [`admin`] and [`server`], which wires them together.

pub use kvpick_core::{
    admission, endpoints, error_chain, flow, health, identity, keys, kv, multimodal, pipeline,
    replica, request, scheduler, sessions, time, tokenize,
};

pub mod admin;
pub mod admission_metrics;
pub mod config;
pub mod discovery;
pub mod endpoint_picker_config;
pub mod extproc;
pub mod image_fetch;
pub mod kvevents;
pub mod malloc;
pub mod multimodal_metrics;
pub mod replica_sync;
pub mod scheduler_metrics;
pub mod scrape;
pub mod server;
pub mod telemetry;
pub mod tls;
pub mod tracing_export;
