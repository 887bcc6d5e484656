//! Explaining a pick without making it: every (endpoint, rank) of the snapshot
//! with why it sits out (the reason of the filter that drops it) or what it
//! would cost, term by term, and the candidate the pick would take.
//!
//! It is the pick itself ([`Scheduler::run`]) with a recording observer: the
//! same pool, filters, session binding, prompt, overlaps and terms. Nothing is
//! booked, indexed, bound or counted: the load, the prefix index and the
//! session table are only read. The choice shown is the least cost (the first
//! of equal ones) or the live session binding; a routing pick breaks exact
//! ties at random and, with a sampling picker, samples, so it may take another
//! candidate of equal or near cost.

use std::collections::HashMap;
use std::time::Instant;

use super::candidates::Cand;
use super::pick::{Observer, Scoring};
use super::terms::{CostTerms, LoadSource};
use super::{PickError, PickRequest, Scheduler};
use crate::endpoints::{Snapshot, WorkerKey};
use crate::engine_latency::EngineLatency;
use crate::latency::Prediction;

/// One (endpoint, rank) as the pick sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateScore {
    /// The worker rank.
    pub key: WorkerKey,
    /// `ip:port`.
    pub address: String,
    /// Whether it is a prefill (not a decode) candidate.
    pub prefill: bool,
    /// Why it sits out, if it does (the dropping filter's reason; then it has
    /// no terms).
    pub filtered_out: Option<&'static str>,
    /// Prompt blocks it holds (leading).
    pub overlap_blocks: usize,
    /// Whether that overlap is only a guess: prompts routed to this precise
    /// worker that its KV events have not confirmed (yet).
    pub overlap_guessed: bool,
    /// What its load terms come from.
    pub load_source: LoadSource,
    /// The cost, term by term.
    pub terms: CostTerms,
    /// Its predicted latency there (with the worker's recent prediction
    /// error), when latency is learned and warm.
    pub prediction: Option<Prediction>,
    /// The engine's own recent latency from its histograms, when scraped
    /// (beside the prediction: [`CandidateScore::ttft_gap`]).
    pub engine: Option<EngineLatency>,
    /// The session is bound to it.
    pub session_pinned: bool,
    /// The pick would take it (one decode, at most one prefill).
    pub chosen: bool,
}

impl CandidateScore {
    /// Predicted TTFT minus the engine's recent mean TTFT, in seconds, when
    /// both are known: what the gateway sees beyond the engine's own time
    /// (the hops, the response's first chunk) plus the model's error.
    pub fn ttft_gap(&self) -> Option<f64> {
        Some(self.prediction?.ttft - self.engine?.ttft?)
    }
}

/// A pick, explained.
#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    /// Prompt hash blocks.
    pub prompt_blocks: usize,
    /// Load the request would book (blocks, capped per request).
    pub load_blocks: u64,
    /// The session id the request names, if any.
    pub session_id: Option<String>,
    /// Every candidate, decode ones first.
    pub candidates: Vec<CandidateScore>,
}

/// Records what an explaining pick scored and chose.
struct Recorder {
    /// Scraped figures older than this do not count ([`super::SchedulerConfig::scrape_max_age`]).
    scrape_max_age: std::time::Duration,
    /// Terms of each scored (endpoint, rank), by the endpoint's address in
    /// memory and the rank.
    scored: HashMap<(usize, u32), (CostTerms, Option<Prediction>)>,
    /// Every (endpoint, rank) of the snapshot, decode ones first.
    candidates: Vec<CandidateScore>,
}

impl Observer for Recorder {
    const EXPLAINS: bool = true;

    fn scored(
        &mut self,
        c: &Cand<'_>,
        _overlap: usize,
        terms: CostTerms,
        prediction: Option<Prediction>,
    ) {
        self.scored.insert(slot(c), (terms, prediction));
    }

    fn chosen(
        &mut self,
        at: &Scoring<'_, '_>,
        decode: &Cand<'_>,
        prefill: Option<&Cand<'_>>,
        pinned: (bool, bool),
    ) {
        let pool = at.pool;
        for ep in &pool.snapshot().endpoints {
            let filtered_out = pool.filtered_out(ep);
            let address = ep.endpoint.address_string();
            for rank in 0..ep.ranks() {
                let c = Cand {
                    ep,
                    rank,
                    key: ep.key(rank),
                };
                let is = |other: Option<&Cand<'_>>| other.is_some_and(|o| slot(o) == slot(&c));
                let (chosen, session_pinned) = match ep.serves_decode() {
                    true => (is(Some(decode)), pinned.0 && is(Some(decode))),
                    false => (is(prefill), pinned.1 && is(prefill)),
                };
                let (overlap_blocks, overlap_guessed) = at.held(&c);
                let (terms, prediction) = self.scored.remove(&slot(&c)).unwrap_or_default();
                self.candidates.push(CandidateScore {
                    key: c.key,
                    address: address.clone(),
                    prefill: !ep.serves_decode(),
                    filtered_out,
                    overlap_blocks,
                    overlap_guessed,
                    load_source: LoadSource::of(&ep.load_view_at(at.now(), self.scrape_max_age)),
                    terms,
                    prediction,
                    engine: ep.engine_latency(),
                    session_pinned,
                    chosen,
                });
            }
        }
        self.candidates.sort_by_key(|c| c.prefill);
    }
}

/// A candidate's place: its endpoint's address in memory and its rank.
fn slot(c: &Cand<'_>) -> (usize, u32) {
    (std::sync::Arc::as_ptr(c.ep) as usize, c.rank)
}

impl Scheduler {
    /// What [`Scheduler::pick`] would decide for `req` now, and why, without
    /// booking anything.
    pub fn explain(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
    ) -> Result<Explanation, PickError> {
        let mut recorder = Recorder {
            scrape_max_age: self.config.scrape_max_age,
            scored: HashMap::new(),
            candidates: Vec::new(),
        };
        let decision = self.run(req, snapshot, now, &mut recorder)?;
        Ok(Explanation {
            prompt_blocks: decision.prompt_blocks,
            load_blocks: decision.load_blocks,
            session_id: decision.session.map(|t| t.id),
            candidates: recorder.candidates,
        })
    }
}
