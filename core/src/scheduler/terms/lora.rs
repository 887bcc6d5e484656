//! `lora-affinity-scorer`: a request for a LoRA adapter (its `model`) prefers
//! workers with the adapter resident, then workers with a free adapter slot,
//! then the rest, as GIE's scorer of that name does (scores 1, 0.8, 0 there).
//!
//! The cost is the request's size times the weight times a share: 0 resident,
//! [`FREE_SLOT_SHARE`] with a free slot, 1 when every slot is taken. A worker
//! that exports no adapter state, and a request naming the worker's base model
//! (its metrics' `model_name`), cost 0: the term only ever separates workers
//! whose adapter state it knows. The least cost is 0, so the bound is 0.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::endpoints::LoraFit;
use crate::scheduler::plugin::{decode_params, PluginArgs, PluginError, Weight};

/// Weight of the default plugin list: GIE's default profile weighs
/// `lora-affinity-scorer` 1 against `prefix-cache-scorer` 3, and kvpick's
/// prefix term costs up to the request's size at weight 1.
pub const DEFAULT_WEIGHT: f64 = 1.0 / 3.0;

/// Share of a full miss a worker with a free slot costs (GIE scores it 0.8
/// against 1 for a resident adapter and 0 for a full worker).
pub const FREE_SLOT_SHARE: f64 = 0.2;

/// The declaration.
pub static TERM: TermDecl = TermDecl {
    name: "lora",
    types: &["lora-affinity-scorer"],
    weight: Weight::Fixed(DEFAULT_WEIGHT),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(LoraAffinity::from_config(a)?)),
};

/// The LoRA affinity cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraAffinity {
    /// Per block of the request, for a worker that must wait for a slot.
    pub weight: f64,
}

/// The GIE scorer's parameters kvpick reads: none.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl LoraAffinity {
    /// The term the registry builds: the mapped weight.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(LoraAffinity {
            weight: args.weight,
        })
    }
}

impl Scorer for LoraAffinity {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let Some(adapter) = req.adapter else {
            return 0.0;
        };
        let share = match c.endpoint.lora_fit(adapter) {
            LoraFit::Neutral | LoraFit::Resident => return 0.0,
            LoraFit::FreeSlot => FREE_SLOT_SHARE,
            LoraFit::Full => 1.0,
        };
        self.weight * req.size as f64 * share
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
