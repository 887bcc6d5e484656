//! kvpick's routing core: everything that decides where a request goes, in plain
//! Rust. No gRPC, HTTP, Kubernetes or Prometheus type appears here (this crate's
//! Cargo.toml does not have them, so the compiler keeps the boundary); the
//! `kvpick` crate speaks those protocols and feeds the core through its types and
//! traits ([`multimodal::remote::ImageFetcher`], [`admission::AdmissionObserver`]).
//!
//! - [`request`]: one pass over an inference body (model, prompt, `nvext`, images).
//! - [`endpoints`]: the live table of workers and their load.
//! - [`engine`]: the inference engine a worker runs (vLLM, SGLang, TensorRT-LLM).
//! - [`kv`]: prefix block hashing and the prefix index.
//! - [`kvevents`]: the engines' KV-event formats, one decoder each.
//! - [`sessions`]: sticky session bindings.
//! - [`replica`]: routing-state deltas shared between replicas ([`replica::ReplicaSink`]).
//! - [`scheduler`]: candidates, costs and the pick; [`endpoint_picker_config`]:
//!   the llm-d Router's `EndpointPickerConfig`, built into its plugin list.
//! - [`latency`]: learned per-worker TTFT and decode-time models.
//! - [`scrape`]: the workers' `/metrics` pages read into load and adapters;
//!   [`engine_latency`]: the engines' own latency histograms, as recent means.
//! - [`admission`]: priorities, fairness, saturation and queueing.
//! - [`multimodal`], [`tokenize`]: image identity and the tokenize job.
//! - [`pipeline`]: one request from its headers and body to the headers and
//!   body it is forwarded with.
//! - [`flow`]: one request's life, from its headers to its end (admission, the
//!   pick, the response), and the observers that follow it ([`flow::FlowObserver`]).
//! - [`health`], [`identity`], [`keys`], [`time`], [`error_chain`]: small shared pieces.

pub mod admission;
pub mod endpoint_picker_config;
pub mod endpoints;
pub mod engine;
pub mod engine_latency;
pub mod error_chain;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod flow;
pub mod health;
pub mod identity;
pub mod keys;
pub mod kv;
pub mod kvevents;
pub mod latency;
pub mod multimodal;
pub mod pipeline;
pub mod replica;
pub mod request;
pub mod scheduler;
pub mod scrape;
pub mod sessions;
pub mod time;
pub mod tokenize;
