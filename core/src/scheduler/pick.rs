//! The pick: candidates → session pin → hash → lookup → score → book.
//!
//! One pick serves routing and `explain` alike: it is generic over an
//! [`Observer`]. A routing pick ([`Route`]) prunes, samples with the picker's
//! temperature, pins sessions and books; an explaining one
//! ([`super::explain`]) scores every candidate, takes the least cost, reads
//! the session table without touching it and books nothing.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rand::Rng;

use super::candidates::{Cand, Pool};
use super::cost::{pick_index, Best, Least, Ranked, TermCosts};
use super::overlap::{Held, PromptOverlaps};
use super::pickers::Choice;
use super::terms::predicted::LatencyAsk;
use super::terms::{CostTerms, RequestCost, Side};
use super::tiers::{TierCosts, Work};
use super::{Decision, PickError, PickRequest, Plugins, Scheduler, Stage, StageTimer};
use crate::endpoints::{adapter_id, ActiveLoad, Engine, Snapshot, WorkerKey};
use crate::kv::{hash, tier};
use crate::latency::Prediction;
use crate::request::InferenceRequest;
use crate::sessions::{Pin, SessionTurn};
use crate::time::Epoch;

impl Scheduler {
    /// Chooses the decode target (and a prefill target in disaggregated pools).
    pub fn pick(&self, req: &PickRequest<'_>, snapshot: &Snapshot) -> Result<Decision, PickError> {
        self.pick_at(req, snapshot, Instant::now())
    }

    /// [`Scheduler::pick`] at a given instant (tests drive the clock).
    pub fn pick_at(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
    ) -> Result<Decision, PickError> {
        self.run(req, snapshot, now, &mut Route)
    }

    /// [`Scheduler::pick`], also returning the chosen decode rank's cost term
    /// by term as scored before its booking (what a trace of the request
    /// shows), at a given instant. The plain pick never computes them.
    pub fn pick_with_terms(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
    ) -> Result<(Decision, CostTerms), PickError> {
        let mut traced = RouteWithTerms::default();
        let decision = self.run(req, snapshot, now, &mut traced)?;
        Ok((decision, traced.terms))
    }

