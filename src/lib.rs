//! kvpick: a KV-cache-aware endpoint picker (EPP) for the Kubernetes Gateway API
//! Inference Extension.
//!
//! The routing core lives in the `kvpick-core` crate and is re-exported here under
//! its module names ([`request`], [`endpoints`], [`kv`], [`sessions`], ...). Where
//! this crate adds glue to a core module, a folder of the same name re-exports the
//! core module and holds the glue beside it: [`admission`], [`scheduler`] and
//! [`multimodal`] (their Prometheus metrics; the image fetcher), [`kvevents`]
//! (ZMQ subscribers feeding the core's decoders) and [`scrape`] (polling the
//! workers' `/metrics`, parsed by the core).
//!
//! The rest is protocol glue: [`extproc`] (Envoy's protocol), [`discovery`]
//! (Kubernetes or a file), [`replica_sync`] (routing state shared between replicas
//! through Redis), [`telemetry`] (registry, metrics and health endpoints, logs,
//! traces), [`config`] (flags) and [`server`] (TLS, the admin service, and the
//! wiring of everything together).

pub use kvpick_core::{
    endpoint_picker_config, endpoints, engine_latency, error_chain, flow, health, identity, keys,
    kv, latency, pipeline, replica, request, sessions, time, tokenize,
};

pub mod admission;
pub mod config;
pub mod discovery;
pub mod extproc;
pub mod kvevents;
pub mod multimodal;
pub mod replica_sync;
pub mod scheduler;
pub mod scrape;
pub mod server;
pub mod telemetry;

/// OpenTelemetry traces, under the path the ext_proc stream imports.
pub use telemetry::tracing_export;
