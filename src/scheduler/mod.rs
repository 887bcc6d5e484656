//! The scheduler: the core's [`kvpick_core::scheduler`] (candidates, costs and
//! the pick), re-exported, with its Prometheus metrics beside it ([`metrics`], and
//! [`latency_metrics`] for the learned latency models), and the live reload of
//! its `EndpointPickerConfig` file ([`reload`]).

pub use kvpick_core::scheduler::*;

pub mod latency_metrics;
pub mod metrics;
pub mod reload;