    /// The pick, reported to `obs` (see the module doc).
    pub(super) fn run<O: Observer>(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
        obs: &mut O,
    ) -> Result<Decision, PickError> {
        if snapshot.endpoints.is_empty() {
            return Err(PickError::NoEndpoints);
        }
        // Coded once: every per-endpoint time check below compares integers.
        let tick = Epoch::process().encode(now);
        // Loaded once: the whole pick runs on one plugin list.
        let live = self.plugins();
        let plugins = &live.plugins;
        let pool = Pool::new(req, snapshot, tick, &plugins.filters)?;

        let (session, pinned, pinned_prefill) = {
            let _t = self.timer::<O>(Stage::Session);
            let mut session = SessionTurn::of(req.body, req.session_id);
            let pins = match session.as_mut() {
                Some(turn) if O::EXPLAINS => Some(self.bound(turn, &pool, now)),
                Some(turn) => self.pinned(turn, req.session_token, &pool, now),
                None => Some((None, None)),
            };
            match pins {
                Some((pinned, pinned_prefill)) => (session, pinned, pinned_prefill),
                None => (None, None, None),
            }
        };

        let (prompt, load_blocks) = {
            let _t = self.timer::<O>(Stage::Hash);
            self.prompt_and_size(req.body)
        };
        let hashes = &prompt.hashes;
        // Per-request cap on booked load: the prompt first, expected output in
        // what is left.
        let cap = self.config.max_request_load_blocks;
        let load_blocks = load_blocks.min(cap);

        let overlaps = {
            let _t = self.timer::<O>(Stage::Lookup);
            self.provisional.expire(now);
            self.overlaps(hashes, now)
        };
        let scoring = Scoring {
            plugins,
            pool: &pool,
            overlaps: overlaps.as_ref(),
            prompt: &prompt,
            size: load_blocks,
            adapter: req.body.map(|b| adapter_id(&b.model)),
            latency: self.latency_ask(req, &prompt, load_blocks),
            tier_costs: self.config.tier_costs,
            now: tick,
        };
        if let (Some(l), false) = (&self.latency, O::EXPLAINS || scoring.latency.warm) {
            l.count_fallback();
        }

        let (d, d_terms, fallbacks, overlap, p) = {
            let _t = self.timer::<O>(Stage::Score);
            let (d, d_terms, fallbacks) = match self.max_endpoints(plugins) {
                n if n > 1 && !O::EXPLAINS => self.choose_with_fallbacks(&scoring, pinned, n),
                _ => self
                    .choose_unless_pinned(&scoring, Side::Decode, pinned, obs)
                    .map(|(d, terms)| (d, terms, Vec::new())),
            }
            .ok_or(PickError::NoDecodeEndpoint)?;
            // Without a prefill-only endpoint there is no prefill candidate to
            // look for (a pass over the pool would find none).
            let p = match req.body {
                Some(_) if pool.has_prefill_workers() => self
                    .choose_unless_pinned(&scoring, Side::Prefill, pinned_prefill, obs)
                    .map(|(p, _)| p),
                _ => None,
            };
            (d, d_terms, fallbacks, scoring.held(&d), p)
        };
        let work = scoring.work(&overlap);
        let overlap = overlap.blocks();
        if !O::EXPLAINS && pinned.is_none() && self.slo_unreachable(req, &scoring, &d, work) {
            return Err(PickError::SloUnreachable);
        }
        if O::EXPLAINS {
            obs.chosen(
                &scoring,
                &d,
                p.as_ref(),
                (pinned.is_some(), pinned_prefill.is_some()),
            );
        } else {
            self.count_blocks(prompt.hashes.len(), overlap);
            // The winner's terms as the argmin summed them; a pinned rank,
            // which nothing scored, is scored here once.
            let terms = d_terms.unwrap_or_else(|| {
                let req = scoring.request_cost(self, Side::Decode);
                let mut terms = Self::term_buffer(plugins);
                self.cost_into(plugins, &d, work, &req, tick, &mut terms);
                terms
            });
            live.decision_cost.add(&terms);
            obs.decode_terms(plugins, &terms);
        }

        let decode_blocks = req
            .body
            .map_or(0, |b| self.expected_decode_blocks(b))
            .min(cap - load_blocks);
        let uncached_blocks = (work.new_blocks as u64).min(load_blocks);
        let prefill_target = p.map(|c| c.target());
        let bootstrap_port = prefill_target.as_ref().and_then(|p| {
            let ep = p.endpoint();
            ep.bootstrap_port.or_else(|| {
                (ep.engine == Engine::Sglang)
                    .then_some(self.config.sglang_bootstrap_port)
                    .flatten()
            })
        });
        let bootstrap_room = bootstrap_port.map(|_| rand::rng().random::<u64>() >> 1);
        // What the latency model learns from, read before this request books.
        let latency_features = match (&self.latency, req.body) {
            (Some(_), Some(b)) if b.stream && !O::EXPLAINS => {
                let req = scoring.request_cost(self, Side::Decode);
                Some(self.latency_features(&d, work, &req, tick))
            }
            _ => None,
        };
        let mut decision = Decision {
            latency_features,
            decode: d.target(),
            fallbacks: fallbacks.iter().map(Cand::target).collect(),
            prefill: prefill_target,
            bootstrap_port,
            bootstrap_room,
            session,
            prompt_blocks: hashes.len(),
            overlap_blocks: overlap,
            load_blocks,
            uncached_blocks,
            decode_blocks,
            prefilled: Default::default(),
            guess: None,
        };
        if !O::EXPLAINS {
            // Booked from the decision, so `cancel`/`finish` release exactly this.
            let (mut guessed, decode_at) = self.record(&d, &prompt, decision.decode_load(), now);
            let mut prefill_at = None;
            if let Some(p) = p {
                let (g, at) = self.record(&p, &prompt, decision.prefill_load(), now);
                guessed |= g;
                prefill_at = at;
            }
            decision.guess = guessed.then(|| Arc::from(&hashes[..]));
            self.share_decision(&decision, hashes, decode_at, prefill_at);
        }
        Ok(decision)
    }

