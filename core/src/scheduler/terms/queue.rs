//! `queue-scorer`: the candidate's scraped queue, each queued request counted
//! at the blocks it has left to prefill (the mean uncached blocks of the
//! requests kvpick has in flight there, else this request's size): the work
//! this request waits behind. And the work it puts in front of them: with
//! chunked prefill a queued request's prefill ends in a step this request's
//! first chunk joins, so each queued request counts this request's blocks to
//! prefill there as well, and so does one while kvpick has a prefill pending
//! there (a scrape shows a request only after it: counting the queue alone,
//! the requests of one scrape interval all went to the workers it showed
//! idle). A stale or failing scrape never makes a worker cheaper: its last
//! figures stand, with one more request of this size queued.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::scheduler::plugin::{decode_params, Knob, PluginArgs, PluginError, Weight};

/// The declaration.
pub static TERM: TermDecl = TermDecl {
    name: "queue",
    types: &["queue-scorer"],
    weight: Weight::Flag(Knob {
        flag: "weight-queue",
        env: "KVPICK_WEIGHT_QUEUE",
        default: 0.25,
        help:
            "Cost weight per block of scraped queued work (queued requests at their uncached size)",
    }),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(Queue::from_config(a)?)),
};

/// The queue cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Queue {
    /// Per block of queued work.
    pub weight: f64,
}

/// The llm-d scorer's parameters kvpick reads: none.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl Queue {
    /// The term the registry builds: the mapped weight.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(Queue {
            weight: args.weight,
        })
    }
}

impl Scorer for Queue {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, req: &RequestCost) -> f64 {
        let size = req.size as f64;
        let mut queue = 0.0;
        if let Some(s) = c.scraped() {
            let in_flight = c.in_flight();
            let per_queued = if in_flight > 0.0 {
                c.booked.uncached as f64 / in_flight
            } else {
                size
            };
            let queued = s.queue / c.ranks();
            // Each queued request waits for this request's first chunk in the
            // step that ends its prefill. While a prefill kvpick routed here
            // is pending that is at least one request, whether or not the
            // scrape (up to an interval old) shows it yet.
            let pending = if c.booked.uncached > 0 { 1.0 } else { 0.0 };
            let delayed = queued.max(pending);
            queue = queued * per_queued + delayed * c.new_blocks as f64;
        }
        if c.suspect() {
            queue += size;
        }
        self.weight * queue
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}
