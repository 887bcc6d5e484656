//! Passive health's cost: each response an endpoint failed since its last
//! success counts as [`DEFAULT_WEIGHT`] of a request of this size, so an
//! endpoint whose failed requests released their load at once never looks idle
//! (see [`crate::health`]; ejection is the `Ejected` filter's job). A built-in
//! term: every plugin list sums it, configured or not, whatever the load
//! weights. The least cost is 0, so the bound is 0.

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::scheduler::plugin::Weight;

/// Share of the request's size one failure costs (the active-load weight that
/// carried it before it had a term of its own).
pub const DEFAULT_WEIGHT: f64 = 0.1;

/// The declaration: built in (no llm-d type), summed by every plugin list.
pub static TERM: TermDecl = TermDecl {
    name: "failures",
    types: &[],
    weight: Weight::Fixed(DEFAULT_WEIGHT),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(FailedResponses { weight: a.weight })),
};

/// The failed-responses cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailedResponses {
    /// Per failure, per block of the request.
    pub weight: f64,
}

impl Scorer for FailedResponses {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        self.weight * f64::from(c.endpoint.health().failures()) * req.size as f64
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
