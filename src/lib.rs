//! kvpick: a KV-cache-aware endpoint picker (EPP) for the Kubernetes Gateway API
//! Inference Extension.
//!
//! The core ([`request`], [`endpoints`], [`kv`], [`sessions`], [`scheduler`], [`admission`],
//! [`identity`]) is plain Rust. The glue ([`extproc`], [`discovery`], [`telemetry`],
//! [`server`]) speaks gRPC, HTTP and Kubernetes.

pub mod admin;
pub mod admission;
pub mod config;
pub mod discovery;
pub mod endpoint_picker_config;
pub mod endpoints;
pub mod extproc;
pub mod health;
pub mod identity;
pub mod image_fetch;
pub mod kv;
pub mod kvevents;
pub mod multimodal;
pub mod request;
pub mod scheduler;
pub mod scrape;
pub mod server;
pub mod sessions;
pub mod telemetry;
pub mod time;
pub mod tls;
pub mod tokenize;