    /// Whether a sheddable request with a TTFT objective is to be refused:
    /// the chosen decode rank (left `work` to do there), the least costly,
    /// has a warm model of its own
    /// and is predicted to miss the objective. A candidate predicted to meet
    /// it costs less than any predicted to miss it (`terms/predicted.rs`), so
    /// every warm worker misses too; a cold choice is given the benefit of
    /// the doubt. Counted in the learner.
    fn slo_unreachable(
        &self,
        req: &PickRequest<'_>,
        scoring: &Scoring<'_, '_>,
        d: &Cand<'_>,
        work: Work,
    ) -> bool {
        let (Some(l), Some(slo), true) = (&self.latency, req.slo.ttft, req.sheddable) else {
            return false;
        };
        let cost = scoring.request_cost(self, Side::Decode);
        let missed = self
            .prediction(d, work, &cost, scoring.now)
            .is_some_and(|p| p.ttft > slo && l.is_warm_worker(&d.key));
        if missed {
            l.count_slo_shed();
        }
        missed
    }

    /// Times `stage` of a routing pick (an explaining one is not counted).
    fn timer<O: Observer>(&self, stage: Stage) -> Option<StageTimer<'_>> {
        (!O::EXPLAINS).then(|| self.stats.time(stage))
    }

    /// Counts a routed prompt's blocks and those its decode target held.
    fn count_blocks(&self, queried: usize, matched: usize) {
        self.stats
            .blocks_queried
            .fetch_add(queried as u64, Ordering::Relaxed);
        self.stats
            .blocks_matched
            .fetch_add(matched as u64, Ordering::Relaxed);
    }

    /// The prompt's blocks and the load it books (before the per-request cap).
    pub(super) fn prompt_and_size(
        &self,
        body: Option<&InferenceRequest>,
    ) -> (hash::PromptBlocks, u64) {
        match body {
            Some(b) => (
                self.prompt_blocks(b),
                hash::request_size_blocks_for(
                    &b.segments,
                    self.config.byte_block,
                    self.config.token_block,
                    self.config.vision.as_ref(),
                )
                .saturating_add(
                    b.unhashed_blocks(self.config.byte_block, self.config.token_block) as u64,
                ),
            ),
            None => (hash::PromptBlocks::default(), 1),
        }
    }

    /// Blocks the request's expected output will take on its decode rank:
    /// `nvext.agent_hints.osl` tokens, else the configured default.
    fn expected_decode_blocks(&self, body: &InferenceRequest) -> u64 {
        let osl = body
            .nvext
            .agent_hints
            .as_ref()
            .and_then(|h| h.osl)
            .unwrap_or(self.config.default_osl_tokens);
        u64::from(osl).div_ceil(self.config.token_block.max(1) as u64)
    }

    /// The decode candidate (and prefill candidate) a session turn is pinned to,
    /// if any. A binding whose decode worker is gone re-homes the turn (counted);
    /// a prefill rank that is gone is re-scored. `None` when the session's worker
    /// is live but outside the subset hint: the request goes without its
    /// session (a caller cannot re-home someone's session by naming a worker of
    /// its choice).
    fn pinned<'s>(
        &self,
        turn: &mut SessionTurn,
        token: Option<&str>,
        pool: &Pool<'s, '_>,
        now: Instant,
    ) -> Option<(Option<Cand<'s>>, Option<Cand<'s>>)> {
        let ready = |k: WorkerKey| pool.get(k, Side::Decode).is_some() || pool.outside_subset(k);
        match self.sessions.pin(turn, token, ready, now) {
            Pin::Ready {
                decode: d,
                prefill: p,
            } => Some((
                Some(pool.get(d, Side::Decode)?),
                p.and_then(|p| pool.get(p, Side::Prefill)),
            )),
            Pin::Rehome => {
                self.stats.session_repicks.fetch_add(1, Ordering::Relaxed);
                if turn.rehomed {
                    self.stats.session_rehomes.fetch_add(1, Ordering::Relaxed);
                }
                Some((None, None))
            }
            Pin::Unbound => Some((None, None)),
        }
    }

    /// [`Self::pinned`] read without touching the session table: the live
    /// binding's candidates while its decode rank is one.
    fn bound<'s>(
        &self,
        turn: &SessionTurn,
        pool: &Pool<'s, '_>,
        now: Instant,
    ) -> (Option<Cand<'s>>, Option<Cand<'s>>) {
        let live = self.sessions.binding(&turn.id).filter(|b| b.expires > now);
        match live.and_then(|b| Some((pool.get(b.worker, Side::Decode)?, b.prefill))) {
            Some((d, p)) => (Some(d), p.and_then(|p| pool.get(p, Side::Prefill))),
            None => (None, None),
        }
    }

    /// The `pinned` candidate, else [`Self::choose`]'s with its cost term by
    /// term (`None` for a pinned one: an explaining pick scores every
    /// candidate, pinned or not, a routing pick none).
    fn choose_unless_pinned<'s, O: Observer>(
        &self,
        at: &Scoring<'s, '_>,
        side: Side,
        pinned: Option<Cand<'s>>,
        obs: &mut O,
    ) -> Option<(Cand<'s>, Option<TermCosts>)> {
        match pinned {
            Some(c) if !O::EXPLAINS => Some((c, None)),
            _ => {
                let best = self.choose(at, side, obs);
                match pinned {
                    Some(c) => Some((c, None)),
                    None => best.map(|(c, terms)| (c, Some(terms))),
                }
            }
        }
    }

    /// The least costly candidate for `side`, uniform among equal costs, or
    /// sampled by cost as the picker says; `None` when there is none. An
    /// explaining pick scores every candidate and takes the first least cost.
    /// While no state is shared with peer replicas, the argmin takes the
    /// agreed one of the near-best instead (`agreement.rs`).
    ///
    /// Holders of the prompt first, the deepest first: a candidate's cost is at
    /// least [`Scheduler::cost_floor`] of the blocks it holds, so once the least
    /// cost found is at most the floor of every candidate not yet scored, the
    /// others are skipped. Those holding nothing share the floor of the whole
    /// prompt; they are read from a random endpoint on, until one costs that
    /// floor. A busy pool's pick thus reads the prompt's holders and a few
    /// others, not every endpoint. Holders are found by key, except in a level
    /// of over a quarter of the pool: then the pool is read in order, from a
    /// random endpoint, each with its overlap, until one costs that level's
    /// floor.
    fn choose<'s, O: Observer>(
        &self,
        at: &Scoring<'s, '_>,
        side: Side,
        obs: &mut O,
    ) -> Option<(Cand<'s>, TermCosts)> {
        let req = at.request_cost(self, side);
        if O::EXPLAINS {
            let mut best: Option<(Cand<'s>, f64, bool)> = None;
            for c in at.pool.iter(side) {
                let held = at.held(&c);
                let (work, guessed) = (at.work(&held), held.guessed);
                let terms = self.cost_terms(at.plugins, &c, work, &req, at.now);
                let prediction = self.prediction(&c, work, &req, at.now);
                let total = terms.total();
                let better = |&(_, least, least_guessed): &(Cand<'s>, f64, bool)| {
                    total < least - 1e-9 || (total <= least + 1e-9 && least_guessed && !guessed)
                };
                if best.as_ref().is_none_or(better) {
                    best = Some((c, total, guessed));
                }
                obs.scored(&c, held.blocks(), terms, prediction);
            }
            // An explaining pick records no terms.
            return best.map(|(c, _, _)| (c, TermCosts::new()));
        }
        if let Choice::Sample { temperature } = at.plugins.choice() {
            let (cands, costs, terms) = at.score_all(self, side, &req);
            let i = pick_index(&costs, temperature, &mut rand::rng());
            return cands.get(i).map(|c| (*c, terms[i].clone()));
        }
        let seed = self.tie_break_seed();
        if let Some(mut agreed) = self.agreement(at.prompt, at.size) {
            self.prune(at, side, &req, seed, &mut agreed);
            return agreed.into_best();
        }
        let mut least = Least::new(seed);
        self.prune(at, side, &req, seed, &mut least);
        least.best.map(|c| (c, least.terms))
    }

    /// The decode target (`pinned`, else the best, with its cost term by
    /// term) and up to `n - 1` fallbacks: the next best of other addresses,
    /// best first.
    fn choose_with_fallbacks<'s>(
        &self,
        at: &Scoring<'s, '_>,
        pinned: Option<Cand<'s>>,
        n: usize,
    ) -> Option<(Cand<'s>, Option<TermCosts>, Vec<Cand<'s>>)> {
        let mut ranked = self.choose_ranked(at, Side::Decode, n);
        // Without shared state the decode target is the agreed one
        // (`agreement.rs`); the fallbacks stay the next best.
        let agreed = match (pinned, self.agreement(at.prompt, at.size)) {
            (None, Some(_)) => self.choose(at, Side::Decode, &mut Route),
            _ => None,
        };
        let (d, terms) = match (pinned, agreed) {
            (Some(c), _) => (c, None),
            (None, Some((c, terms))) => (c, Some(terms)),
            (None, None) if ranked.is_empty() => return None,
            (None, None) => {
                let (c, terms) = ranked.remove(0);
                (c, Some(terms))
            }
        };
        let fallbacks = ranked
            .into_iter()
            .map(|(c, _)| c)
            .filter(|c| c.ep.endpoint.address != d.ep.endpoint.address)
            .take(n - 1)
            .collect();
        Some((d, terms, fallbacks))
    }

    /// The `n` best candidates of `side` at distinct addresses, best first:
    /// the pruned argmin kept `n` deep, or with a sampling picker, `n` draws
    /// without replacement.
    fn choose_ranked<'s>(
        &self,
        at: &Scoring<'s, '_>,
        side: Side,
        n: usize,
    ) -> Vec<(Cand<'s>, TermCosts)> {
        let req = at.request_cost(self, side);
        if let Choice::Sample { temperature } = at.plugins.choice() {
            let (cands, mut costs, terms) = at.score_all(self, side, &req);
            let mut out = Vec::with_capacity(n);
            let mut rng = rand::rng();
            // A drawn address is out of the next draws (NaN weighs nothing).
            while out.len() < n && costs.iter().any(|c| !c.is_nan()) {
                let i = pick_index(&costs, temperature, &mut rng);
                let chosen = cands[i];
                for (c, cost) in cands.iter().zip(costs.iter_mut()) {
                    if c.ep.endpoint.address == chosen.ep.endpoint.address {
                        *cost = f64::NAN;
                    }
                }
                out.push((chosen, terms[i].clone()));
            }
            return out;
        }
        let seed = self.tie_break_seed();
        let mut ranked = Ranked::new(seed, n);
        self.prune(at, side, &req, seed, &mut ranked);
        ranked.into_vec()
    }

    /// Offers `best` the candidates of `side` that may beat its bar (see
    /// [`Self::choose`]), from a start drawn from `seed`.
    #[inline(always)]
    fn prune<'s, B: Best<Cand<'s>>>(
        &self,
        at: &Scoring<'s, '_>,
        side: Side,
        req: &RequestCost,
        seed: u64,
        best: &mut B,
    ) {
        // Each candidate's terms land here; the best copies a winner's.
        let mut terms = Self::term_buffer(at.plugins);
        let cost = |c: &Cand<'_>, held: &Held, terms: &mut [f64]| {
            self.cost_into(at.plugins, c, at.work(held), req, at.now, terms)
        };
        let floor = |overlap: usize| Self::cost_floor(at.plugins, at.prompt.uncached(overlap), req);
        let (Some(no_overlap), true) = (floor(0), at.pool.direct()) else {
            // No floor (a negative weight), or a holder's key may name several
            // endpoints: score every candidate.
            for c in at.pool.iter(side) {
                let held = at.held(&c);
                let total = cost(&c, &held, &mut terms);
                best.offer(c, total, &terms, held.guessed);
            }
            return;
        };
        let start = seed.rotate_left(32);
        if let Some(o) = at.overlaps {
            let mut levels = o.levels_deepest_first().peekable();
            while let Some(level) = levels.next() {
                let within = floor(level.depth).unwrap_or(no_overlap);
                if level.len() * 4 > at.pool.endpoints() {
                    // A level of a good part of the pool: reading the pool in
                    // order costs less than finding each holder by its key.
                    for c in at.pool.iter_from(side, start) {
                        let held = at.held(&c);
                        let total = cost(&c, &held, &mut terms);
                        best.offer(c, total, &terms, held.guessed);
                        if best.beats(within) {
                            break;
                        }
                    }
                    return;
                }
                let found = level.try_for_each(start, |key| {
                    // A lower tier's holder stands for its worker; the worker
                    // is offered once, where its holder of the whole run is.
                    let c = at.pool.get(tier::device(key), side);
                    if let Some(c) = c {
                        let held = o.get(&c);
                        if held.tiers.deepest() == tier::tier_of(key) {
                            let total = cost(&c, &held, &mut terms);
                            best.offer(c, total, &terms, held.guessed);
                        }
                    }
                    match best.beats(within) {
                        true => ControlFlow::Break(()),
                        false => ControlFlow::Continue(()),
                    }
                });
                let below = levels.peek().map_or(0, |l| l.depth);
                if found.is_break() || best.beats(floor(below).unwrap_or(no_overlap)) {
                    return;
                }
            }
        }
        if best.beats(no_overlap) {
            return;
        }
        // A holder met here costs at most this (its overlap counted as none),
        // and was offered at its own cost above.
        for c in at.pool.iter_from(side, start) {
            let total = cost(&c, &Held::default(), &mut terms);
            best.offer(c, total, &terms, false);
            if best.beats(no_overlap) {
                break;
            }
        }
    }

    /// The target now holds the prompt's blocks (approximate entries, or
    /// provisional ones on a precise worker); it carries the request's load (and
    /// its uncached part) until it finishes. Whether the blocks are a guess,
    /// and the key peers record them at ([`Scheduler::record_prompt`]).
    fn record(
        &self,
        c: &Cand<'_>,
        prompt: &hash::PromptBlocks,
        load: ActiveLoad,
        now: Instant,
    ) -> (bool, Option<u64>) {
        let mut recorded = (false, None);
        let hashes = &prompt.hashes;
        if !hashes.is_empty() {
            if let Some(s) = c.ep.scraped(now, self.config.scrape_max_age) {
                if let Some(n) = s.num_blocks {
                    // Engine blocks of `block_size` tokens → blocks of this
                    // prompt's kind (token ids or text): the bound follows the
                    // kind of the prompt recorded last.
                    let tokens = n.saturating_mul(u64::from(s.block_size.unwrap_or(16)));
                    let per_block = prompt.tokens_per_block.max(1) as u64;
                    self.index
                        .set_capacity(c.key, (tokens / per_block) as usize, now);
                    self.index.set_engine_blocks(c.key, n);
                }
            }
            recorded = self.record_prompt(c.key, hashes, now);
        }
        c.ep.book(c.rank, load);
        recorded
    }
}

