//! `active-request-scorer` (and llm-d's other load scorers): the candidate's
//! active load.
//!
//! Blocks booked by unfinished requests kvpick routed there, plus scraped
//! running requests kvpick did not route (other replicas, direct traffic) at
//! the mean size of its own, plus one request of this size per failed response
//! since the last success. Sticky until saturated: a candidate whose fresh
//! scrape shows KV room (usage under [`SATURATION_KV_USAGE`]) counts none of
//! it, as running requests delay a new one only by holding KV (what it waits
//! behind is the queue, [`super::queue`]); once its KV fills, its load counts
//! in full. Failures count either way.

use serde::{Deserialize, Serialize};

use super::{bound, Candidate, RequestCost, Scorer};
use crate::endpoints::LoadView;
use crate::scheduler::cost::SATURATION_KV_USAGE;
use crate::scheduler::registry::{decode_params, PluginArgs, PluginError};

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
        "decode_load"
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let size = req.size as f64;
        let active = c.booked.blocks as f64;
        let mut decode = active;
        if let Some(s) = c.scraped() {
            let in_flight = c.in_flight();
            let per_request = if in_flight > 0.0 {
                active / in_flight
            } else {
                size
            };
            decode += (s.running / c.ranks() - in_flight).max(0.0) * per_request;
            if matches!(c.view, LoadView::Fresh(_))
                && s.kv_usage.clamp(0.0, 1.0) < SATURATION_KV_USAGE
            {
                decode = 0.0;
            }
        }
        // Failed responses release their load at once; until a success, each one
        // counts as a request of this size still running there.
        decode += f64::from(c.endpoint.health().failures()) * size;
        self.weight * decode
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
