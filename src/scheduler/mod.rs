//! The scheduler: the core's [`kvpick_core::scheduler`] (candidates, costs and
//! the pick), re-exported, with its Prometheus metrics beside it ([`metrics`]).

pub use kvpick_core::scheduler::*;

pub mod metrics;
pub mod reload;
