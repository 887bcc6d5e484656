//! `prefix-cache-scorer`: the blocks a candidate must still prefill.
//!
//! The prompt's blocks after the leading ones the candidate holds, plus its
//! leading blocks on lower storage tiers at their load cost
//! ([`crate::scheduler::tiers`]), plus the blocks of requests routed there
//! whose prefill is not done beyond this prompt's overlap, counted as [`PendingWait`](super::PendingWait)
//! weighs them. Weighted per side: decode candidates at `weight`, prefill
//! candidates of a disaggregated pool at `prefill_weight`.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, Side, TermDecl};
use crate::scheduler::plugin::{decode_params, Knob, PluginArgs, PluginError, Weight};

/// The declaration: the unit the `EndpointPickerConfig` mapping scales the
/// other terms by.
pub static TERM: TermDecl = TermDecl {
    name: "prefill",
    types: &["prefix-cache-scorer", "precise-prefix-cache-scorer"],
    weight: Weight::Flag(Knob {
        flag: "weight-prefill",
        env: "KVPICK_WEIGHT_PREFILL",
        default: 1.0,
        help: "Cost weight per prompt block the candidate must still prefill",
    }),
    prefill_weight: Some(Knob {
        flag: "weight-prefill-overlap",
        env: "KVPICK_WEIGHT_PREFILL_OVERLAP",
        default: 2.0,
        help: "Prefill weight when picking the prefill worker of a disaggregated pool",
    }),
    unit: true,
    build: |a| Ok(Arc::new(PrefixCache::from_config(a)?)),
};

/// The prefill cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixCache {
    /// Per block to prefill on a decode candidate.
    pub weight: f64,
    /// Per block to prefill on a prefill candidate.
    pub prefill_weight: f64,
}

/// The llm-d scorer's parameters kvpick reads: none (block size and match
/// length are kvpick's own flags).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl PrefixCache {
    /// The term the registry builds: the mapped weights.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(PrefixCache {
            weight: args.weight,
            prefill_weight: args.prefill_weight,
        })
    }

    fn weight(&self, side: Side) -> f64 {
        match side {
            Side::Decode => self.weight,
            Side::Prefill => self.prefill_weight,
        }
    }
}

impl Scorer for PrefixCache {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let size = req.size as f64;
        // Pending prefills beyond this prompt's overlap there: a prefill in
        // progress of the shared prefix ends as a hit for this request.
        let pending = (c.booked.uncached as f64 - (size - c.new_blocks as f64)).max(0.0);
        let work = c.new_blocks as f64 + c.transfer_blocks;
        self.weight(req.side) * (work + req.wait.weigh(pending, c.new_blocks))
    }

    fn lower_bound(&self, new_blocks: usize, req: &RequestCost) -> Option<f64> {
        // A wait behind pending prefills, and a load from a lower tier, count
        // zero or more.
        bound(self.weight(req.side), new_blocks as f64)
    }
}
