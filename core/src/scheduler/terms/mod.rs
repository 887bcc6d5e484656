//! Cost terms (scorers): each is a named, additive, lower-is-better cost of
//! sending a request to one candidate, in KV blocks of work. The pick adds up
//! the terms and takes the least total (see `pick.rs`).
//!
//! Invariants every term keeps, so the pruned argmin stays exact:
//! - [`Scorer::cost`] is finite for every candidate (a stale or missing input
//!   counts as a pessimistic figure, never as NaN or infinity);
//! - [`Scorer::lower_bound`] is at most the cost of any candidate of that
//!   request holding the given overlap (`None` when no bound holds, e.g. a
//!   negative weight: the pick then scores every candidate). The pick skips
//!   candidates once the least total found is at most the sum of the terms'
//!   bounds for what they could hold.
//!
//! Adding a term: one file here with a type implementing [`Scorer`] and its
//! `from_config` (its weight and its parameters, decoded strictly with
//! [`super::registry::decode_params`]), and one line in
//! [`super::registry::REGISTRY`] under the llm-d Router plugin type name it
//! answers to. The built-ins, in the order they are summed:
//! - [`prefix::PrefixCache`] (`prefix-cache-scorer`): blocks left to prefill;
//! - [`load::ActiveLoad`] (`active-request-scorer`, `load-aware-scorer`, ...):
//!   active load;
//! - [`queue::Queue`] (`queue-scorer`): scraped queue;
//! - [`kv_usage::KvUsage`] (`kv-cache-utilization-scorer`): scraped KV usage;
//! - [`lora::LoraAffinity`] (`lora-affinity-scorer`): the request's LoRA
//!   adapter resident, else a free adapter slot;
//! - [`failures::FailedResponses`] (built in, no llm-d type): responses the
//!   candidate failed since its last success.
//!
//! With `--scoring predicted`, [`predicted::Predicted`] wraps the weighted
//! terms: it costs in predicted seconds once the latency models are warm, and
//! sums the wrapped terms until then.

pub mod failures;
pub mod kv_usage;
pub mod load;
pub mod lora;
pub mod predicted;
pub mod prefix;
pub mod queue;

use std::fmt;

use smallvec::SmallVec;

use super::candidates::Side;
use super::cost::PendingWait;
use crate::endpoints::{ActiveLoad as BookedLoad, EndpointState, LoadFigures, LoadView};

/// One named cost term (Dynamo's `WorkerScorer` shape: a finite,
/// lower-is-better cost from declared inputs).
pub trait Scorer: Send + Sync + fmt::Debug {
    /// The term's name, as `explain` lists it.
    fn name(&self) -> &'static str;

    /// The weighted cost of sending `req` to `cand`: finite, lower is better.
    fn cost(&self, cand: &Candidate<'_>, req: &RequestCost) -> f64;

    /// The least [`Scorer::cost`] of any candidate of `req` that has
    /// `new_blocks` prompt blocks left to prefill; `None` when no bound holds.
    fn lower_bound(&self, new_blocks: usize, req: &RequestCost) -> Option<f64>;
}

/// What the terms read about one candidate (worker rank), read once per
/// candidate before they are summed.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// The endpoint's live state.
    pub endpoint: &'a EndpointState,
    /// The data-parallel rank.
    pub rank: u32,
    /// Load booked on the rank by unfinished requests kvpick routed there.
    pub booked: BookedLoad,
    /// Its scraped load, as fresh as it is.
    pub view: LoadView,
    /// Prompt blocks it would still have to prefill (the prompt's after the
    /// leading blocks it holds).
    pub new_blocks: usize,
}

impl Candidate<'_> {
    /// The scraped figures that count (fresh, or a suspect worker's last ones).
    pub fn scraped(&self) -> Option<LoadFigures> {
        match self.view {
            LoadView::Fresh(s) | LoadView::Suspect(Some(s)) => Some(s),
            LoadView::Suspect(None) | LoadView::Unknown => None,
        }
    }

    /// Whether scrapes stopped or fail after a success: the worker may be hung,
    /// so its last figures stand with a full KV cache and one more queued
    /// request. A worker never scraped successfully (just Ready, or serving no
    /// `/metrics`) is not suspect: it costs what kvpick booked there.
    pub fn suspect(&self) -> bool {
        matches!(self.view, LoadView::Suspect(Some(_)))
    }

    /// Requests kvpick has in flight on the rank.
    pub fn in_flight(&self) -> f64 {
        f64::from(self.endpoint.in_flight(self.rank))
    }

    /// Data-parallel ranks of the worker (scraped figures are per worker).
    pub fn ranks(&self) -> f64 {
        f64::from(self.endpoint.ranks())
    }
}

/// Where a candidate's load terms come from (`explain` shows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSource {
    /// A fresh scrape, with kvpick's bookings.
    Scraped,
    /// Scrapes stopped or fail after a success: the last figures, with a full
    /// KV cache and one more queued request ([`Candidate::suspect`]).
    Suspect,
    /// Never scraped successfully (just Ready, or no `/metrics`): kvpick's
    /// bookings only.
    Unscraped,
}

impl LoadSource {
    /// The source of a load view.
    pub fn of(view: &LoadView) -> Self {
        match view {
            LoadView::Fresh(_) => LoadSource::Scraped,
            LoadView::Suspect(Some(_)) => LoadSource::Suspect,
            LoadView::Suspect(None) | LoadView::Unknown => LoadSource::Unscraped,
        }
    }

    /// Its name: `scraped`, `suspect` or `unscraped`.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSource::Scraped => "scraped",
            LoadSource::Suspect => "suspect",
            LoadSource::Unscraped => "unscraped",
        }
    }
}

/// What the terms read about the request, once per pick and side.
#[derive(Debug, Clone, Copy)]
pub struct RequestCost {
    /// Blocks the request books (prompt, capped per request).
    pub size: u64,
    /// The side being picked.
    pub side: Side,
    /// How waits behind pending prefills count on this side.
    pub wait: PendingWait,
    /// The request's `model` as an adapter id
    /// ([`adapter_id`](crate::endpoints::adapter_id)); `None` without a body.
    pub adapter: Option<u64>,
    /// What the predicted term reads (the default outside predicted mode).
    pub latency: predicted::LatencyAsk,
}

/// A candidate's cost term by term (name, weighted cost), in summing order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CostTerms(pub SmallVec<[(&'static str, f64); 6]>);

impl CostTerms {
    /// The cost: the sum of the terms.
    pub fn total(&self) -> f64 {
        self.0.iter().map(|(_, c)| c).sum()
    }

    /// The term named `name` (0 when there is none).
    pub fn get(&self, name: &str) -> f64 {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0.0, |(_, c)| *c)
    }
}

/// `weight` as a term's bound factor: the bound of a term that is `weight`
/// times something at least `least`, `None` for a negative (or NaN) weight.
pub(crate) fn bound(weight: f64, least: f64) -> Option<f64> {
    (weight >= 0.0).then_some(weight * least)
}
