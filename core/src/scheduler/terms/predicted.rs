//! `predicted`: the cost of a candidate in seconds, from the learned latency
//! models ([`crate::latency`]), for `--scoring predicted`.
//!
//! A decode candidate costs its predicted time to first token there (the
//! prefix it holds enters as the uncached tokens it saves; blocks it holds on
//! a lower storage tier save their tokens but for their load's fraction,
//! `--tier-cost-*`, priced at the learned prefill rate), plus the delay this
//! prefill adds to the others' first tokens there (its prefill seconds at the
//! pool's learned rate, once per request running beside it, at most the
//! worker's slots, as they run out, [`crate::latency::WorkerModel::stalled`]:
//! near the limit the seconds a cached prefix saves are saved for everyone
//! there; a queue beyond the slots is in the candidate's own TTFT), plus
//! the predicted decode slowdown there times the tokens the request says it will decode (its
//! expected output tokens; a request that does not say is placed on its first token
//! alone: a guessed length would price every decode the same, and the
//! learned slowdown times a long guess outweighs the seconds of prefill a
//! cached prefix saves). A
//! request with latency objectives ([`Slo`]) pays [`SLO_MISS`] plus the
//! overshoot on a candidate predicted to miss one, so any candidate predicted
//! to meet them wins over it. A worker with too few observations is predicted
//! by the pool prior; while the pool prior itself is cold (and on prefill
//! candidates, whose first token the gateway never sees) the wrapped heuristic
//! terms decide, summed as they would be.
//!
//! Invariants: the cost is finite and never negative in either mode (the
//! models' coefficients are non-negative); the lower bound is the wrapped
//! terms' while they decide, else the least TTFT any model the pick reads
//! predicts for the fewest uncached tokens a candidate can have.

use std::sync::Arc;

use super::{Candidate, RequestCost, Scorer, Side};
use crate::latency::features::{MAX_PROMPT_TOKENS, MAX_REQUESTS};
use crate::latency::{Features, Learner, Prediction};
use crate::scheduler::Slo;

/// Seconds a candidate predicted to miss a latency objective pays on top of
/// its overshoot: more than any latency the pick could save elsewhere.
pub const SLO_MISS: f64 = 1000.0;

/// What the predicted term reads about the request, once per pick.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct LatencyAsk {
    /// The pool prior was warm when the pick began: predictions decide.
    pub warm: bool,
    /// Prompt tokens (the booked blocks at their tokens each).
    pub prompt_tokens: u64,
    /// Tokens one prompt block holds.
    pub tokens_per_block: u64,
    /// Output tokens the request expects, when it says.
    pub max_tokens: Option<u32>,
    /// Its latency objectives.
    pub slo: Slo,
}

/// The predicted-latency cost term, wrapping the heuristic terms it falls
/// back on.
#[derive(Debug, Clone)]
pub struct Predicted {
    /// The pool's latency models.
    pub learner: Arc<Learner>,
    /// The heuristic terms, summed while predictions are cold.
    pub fallback: Vec<Arc<dyn Scorer>>,
}

impl Predicted {
    /// The prediction for `c`, when predictions decide its cost.
    pub fn predict(&self, c: &Candidate<'_>, req: &RequestCost) -> Option<Prediction> {
        if !req.latency.warm || req.side == Side::Prefill {
            return None;
        }
        self.learner
            .predict(&c.endpoint.key(c.rank), &features(c, req))
    }
}

impl Scorer for Predicted {
    fn name(&self) -> &'static str {
        "predicted"
    }

    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        match self.predict(c, req) {
            Some(p) => seconds(&p, &req.latency),
            None => self.fallback.iter().map(|s| s.cost(c, req)).sum(),
        }
    }

    fn lower_bound(&self, new_blocks: usize, req: &RequestCost) -> Option<f64> {
        if !req.latency.warm || req.side == Side::Prefill {
            // The heuristic terms decide: their bound is the cost's.
            let mut floor = 0.0;
            for s in &self.fallback {
                floor += s.lower_bound(new_blocks, req)?;
            }
            return Some(floor);
        }
        // A prediction's seconds are at least its TTFT, at least the floor's
        // for the fewest uncached tokens [`features`] can give such a
        // candidate (lower-tier blocks only add to them); a non-finite
        // prediction costs `2 * SLO_MISS`.
        let ask = &req.latency;
        let tokens = (new_blocks as u64)
            .saturating_mul(ask.tokens_per_block.max(1))
            .min(ask.prompt_tokens.clamp(1, MAX_PROMPT_TOKENS));
        let floor = self.learner.ttft_floor(tokens).unwrap_or(0.0);
        Some(match floor.is_finite() {
            true => floor.clamp(0.0, SLO_MISS * 2.0),
            false => 0.0,
        })
    }
}

/// A prediction as a cost in seconds (see the module doc).
pub fn seconds(p: &Prediction, ask: &LatencyAsk) -> f64 {
    let decode_tokens = f64::from(ask.max_tokens.unwrap_or(0));
    let mut cost = p.ttft + p.queued_delay + decode_tokens * p.decode_slowdown;
    if let Some(slo) = ask.slo.ttft {
        if p.ttft > slo {
            cost += SLO_MISS + (p.ttft - slo);
        }
    }
    if let Some(slo) = ask.slo.tpot {
        if p.tpot > slo {
            cost += SLO_MISS + (p.tpot - slo) * decode_tokens.max(1.0);
        }
    }
    if cost.is_finite() {
        cost.max(0.0)
    } else {
        SLO_MISS * 2.0
    }
}

/// The request on candidate `c` as the latency model reads it.
pub fn features(c: &Candidate<'_>, req: &RequestCost) -> Features {
    let ask = &req.latency;
    let per_block = ask.tokens_per_block.max(1);
    let prompt_tokens = ask.prompt_tokens.clamp(1, MAX_PROMPT_TOKENS);
    let scraped = c.scraped();
    let ranks = c.ranks().max(1.0);
    let count = |v: f64| match v.is_finite() {
        true => (v / ranks).clamp(0.0, MAX_REQUESTS),
        false => 0.0,
    };
    Features {
        prompt_tokens,
        // Lower-tier blocks count at their fraction of a block's prefill: the
        // learned prefill rate prices their load.
        uncached_tokens: ((c.new_blocks as f64 + c.transfer_blocks) * per_block as f64)
            .round()
            .min(prompt_tokens as f64) as u64,
        waiting: scraped.map_or(0.0, |s| count(s.queue)),
        running: scraped.map_or(0.0, |s| count(s.running)),
        kv_usage: scraped
            .map(|s| s.kv_usage)
            .filter(|u| u.is_finite())
            .map_or(0.0, |u| u.clamp(0.0, 1.0)),
        pending_prefill_tokens: c
            .booked
            .uncached
            .saturating_mul(per_block)
            .min(MAX_PROMPT_TOKENS * 1024),
        in_flight: c.endpoint.in_flight(c.rank),
        max_tokens: ask.max_tokens,
    }
}