/// What scoring one pick reads: its plugin list, its pool, the prompt's
/// overlaps and size, the pick's instant (coded by [`Epoch::process`]).
pub(super) struct Scoring<'s, 'p> {
    /// The plugin list the pick loaded.
    pub(super) plugins: &'p Plugins,
    pub(super) pool: &'p Pool<'s, 'p>,
    overlaps: Option<&'p PromptOverlaps>,
    prompt: &'p hash::PromptBlocks,
    size: u64,
    /// The request's `model` as an adapter id.
    adapter: Option<u64>,
    /// What the predicted term reads.
    latency: LatencyAsk,
    /// What loads from lower storage tiers cost.
    tier_costs: TierCosts,
    now: i64,
}

impl<'s> Scoring<'s, '_> {
    /// The pick's instant, coded by [`Epoch::process`].
    pub(super) fn now(&self) -> i64 {
        self.now
    }

    /// Leading prompt blocks `c` holds, by tier, and whether that many is
    /// only a guess (provisional entries its KV events have not confirmed).
    pub(super) fn held(&self, c: &Cand<'_>) -> Held {
        self.overlaps.map_or(Held::default(), |o| o.get(c))
    }

    /// What a candidate holding `held` must do before its first token.
    pub(super) fn work(&self, held: &Held) -> Work {
        self.tier_costs.work(self.prompt, held.tiers)
    }

    /// What the terms of `s` read about this request on `side`.
    fn request_cost(&self, s: &Scheduler, side: Side) -> RequestCost {
        RequestCost {
            latency: self.latency,
            ..s.request_cost(side, self.size, self.adapter, self.pool.idle_ranks(side))
        }
    }

    /// Every candidate of `side` with what `s` charges for sending `req`
    /// there (its overlap counted), in total and term by term.
    #[allow(clippy::type_complexity)]
    fn score_all(
        &self,
        s: &Scheduler,
        side: Side,
        req: &RequestCost,
    ) -> (Vec<Cand<'s>>, Vec<f64>, Vec<TermCosts>) {
        let cands: Vec<Cand<'s>> = self.pool.iter(side).collect();
        let mut terms = Vec::with_capacity(cands.len());
        let costs = cands
            .iter()
            .map(|c| {
                let mut t = Scheduler::term_buffer(self.plugins);
                let work = self.work(&self.held(c));
                let total = s.cost_into(self.plugins, c, work, req, self.now, &mut t);
                terms.push(t);
                total
            })
            .collect();
        (cands, costs, terms)
    }
}

