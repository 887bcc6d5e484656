//! `kv-cache-utilization-scorer`: the candidate's scraped KV-cache usage
//! (0..1) counted at this request's size. A stale or failing scrape counts as
//! a full cache.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::scheduler::plugin::{decode_params, Knob, PluginArgs, PluginError, Weight};

/// The declaration.
pub static TERM: TermDecl = TermDecl {
    name: "kv_usage",
    types: &["kv-cache-utilization-scorer"],
    weight: Weight::Flag(Knob {
        flag: "weight-kv-usage",
        env: "KVPICK_WEIGHT_KV_USAGE",
        default: 1.0,
        help: "Cost weight of scraped KV-cache usage (0..1, counted at the request's size)",
    }),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(KvUsage::from_config(a)?)),
};

/// The KV-usage cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvUsage {
    /// Per unit of usage, per block of the request.
    pub weight: f64,
}

/// The llm-d scorer's parameters kvpick reads: none.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl KvUsage {
    /// The term the registry builds: the mapped weight.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(KvUsage {
            weight: args.weight,
        })
    }
}

impl Scorer for KvUsage {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let size = req.size as f64;
        let kv = if c.suspect() {
            size
        } else {
            c.scraped()
                .map_or(0.0, |s| s.kv_usage.clamp(0.0, 1.0) * size)
        };
        self.weight * kv
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
