//! The pick: candidates → session pin → hash → lookup → score → book.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rand::Rng;

use super::cost::Cand;
use super::{Decision, FilteredOut, PickError, PickRequest, Scheduler, Stage};
use crate::endpoints::{ActiveLoad, EndpointState, Engine, Snapshot, WorkerKey};
use crate::kv::hash;
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
        if snapshot.endpoints.is_empty() {
            return Err(PickError::NoEndpoints);
        }
        // Coded once: every per-endpoint time check below compares integers.
        let tick = Epoch::process().encode(now);
        let (decode, prefill) = self.candidates(req, snapshot, tick)?;
        let (decode, prefill) = (decode.as_slice(), prefill.as_slice());
        if decode.is_empty() {
            return Err(PickError::NoDecodeEndpoint);
        }

        let (session, pinned, pinned_prefill) = {
            let _t = self.stats.time(Stage::Session);
            let mut session = SessionTurn::of(req.body, req.session_id);
            // A worker the subset hint leaves out is still the session's: the
            // turn goes within the subset but neither moves nor re-binds the
            // session (a caller cannot re-home someone's session by naming a
            // worker of its choice).
            let outside_subset = |k: WorkerKey| {
                req.subset.is_some()
                    && snapshot.endpoints.iter().any(|e| {
                        e.serves_decode()
                            && e.endpoint.instance_id == k.instance_id
                            && k.dp_rank < e.ranks()
                            && e.health().available_at(tick)
                    })
            };
            let pins = match session.as_mut() {
                Some(turn) => self.pinned(
                    turn,
                    req.session_token,
                    decode,
                    prefill,
                    outside_subset,
                    now,
                ),
                None => Some((None, None)),
            };
            match pins {
                Some((pinned, pinned_prefill)) => (session, pinned, pinned_prefill),
                None => (None, None, None),
            }
        };

        let (prompt, load_blocks) = {
            let _t = self.stats.time(Stage::Hash);
            self.prompt_and_size(req.body)
        };
        let hashes = &prompt.hashes;
        // Per-request cap on booked load: the prompt first, expected output in
        // what is left.
        let cap = self.config.max_request_load_blocks;
        let load_blocks = load_blocks.min(cap);

        let overlaps = {
            let _t = self.stats.time(Stage::Lookup);
            self.overlaps(hashes, now)
        };
        let overlap_of = |c: &Cand<'_>| overlaps.as_ref().map_or(0, |o| o.get(c));

        let (di, overlap, pi) = {
            let _t = self.stats.time(Stage::Score);
            let w = self.config.weights;
            let di = match pinned {
                Some(i) => i,
                None => self.choose(decode, &overlap_of, &prompt, load_blocks, w.prefill, tick),
            };
            let pi = (!prefill.is_empty()).then(|| {
                pinned_prefill.unwrap_or_else(|| {
                    self.choose(
                        prefill,
                        &overlap_of,
                        &prompt,
                        load_blocks,
                        w.prefill_overlap,
                        tick,
                    )
                })
            });
            (di, overlap_of(&decode[di]), pi)
        };

        self.stats
            .blocks_queried
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        self.stats
            .blocks_matched
            .fetch_add(overlap as u64, Ordering::Relaxed);
        let decode_blocks = req
            .body
            .map_or(0, |b| self.expected_decode_blocks(b))
            .min(cap - load_blocks);
        let uncached_blocks = (prompt.uncached(overlap) as u64).min(load_blocks);
        let prefill_target = pi.map(|i| prefill[i].target());
        let bootstrap_port = prefill_target.as_ref().and_then(|p| {
            let ep = &p.endpoint.endpoint;
            ep.bootstrap_port.or_else(|| {
                (ep.engine == Engine::Sglang)
                    .then_some(self.config.sglang_bootstrap_port)
                    .flatten()
            })
        });
        let bootstrap_room = bootstrap_port.map(|_| rand::rng().random::<u64>() >> 1);
        let decision = Decision {
            decode: decode[di].target(),
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
        };
        // Booked from the decision, so `cancel`/`finish` release exactly this.
        self.record(&decode[di], hashes, decision.decode_load(), now);
        if let Some(pi) = pi {
            self.record(&prefill[pi], hashes, decision.prefill_load(), now);
        }
        Ok(decision)
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
                .saturating_add(b.omitted_tokens.div_ceil(self.config.token_block.max(1)) as u64),
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
    /// is live but outside the candidates (`outside`): the request goes without
    /// its session.
    fn pinned(
        &self,
        turn: &mut SessionTurn,
        token: Option<&str>,
        decode: &[Cand<'_>],
        prefill: &[Cand<'_>],
        outside: impl Fn(WorkerKey) -> bool,
        now: Instant,
    ) -> Option<(Option<usize>, Option<usize>)> {
        let ready = |k: WorkerKey| decode.iter().any(|c| c.key == k) || outside(k);
        match self.sessions.pin(turn, token, ready, now) {
            Pin::Ready {
                decode: d,
                prefill: p,
            } => {
                let d = decode.iter().position(|c| c.key == d)?;
                Some((
                    Some(d),
                    p.and_then(|p| prefill.iter().position(|c| c.key == p)),
                ))
            }
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

    /// One candidate per (endpoint, rank) the request may go to, decode and
    /// prefill ones apart (the roles are disjoint; prefill workers only matter
    /// for a body): in the subset hint if any; passively ejected endpoints sit
    /// out unless every one is ejected (then all are tried rather than none).
    /// One pass over the endpoints (a second only when every one is ejected),
    /// each endpoint's health read once, at `now` coded by [`Epoch::process`].
    fn candidates<'s>(
        &self,
        req: &PickRequest<'_>,
        snapshot: &'s Snapshot,
        now: i64,
    ) -> Result<(Vec<Cand<'s>>, Vec<Cand<'s>>), PickError> {
        let mut decode = Vec::with_capacity(snapshot.endpoints.len());
        let mut prefill = Vec::new();
        let (mut any, mut any_ejected) = (false, false);
        let subset = parsed_subset(req.subset);
        let subset = subset.as_deref();
        for ep in &snapshot.endpoints {
            match excluded(req, subset, ep) {
                Some(FilteredOut::NotInSubset) => continue,
                Some(_) => {
                    any = true;
                    continue;
                }
                None => any = true,
            }
            if !ep.health().available_at(now) {
                any_ejected = true;
                continue;
            }
            push_ranks(&mut decode, &mut prefill, ep);
        }
        if !any && req.subset.is_some() {
            return Err(PickError::SubsetEmpty);
        }
        if any_ejected && decode.is_empty() && prefill.is_empty() {
            // Every eligible endpoint is ejected: try them all rather than none.
            for ep in &snapshot.endpoints {
                if excluded(req, subset, ep).is_none() {
                    push_ranks(&mut decode, &mut prefill, ep);
                }
            }
        }
        Ok((decode, prefill))
    }

    /// The target now holds the prompt's blocks (approximate entries, or
    /// provisional ones on a precise worker); it carries the request's load (and
    /// its uncached part) until it finishes.
    fn record(&self, c: &Cand<'_>, hashes: &[u64], load: ActiveLoad, now: Instant) {
        if !hashes.is_empty() {
            if let Some(s) = c.ep.scraped(now, self.config.scrape_max_age) {
                if let Some(n) = s.num_blocks {
                    // Engine blocks of `block_size` tokens → kvpick blocks (~4 bytes a token).
                    let tokens = n.saturating_mul(u64::from(s.block_size.unwrap_or(16)));
                    let per_block = (self.config.byte_block / 4).max(1) as u64;
                    self.index
                        .set_capacity(c.key, (tokens / per_block) as usize);
                    self.index.set_engine_blocks(c.key, n);
                }
            }
            self.record_prompt(c.key, hashes, now);
        }
        c.ep.book(c.rank, load);
    }
}

/// Adds one candidate per rank of `ep` to the list of its role.
fn push_ranks<'s>(
    decode: &mut Vec<Cand<'s>>,
    prefill: &mut Vec<Cand<'s>>,
    ep: &'s Arc<EndpointState>,
) {
    let to = match ep.serves_decode() {
        true => decode,
        false => prefill,
    };
    for rank in 0..ep.ranks() {
        to.push(Cand {
            ep,
            rank,
            key: ep.key(rank),
        });
    }
}

/// The subset hint's addresses, parsed and sorted once per pick (an entry that
/// is no socket address matches no endpoint).
pub(super) fn parsed_subset(subset: Option<&[String]>) -> Option<Vec<SocketAddr>> {
    subset.map(|s| {
        let mut addrs: Vec<SocketAddr> = s.iter().filter_map(|a| a.parse().ok()).collect();
        addrs.sort_unstable();
        addrs
    })
}

/// Why `ep` can take no part in `req` whatever its health: outside the subset
/// hint (`subset`, from [`parsed_subset`]), or prefill-only with no body.
pub(super) fn excluded(
    req: &PickRequest<'_>,
    subset: Option<&[SocketAddr]>,
    ep: &EndpointState,
) -> Option<FilteredOut> {
    if subset.is_some_and(|s| s.binary_search(&ep.endpoint.address).is_err()) {
        Some(FilteredOut::NotInSubset)
    } else if !ep.serves_decode() && req.body.is_none() {
        Some(FilteredOut::NoBody)
    } else {
        None
    }
}
