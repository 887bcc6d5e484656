//! The cost of sending a request to a candidate, and the choice among candidates.
//!
//! Costs are in KV blocks of work (see `docs/scheduling.md`): the sum of the
//! scheduler's cost terms ([`super::terms`]; by default the blocks the candidate
//! must still prefill, its active load, and its scraped queue and KV usage
//! counted at the request's size), read from one look at the candidate. The
//! pruned argmin's floor is the sum of the terms' lower bounds.

use std::sync::atomic::Ordering;

use rand::Rng;
use smallvec::SmallVec;

use super::candidates::Cand;
use super::terms::predicted::{self, LatencyAsk};
use super::terms::{Candidate, CostTerms, PendingWait, RequestCost, Side};
use super::{PickRequest, Plugins, Scheduler};
use crate::kv::hash::PromptBlocks;
use crate::latency::features::MAX_OUTPUT_TOKENS;
use crate::latency::{Features, Prediction};
use crate::request::InferenceRequest;

impl Scheduler {
    /// How this pick counts waits behind pending prefills, with `idle_ranks`
    /// ranks of its side having nothing pending ([`Snapshot::idle_ranks`]: the
    /// whole pool's, health and subset hints aside). A candidate with blocks
    /// pending is never one of them, so any idle rank is another one.
    ///
    /// [`Snapshot::idle_ranks`]: crate::endpoints::Snapshot::idle_ranks
    pub(super) fn pending_wait(&self, idle_ranks: u64) -> PendingWait {
        PendingWait::new(
            self.config.token_block,
            idle_ranks,
            self.config.pending_prefill_weight,
        )
    }

    /// What the terms read about a request of `size` blocks for `adapter` on
    /// `side`, with `idle_ranks` ranks of that side having nothing pending.
    pub(super) fn request_cost(
        &self,
        side: Side,
        size: u64,
        adapter: Option<u64>,
        idle_ranks: u64,
    ) -> RequestCost {
        RequestCost {
            size,
            side,
            wait: self.pending_wait(idle_ranks),
            adapter,
            latency: Default::default(),
        }
    }

    /// The least cost of any candidate left `new_blocks` to prefill: the sum
    /// of the terms' lower bounds. `None` when a term has none (a negative
    /// weight), so no floor holds. The pick skips candidates on this bound.
    #[inline]
    pub(super) fn cost_floor(
        plugins: &Plugins,
        new_blocks: usize,
        req: &RequestCost,
    ) -> Option<f64> {
        let mut floor = 0.0;
        for s in &plugins.scorers {
            floor += s.lower_bound(new_blocks, req)?;
        }
        Some(floor)
    }

