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
//! Adding a term: one file here with a type implementing [`Scorer`], its
//! `from_config` (its weight and its parameters, decoded strictly with
//! [`decode_params`](super::plugin::decode_params)) and its [`TermDecl`]
//! (name, the llm-d Router plugin types it answers to, weight flag), and one
//! line in [`super::registry::REGISTRY`]; the flag, the `EndpointPickerConfig`
//! mapping, `explain` and the metrics follow from the declaration. The terms,
//! in the order they are summed:
//! - [`prefix::PrefixCache`] (`prefix-cache-scorer`): blocks left to prefill;
//! - [`load::ActiveLoad`] (`active-request-scorer`, `load-aware-scorer`, ...):
//!   active load;
//! - [`queue::Queue`] (`queue-scorer`): scraped queue;
//! - [`kv_usage::KvUsage`] (`kv-cache-utilization-scorer`): scraped KV usage;
//! - [`lora::LoraAffinity`] (`lora-affinity-scorer`): the request's LoRA
//!   adapter resident, else a free adapter slot;
//! - [`running::RunningRequests`] (`running-requests-size-scorer`): requests
//!   running there (weight 0 by default);
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
pub mod running;

use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

use super::plugin::{Knob, PluginArgs, PluginError, Weight};
use crate::endpoints::{ActiveLoad as BookedLoad, EndpointState, LoadFigures, LoadView};

/// A cost term as its file declares it; the registry lists the declarations.
#[derive(Debug)]
pub struct TermDecl {
    /// The term's name (`explain`, the `term` label of the metrics).
    pub name: &'static str,
    /// The llm-d Router plugin types it stands for in an
    /// `EndpointPickerConfig`; none: a built-in term, summed by every plugin
    /// list after the configured ones.
    pub types: &'static [&'static str],
    /// Its weight.
    pub weight: Weight,
    /// Its weight when a prefill worker of a disaggregated pool is picked, if
    /// it has one of its own (else [`TermDecl::weight`]); a `prefill`
    /// scheduling profile scales it.
    pub prefill_weight: Option<Knob>,
    /// Whether an `EndpointPickerConfig` maps the other terms' weights as
    /// ratios to this one's (else to the largest).
    pub unit: bool,
    /// Builds the term.
    pub build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError>,
}

impl TermDecl {
    /// Whether every plugin list sums it (no llm-d type configures it).
    pub fn builtin(&self) -> bool {
        self.types.is_empty()
    }
}

/// Which list of candidates: decode (destination) or prefill workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Workers that serve decode (the destination).
    Decode,
    /// Prefill-only workers of a disaggregated pool.
    Prefill,
}

/// Weight, within the prefill term, of a block still pending on the candidate
/// (routed there, prefill not done) beyond this prompt's overlap. Dynamo counts
/// such blocks at 1 (`prefill_load_scale`); on the tuning trace (BENCHMARKS.md
/// §2) 1 scatters bursts that share a prefix while their first prefill runs,
/// and 0.05 keeps the hit rate while the TTFT tail drops. Two waits count in
/// full instead ([`LONG_PROMPT_TOKENS`], [`MAX_WAIT_BESIDE_IDLE_TOKENS`]).
pub const PENDING_PREFILL_WEIGHT: f64 = 0.05;

/// A prompt with at least this many tokens still to prefill on a candidate
/// counts the pending prefills there in full: its own prefill is long, so the
/// hits it could gain by queueing are few beside the wait (on the tuning
/// trace, the longest prompts make the light-load TTFT tail).
pub const LONG_PROMPT_TOKENS: usize = 24_576;

/// Pending prefill beyond this many tokens on a candidate counts in full while
/// some other rank has none pending ([`Snapshot::idle_ranks`]): no prefix hit
/// is worth waiting behind that much work when a worker could start at once.
///
/// [`Snapshot::idle_ranks`]: crate::endpoints::Snapshot::idle_ranks
pub const MAX_WAIT_BESIDE_IDLE_TOKENS: usize = 131_072;

/// How one pick counts a candidate's wait behind pending prefills, read once
/// per pick and side: the thresholds in blocks, and whether some rank has
/// nothing pending.
#[derive(Debug, Clone, Copy)]
pub struct PendingWait {
    /// [`LONG_PROMPT_TOKENS`] in blocks.
    long_prompt_blocks: usize,
    /// [`MAX_WAIT_BESIDE_IDLE_TOKENS`] in blocks, while a rank of the side has
    /// nothing pending; `None` otherwise.
    beside_idle_blocks: Option<f64>,
    /// Weight of a pending block otherwise ([`PENDING_PREFILL_WEIGHT`] by default).
    weight: f64,
}

impl PendingWait {
    /// The wait of a pick in blocks of `block_tokens` tokens, with
    /// `idle_ranks` ranks of its side having nothing pending and a pending
    /// block otherwise weighing `weight` (clamped to 0..1).
    pub fn new(block_tokens: usize, idle_ranks: u64, weight: f64) -> Self {
        let block = block_tokens.max(1);
        PendingWait {
            long_prompt_blocks: LONG_PROMPT_TOKENS.div_ceil(block),
            beside_idle_blocks: (idle_ranks > 0)
                .then_some(MAX_WAIT_BESIDE_IDLE_TOKENS.div_ceil(block) as f64),
            weight: weight.clamp(0.0, 1.0),
        }
    }

    /// The pending blocks a prompt with `new_blocks` left to prefill counts,
    /// for `pending` blocks it would wait behind: [`PENDING_PREFILL_WEIGHT`]
    /// each, all of them for a long prompt, and those beyond the wait allowed
    /// beside an idle rank in full. Never below zero, never above `pending`.
    pub fn weigh(&self, pending: f64, new_blocks: usize) -> f64 {
        if new_blocks >= self.long_prompt_blocks {
            return pending;
        }
        match self.beside_idle_blocks {
            Some(max) if pending > max => self.weight * max + (pending - max),
            _ => self.weight * pending,
        }
    }
}

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
    /// The leading blocks it holds on lower storage tiers, at their load
    /// cost as a fraction of a block's prefill ([`crate::scheduler::tiers`]).
    pub transfer_blocks: f64,
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
pub struct CostTerms(pub SmallVec<[(&'static str, f64); 8]>);

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
