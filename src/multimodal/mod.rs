//! Multimodal routing: the core's [`kvpick_core::multimodal`] (image identity,
//! routing modes, remote images), re-exported, with the glue beside it: the
//! network side of remote image fetching ([`fetch`]) and the Prometheus metrics
//! ([`metrics`]).

pub use kvpick_core::multimodal::*;

pub mod fetch;
pub mod metrics;
