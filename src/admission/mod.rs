//! Admission: the core's [`kvpick_core::admission`] (priorities, fairness,
//! saturation, queueing), re-exported, with its Prometheus metrics beside it
//! ([`metrics`]).

pub use kvpick_core::admission::*;

pub mod metrics;