    /// What the terms read about candidate `c` left `new_blocks` to prefill,
    /// at `now` coded by [`Epoch::process`](crate::time::Epoch::process).
    #[inline(always)]
    fn inputs<'a>(&self, c: &Cand<'a>, new_blocks: usize, now: i64) -> Candidate<'a> {
        Candidate {
            endpoint: c.ep,
            rank: c.rank,
            booked: c.ep.active_load(c.rank),
            view: c.ep.load_view_at(now, self.config.scrape_max_age),
            new_blocks,
        }
    }

    /// The cost of sending `req` to candidate `c`, left `new_blocks` to
    /// prefill there: the sum of the terms of `plugins`, each written into
    /// `terms` (one slot per scorer, in summing order), so the winner's need
    /// no rescoring.
    #[inline(always)]
    pub(super) fn cost_into(
        &self,
        plugins: &Plugins,
        c: &Cand<'_>,
        new_blocks: usize,
        req: &RequestCost,
        now: i64,
        terms: &mut [f64],
    ) -> f64 {
        let inputs = self.inputs(c, new_blocks, now);
        let mut total = 0.0;
        for (s, term) in plugins.scorers.iter().zip(terms.iter_mut()) {
            *term = s.cost(&inputs, req);
            total += *term;
        }
        total
    }

    /// What the predicted term reads about `req` (the default when latency
    /// is not learned): the prompt of `load_blocks`, its expected output and
    /// objectives, and whether the pool prior is warm now.
    pub(super) fn latency_ask(
        &self,
        req: &PickRequest<'_>,
        prompt: &PromptBlocks,
        load_blocks: u64,
    ) -> LatencyAsk {
        let Some(l) = &self.latency else {
            return LatencyAsk::default();
        };
        let per_block = prompt.tokens_per_block.max(1) as u64;
        LatencyAsk {
            warm: l.is_warm(),
            prompt_tokens: load_blocks.saturating_mul(per_block),
            tokens_per_block: per_block,
            max_tokens: req.body.and_then(expected_output_tokens),
            slo: req.slo,
        }
    }

    /// Candidate `c` left `new_blocks` to prefill as the latency model reads it.
    pub(super) fn latency_features(
        &self,
        c: &Cand<'_>,
        new_blocks: usize,
        req: &RequestCost,
        now: i64,
    ) -> Features {
        predicted::features(&self.inputs(c, new_blocks, now), req)
    }

    /// The predicted latency of `req` on `c` left `new_blocks` to prefill,
    /// when latency is learned and the pool prior is warm.
    pub(super) fn prediction(
        &self,
        c: &Cand<'_>,
        new_blocks: usize,
        req: &RequestCost,
        now: i64,
    ) -> Option<Prediction> {
        let l = self.latency.as_ref()?;
        l.predict(&c.key, &self.latency_features(c, new_blocks, req, now))
    }

    /// A buffer for [`Scheduler::cost_into`]: one slot per scorer of `plugins`.
    pub(super) fn term_buffer(plugins: &Plugins) -> TermCosts {
        SmallVec::from_elem(0.0, plugins.scorers.len())
    }

    /// Names `costs` (one per scorer of `plugins`, in summing order) as
    /// [`CostTerms`].
    pub(super) fn named_terms(plugins: &Plugins, costs: &[f64]) -> CostTerms {
        let names = plugins.scorers.iter().map(|s| s.name());
        CostTerms(names.zip(costs.iter().copied()).collect())
    }

    /// [`Scheduler::cost_into`] as named terms.
    pub(super) fn cost_terms(
        &self,
        plugins: &Plugins,
        c: &Cand<'_>,
        new_blocks: usize,
        req: &RequestCost,
        now: i64,
    ) -> CostTerms {
        let inputs = self.inputs(c, new_blocks, now);
        CostTerms(
            plugins
                .scorers
                .iter()
                .map(|s| (s.name(), s.cost(&inputs, req)))
                .collect(),
        )
    }

    /// The seed of one argmin tie-break: the next draw of the configured
    /// sequence, else a random one.
    pub(super) fn tie_break_seed(&self) -> u64 {
        match self.config.tie_break_seed {
            Some(seed) => draw(
                seed,
                self.tie_breaks.fetch_add(1, Ordering::Relaxed) as usize,
            ),
            None => rand::rng().random(),
        }
    }
}

/// One candidate's cost term by term, in the scorers' summing order (the
/// scorers' names stay with the scheduler); inline up to eight terms, on the
/// heap beyond.
pub(super) type TermCosts = SmallVec<[f64; 8]>;

