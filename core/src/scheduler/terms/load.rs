//! `active-request-scorer` (and llm-d's other load scorers): the candidate's
//! active load.
//!
//! What kvpick knows of a candidate's load when the engine's own figures are
//! missing: blocks booked by unfinished requests kvpick routed there, plus, for
//! a suspect worker (scrapes stopped or fail after a success), its last scraped
//! running requests kvpick did not route (other replicas, direct traffic) at
//! the mean size of its own. A candidate with a fresh scrape costs none of it:
//! what a new request waits behind there is the scraped queue
//! ([`super::queue`]) and what it finds full is the scraped KV usage
//! ([`super::kv_usage`]); counting booked requests on top counts the queued
//! ones twice, so a saturated holder loses its prompts (BENCHMARKS.md §2, the
//! 1,000-block 2× point). Failed responses are a term of their own
//! ([`super::failures`]).

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::endpoints::LoadView;
use crate::scheduler::plugin::{decode_params, Knob, PluginArgs, PluginError, Weight};

/// The declaration.
pub static TERM: TermDecl = TermDecl {
    name: "decode_load",
    types: &[
        "active-request-scorer",
        "load-aware-scorer",
        "token-load-scorer",
    ],
    weight: Weight::Flag(Knob {
        flag: "weight-decode",
        env: "KVPICK_WEIGHT_DECODE",
        default: 0.1,
        help: "Cost weight per block of active load on the candidate (counted while it is saturated, or has no fresh scrape)",
    }),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(ActiveLoad::from_config(a)?)),
};

/// The active-load cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActiveLoad {
    /// Per block of active load.
    pub weight: f64,
}

/// The llm-d scorers' parameters kvpick reads: none.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl ActiveLoad {
    /// The term the registry builds: the mapped weight.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(ActiveLoad {
            weight: args.weight,
        })
    }
}

impl Scorer for ActiveLoad {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let active = c.booked.blocks as f64;
        let s = match c.view {
            LoadView::Fresh(_) => return 0.0,
            LoadView::Suspect(Some(s)) => s,
            LoadView::Suspect(None) | LoadView::Unknown => return self.weight * active,
        };
        let in_flight = c.in_flight();
        let per_request = if in_flight > 0.0 {
            active / in_flight
        } else {
            req.size as f64
        };
        let unknown = (s.running / c.ranks() - in_flight).max(0.0);
        self.weight * (active + unknown * per_request)
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
