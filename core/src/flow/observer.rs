//! What a flow tells its observers about the requests it routes.
//!
//! An observer (a latency model, a recorder in a test) sees, per routed
//! request: each decision and when it was made, the response's status, the
//! first response body bytes, every later body chunk, and the end. Every call carries the flow's
//! [`FlowId`] and its current decision, and the instant the flow was given for
//! the event, so a simulated clock drives observers as it drives the scheduler.
//!
//! Invariants (kept by [`super::RequestFlow`]): a flow that never routed
//! reports nothing; one that did reports [`FlowObserver::routed`] first,
//! [`FlowObserver::responded`] at most once,
//! [`FlowObserver::first_chunk`] at most once and before any
//! [`FlowObserver::chunk`], and [`FlowObserver::ended`] exactly once, last.

use std::time::Instant;

use crate::scheduler::Decision;

/// One flow among those sharing a [`super::FlowContext`]: every event of a
/// request carries the same id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowId(pub u64);

/// How a routed request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowEnd {
    /// Its response completed; `status` is the response's HTTP status when
    /// its headers carried one.
    Finished {
        /// The response's HTTP status.
        status: Option<u16>,
    },
    /// The stream went away before the response completed.
    Cancelled,
}

/// Told about the requests a flow routes. Every method does nothing unless
/// implemented; calls come from the request's own thread, in event order.
pub trait FlowObserver: Send + Sync {
    /// The flow routed its request to `decision` at `at`. A body that follows
    /// a decision made on the headers alone replaces that decision: the flow
    /// then reports the new one under the same id.
    fn routed(&self, _flow: FlowId, _decision: &Decision, _at: Instant) {}

    /// The response headers arrived at `at`, with HTTP `status` when they
    /// carried one.
    fn responded(&self, _flow: FlowId, _decision: &Decision, _at: Instant, _status: Option<u16>) {}

    /// The first response body bytes (`bytes` of them, at least one) arrived
    /// at `at`. `decision` names where the request runs (a fallback the
    /// gateway served it from, when it did).
    fn first_chunk(&self, _flow: FlowId, _decision: &Decision, _at: Instant, _bytes: usize) {}

    /// A later response body chunk of `bytes` (at least one) arrived at `at`.
    fn chunk(&self, _flow: FlowId, _decision: &Decision, _at: Instant, _bytes: usize) {}

    /// The request ended at `at`, as `end` says.
    fn ended(&self, _flow: FlowId, _decision: &Decision, _at: Instant, _end: FlowEnd) {}
}
