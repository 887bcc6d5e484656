//! Explaining a pick without making it: every (endpoint, rank) of the snapshot
//! with why it sits out or what it would cost, term by term, and the candidate
//! the pick would take. Nothing is booked, indexed or bound: the load, the
//! prefix index and the session table are only read.
//!
//! The choice shown is the least cost (the first of equal ones) or the live
//! session binding; the real pick breaks exact ties at random and, with a
//! temperature, samples, so it may take another candidate of equal or near cost.

use std::time::Instant;

use super::candidates::{excluded, parsed_subset};
use super::cost::{Cand, CostTerms};
use super::{PickError, PickRequest, Scheduler};
use crate::endpoints::{Snapshot, WorkerKey};
use crate::time::Epoch;

/// Why a candidate is not considered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilteredOut {
    /// The gateway's subset hint leaves it out.
    NotInSubset,
    /// Passively ejected after failed responses (others are available).
    Ejected,
    /// A prefill-only worker, and the request has no body to prefill.
    NoBody,
}

impl FilteredOut {
    /// Label.
    pub fn as_str(self) -> &'static str {
        match self {
            FilteredOut::NotInSubset => "not_in_subset",
            FilteredOut::Ejected => "ejected",
            FilteredOut::NoBody => "prefill_without_body",
        }
    }
}

/// One (endpoint, rank) as the pick sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateScore {
    /// The worker rank.
    pub key: WorkerKey,
    /// `ip:port`.
    pub address: String,
    /// Whether it is a prefill (not a decode) candidate.
    pub prefill: bool,
    /// Why it sits out, if it does (then the scores are zero).
    pub filtered_out: Option<FilteredOut>,
    /// Prompt blocks it holds (leading).
    pub overlap_blocks: usize,
    /// The cost, term by term.
    pub terms: CostTerms,
    /// The session is bound to it.
    pub session_pinned: bool,
    /// The pick would take it (one decode, at most one prefill).
    pub chosen: bool,
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

impl Scheduler {
    /// What [`Scheduler::pick`] would decide for `req` now, and why, without
    /// booking anything.
    pub fn explain(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
    ) -> Result<Explanation, PickError> {
        if snapshot.endpoints.is_empty() {
            return Err(PickError::NoEndpoints);
        }
        let tick = Epoch::process().encode(now);
        let mut all = Vec::new();
        let mut any_available = false;
        let subset = parsed_subset(req.subset);
        for ep in &snapshot.endpoints {
            let address = ep.endpoint.address_string();
            let filtered = excluded(req, subset.as_deref(), ep);
            let available = ep.health().available_at(tick);
            // As the pick: only endpoints that could take the request decide
            // whether ejected ones sit out.
            any_available |= available && filtered.is_none();
            for rank in 0..ep.ranks() {
                let cand = Cand {
                    ep,
                    rank,
                    key: ep.key(rank),
                };
                all.push((cand, address.clone(), filtered, available));
            }
        }
        for (_, _, filtered, available) in &mut all {
            if filtered.is_none() && any_available && !*available {
                *filtered = Some(FilteredOut::Ejected);
            }
        }
        if req.subset.is_some()
            && all
                .iter()
                .all(|(_, _, f, _)| *f == Some(FilteredOut::NotInSubset))
        {
            return Err(PickError::SubsetEmpty);
        }

        let (prompt, load_blocks) = self.prompt_and_size(req.body);
        let load_blocks = load_blocks.min(self.config.max_request_load_blocks);
        let overlaps = self.overlaps(&prompt.hashes, now);
        let session = crate::sessions::SessionTurn::of(req.body, req.session_id);
        let bound = session.as_ref().and_then(|t| {
            let b = self.sessions.binding(&t.id)?;
            (b.expires > now).then_some(b)
        });

        let w = self.config.weights;
        // Each side's wait read once, as a pick reads it once per side.
        let decode_wait = self.pending_wait(snapshot.idle_ranks(true));
        let prefill_wait = self.pending_wait(snapshot.idle_ranks(false));
        let mut candidates: Vec<CandidateScore> = all
            .iter()
            .map(|(c, address, filtered, _)| {
                let prefill = !c.ep.serves_decode();
                let overlap = overlaps.as_ref().map_or(0, |o| o.get(c));
                let (weight, wait) = if prefill {
                    (w.prefill_overlap, prefill_wait)
                } else {
                    (w.prefill, decode_wait)
                };
                let terms = match filtered {
                    Some(_) => CostTerms::default(),
                    None => {
                        let new_blocks = prompt.uncached(overlap);
                        self.cost_terms(c, new_blocks, load_blocks, weight, wait, tick)
                    }
                };
                let pinned = bound.is_some_and(|b| {
                    if prefill {
                        b.prefill == Some(c.key)
                    } else {
                        b.worker == c.key
                    }
                });
                CandidateScore {
                    key: c.key,
                    address: address.clone(),
                    prefill,
                    filtered_out: *filtered,
                    overlap_blocks: overlap,
                    terms,
                    session_pinned: pinned && filtered.is_none(),
                    chosen: false,
                }
            })
            .collect();
        candidates.sort_by_key(|c| c.prefill);
        for prefill in [false, true] {
            let open = || {
                candidates
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.prefill == prefill && c.filtered_out.is_none())
            };
            let chosen = open()
                .find(|(_, c)| c.session_pinned)
                .or_else(|| open().min_by(|a, b| a.1.terms.total().total_cmp(&b.1.terms.total())))
                .map(|(i, _)| i);
            match chosen {
                Some(i) => candidates[i].chosen = true,
                None if !prefill => return Err(PickError::NoDecodeEndpoint),
                None => {}
            }
        }
        Ok(Explanation {
            prompt_blocks: prompt.hashes.len(),
            load_blocks,
            session_id: session.map(|t| t.id),
            candidates,
        })
    }
}