/// Argmin of `costs` with a uniform random tie-break; with `temperature > 0`,
/// samples index i with probability ∝ exp(−c′ᵢ / temperature), where c′ are the
/// costs scaled to [0, 1].
pub(super) fn pick_index(costs: &[f64], temperature: f64, rng: &mut impl Rng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if temperature > 0.0 && costs.len() > 1 && min.is_finite() {
        // Only finite costs scale the span; an infinite (or NaN) cost gets weight 0.
        let max = costs
            .iter()
            .copied()
            .filter(|c| c.is_finite())
            .fold(f64::NEG_INFINITY, f64::max);
        let span = if max > min { max - min } else { 1.0 };
        let weights: Vec<f64> = costs
            .iter()
            .map(|&c| match c.is_finite() {
                true => (-(c - min) / span / temperature).exp(),
                false => 0.0,
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        // Rounding left x ≥ 0 after the last weight: the last candidate with any.
        return weights.iter().rposition(|w| *w > 0.0).unwrap_or(0);
    }
    argmin(costs.iter().copied(), rng.random())
}

/// Output tokens `body` expects, as the latency model reads them: its
/// `nvext.agent_hints.osl` (an estimate), else its output cap
/// ([`InferenceRequest::max_output_tokens`]); at most [`MAX_OUTPUT_TOKENS`],
/// and 0 reads as unknown.
pub(super) fn expected_output_tokens(body: &InferenceRequest) -> Option<u32> {
    body.nvext
        .agent_hints
        .as_ref()
        .and_then(|h| h.osl)
        .filter(|n| *n > 0)
        .or(body.max_output_tokens)
        .filter(|n| *n > 0)
        .map(|n| n.min(MAX_OUTPUT_TOKENS))
}

/// Index of the least cost in one pass (see [`Least`]); 0 when every cost is
/// NaN or there is none.
fn argmin(costs: impl Iterator<Item = f64>, seed: u64) -> usize {
    let mut least = Least::new(seed);
    for (i, c) in costs.enumerate() {
        least.take(i, c, false);
    }
    least.best.unwrap_or(0)
}

/// The least cost offered so far: costs within 1e-9 of the least tie; among
/// tied offers one whose overlap the worker's KV events confirmed beats one
/// whose overlap is only a guess (provisional entries), and otherwise one
/// wins uniformly (each tied offer gets a pseudo-random draw from the seed and
/// the least draw wins: no generator call per tie). NaN never wins. Offered as
/// a [`Best`], it keeps the winner's cost term by term.
pub(super) struct Least<T> {
    /// The winner so far.
    pub(super) best: Option<T>,
    /// Its cost (infinite before any offer).
    pub(super) cost: f64,
    /// Its cost term by term (offers as a [`Best`] only; copied when it wins).
    pub(super) terms: TermCosts,
    /// Whether the winner's overlap is a guess.
    guessed: bool,
    draw: u64,
    seed: u64,
    offers: usize,
}

impl<T> Least<T> {
    /// Nothing offered yet; ties broken by draws from `seed`.
    pub(super) fn new(seed: u64) -> Self {
        Least {
            best: None,
            cost: f64::INFINITY,
            terms: TermCosts::new(),
            guessed: false,
            draw: u64::MAX,
            seed,
            offers: 0,
        }
    }

    /// Offers `item` at `cost`; `guessed`: its overlap is unconfirmed.
    /// Whether `item` is now the winner.
    #[inline]
    pub(super) fn take(&mut self, item: T, cost: f64, guessed: bool) -> bool {
        let i = self.offers;
        self.offers += 1;
        if cost < self.cost - 1e-9 {
            self.cost = cost;
            self.best = Some(item);
            self.guessed = guessed;
            self.draw = draw(self.seed, i);
            return true;
        } else if cost <= self.cost + 1e-9 {
            self.cost = self.cost.min(cost);
            let d = draw(self.seed, i);
            if (guessed, d) < (self.guessed, self.draw) {
                self.best = Some(item);
                self.guessed = guessed;
                self.draw = d;
                return true;
            }
        }
        false
    }

    /// Whether no candidate costing at least `floor` can win any more: the
    /// least cost is at most `floor`, and below it when the winner is a guess
    /// (a confirmed holder at that cost would beat it).
    #[inline]
    pub(super) fn beats(&self, floor: f64) -> bool {
        match self.guessed {
            false => self.cost <= floor,
            true => self.cost < floor - 1e-9,
        }
    }
}

/// What the pruned argmin collects: offered candidates at their costs, and
/// whether a candidate costing at least a floor can still change it.
pub(super) trait Best<T> {
    /// Offers `item` at `cost`, `terms` term by term; `guessed`: its overlap
    /// is unconfirmed. The terms are copied only if the item is kept.
    fn offer(&mut self, item: T, cost: f64, terms: &[f64], guessed: bool);
    /// Whether no candidate costing at least `floor` can change the result.
    fn beats(&self, floor: f64) -> bool;
}

impl<T> Best<T> for Least<T> {
    #[inline(always)]
    fn offer(&mut self, item: T, cost: f64, terms: &[f64], guessed: bool) {
        if self.take(item, cost, guessed) {
            self.terms.clear();
            self.terms.extend_from_slice(terms);
        }
    }

    #[inline(always)]
    fn beats(&self, floor: f64) -> bool {
        Least::beats(self, floor)
    }
}

/// The `n` least costly candidates of distinct addresses, least first, ties
/// broken as [`Least`] does (a confirmed overlap first, then the draw; a pick
/// asked for fallbacks). A candidate whose address is kept already replaces it
/// only if it ranks before it (the best rank of a data-parallel endpoint stands
/// for it). NaN never counts.
pub(super) struct Ranked<'a> {
    n: usize,
    seed: u64,
    offers: usize,
    /// (rank key, candidate, its cost term by term), least first; at most `n`.
    kept: Vec<(RankKey, Cand<'a>, TermCosts)>,
}

/// How [`Ranked`] orders offers: cost, then a confirmed overlap before a
/// guessed one, then the draw.
#[derive(Clone, Copy)]
struct RankKey {
    cost: f64,
    guessed: bool,
    draw: u64,
}

impl RankKey {
    /// Whether `self` ranks before `other`: a lower cost, or within 1e-9 a
    /// confirmed overlap before a guess, then a lower draw.
    fn before(self, other: RankKey) -> bool {
        match (self.cost - other.cost).abs() <= 1e-9 {
            true => (self.guessed, self.draw) < (other.guessed, other.draw),
            false => self.cost < other.cost,
        }
    }
}

impl<'a> Ranked<'a> {
    /// Nothing offered yet; keeps `n` (at least 1), ties broken by draws from `seed`.
    pub(super) fn new(seed: u64, n: usize) -> Self {
        let n = n.max(1);
        Ranked {
            n,
            seed,
            offers: 0,
            kept: Vec::with_capacity(n),
        }
    }

    /// The kept candidates with their costs term by term, least cost first.
    pub(super) fn into_vec(self) -> Vec<(Cand<'a>, TermCosts)> {
        self.kept.into_iter().map(|(_, c, t)| (c, t)).collect()
    }
}

impl<'a> Best<Cand<'a>> for Ranked<'a> {
    fn offer(&mut self, item: Cand<'a>, cost: f64, terms: &[f64], guessed: bool) {
        let draw = draw(self.seed, self.offers);
        self.offers += 1;
        if cost.is_nan() {
            return;
        }
        let address = item.ep.endpoint.address;
        let key = RankKey {
            cost,
            guessed,
            draw,
        };
        if let Some(i) = self
            .kept
            .iter()
            .position(|k| k.1.ep.endpoint.address == address)
        {
            if !key.before(self.kept[i].0) {
                return;
            }
            self.kept.remove(i);
        } else if self.kept.len() == self.n {
            if !key.before(self.kept[self.n - 1].0) {
                return;
            }
            self.kept.pop();
        }
        let at = self
            .kept
            .iter()
            .position(|k| key.before(k.0))
            .unwrap_or(self.kept.len());
        self.kept
            .insert(at, (key, item, TermCosts::from_slice(terms)));
    }

    fn beats(&self, floor: f64) -> bool {
        match self.kept.get(self.n - 1) {
            Some((last, ..)) if last.guessed => last.cost < floor - 1e-9,
            Some((last, ..)) => last.cost <= floor,
            None => false,
        }
    }
}

/// A pseudo-random value for index `i` under `seed` (SplitMix64's finaliser).
fn draw(seed: u64, i: usize) -> u64 {
    let mut z = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