/// What a pick reports as it goes.
pub(super) trait Observer {
    /// Whether the pick only explains: every candidate scored (no pruning, no
    /// sampling, the first least cost taken), sessions read without being
    /// pinned, nothing booked, counted or timed.
    const EXPLAINS: bool;

    /// An explaining pick scored `c`, holding `overlap` leading blocks, with
    /// its predicted latency when latency is learned and warm.
    fn scored(
        &mut self,
        _c: &Cand<'_>,
        _overlap: usize,
        _terms: CostTerms,
        _prediction: Option<Prediction>,
    ) {
    }

    /// An explaining pick chose `decode` (and `prefill`); `pinned` says which
    /// of the two the session pinned.
    fn chosen(
        &mut self,
        _at: &Scoring<'_, '_>,
        _decode: &Cand<'_>,
        _prefill: Option<&Cand<'_>>,
        _pinned: (bool, bool),
    ) {
    }

    /// A routing pick's chosen decode rank's cost, term by term in the
    /// summing order of `_plugins`' scorers, before its booking.
    fn decode_terms(&mut self, _plugins: &Plugins, _terms: &[f64]) {}
}

/// A routing pick: observes nothing.
pub(super) struct Route;

impl Observer for Route {
    const EXPLAINS: bool = false;
}

/// A routing pick that keeps the chosen decode rank's cost terms.
#[derive(Default)]
struct RouteWithTerms {
    terms: CostTerms,
}

impl Observer for RouteWithTerms {
    const EXPLAINS: bool = false;

    fn decode_terms(&mut self, plugins: &Plugins, terms: &[f64]) {
        self.terms = Scheduler::named_terms(plugins, terms);
    }
}
