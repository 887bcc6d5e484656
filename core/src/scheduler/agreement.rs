//! Agreement without shared state: while replica sync is unavailable (or
//! before any state is shared), replicas break near-ties alike.
//!
//! Replicas that share no state disagree on a conversation's worker: each
//! knows only the prompts it routed itself, so the next turn, sent to another
//! replica, finds no holder there and goes wherever that replica's random
//! tie-break lands. In this mode the argmin instead takes, among the
//! candidates whose cost is within [`AGREEMENT_MARGIN`] of the request's size
//! of the least cost, the one of highest rendezvous (highest-random-weight)
//! weight on the prompt's key: the hash of its first [`AGREEMENT_BLOCKS`]
//! blocks (chained from the model and tenant salt, so tenants draw apart).
//! Every replica computes the same weights from what they all see, the
//! prompt and the workers' instance ids, so a conversation's turns meet on
//! one worker whichever replica routes them.
//!
//! Invariants:
//! - the winner is a function of the offered candidates' costs, keys and the
//!   prompt's key only: neither the order of the offers nor a random draw
//!   changes it;
//! - load still decides beyond the margin: a worker whose load terms put it
//!   further than the margin above the least cost never wins, so the
//!   hash spreads conversations over the workers and a loaded one is avoided;
//! - the pruned argmin stays valid: it prunes on the lower bound only, and no
//!   candidate whose floor is above the least cost plus the margin can win
//!   ([`Agreed::beats`]). Candidates within the margin are all read, so in
//!   this mode a pick reads every near-best candidate of the pool.
//!
//! The replica-sync glue says when shared state is available
//! ([`Scheduler::set_shared_state`]); a scheduler never told otherwise (a
//! single replica, a replay) breaks ties at random as before.

use std::sync::atomic::Ordering;

use super::candidates::Cand;
use super::cost::{Best, TermCosts};
use super::Scheduler;
use crate::keys::WorkerKey;
use crate::kv::hash::PromptBlocks;

/// Leading prompt blocks whose hash keys the rendezvous weights: a
/// conversation's turns share them (each turn extends the last), distinct
/// conversations seldom do. A prompt shorter than this is keyed by all of it,
/// so a first turn under this many blocks (256 bytes of text, 64 tokens) may
/// meet its next turn elsewhere; conversations that share this much (one
/// long system prompt) share a key, and their load spreads them beyond the
/// margin.
pub const AGREEMENT_BLOCKS: usize = 4;

/// How far above the least cost, as a fraction of the request's size in
/// blocks, a candidate still counts as near-best. At the default weights a
/// fresh worker's load reaches it with about fifteen more prefills of the
/// same size pending than the least loaded one's (0.05 a block,
/// `docs/scheduling.md`), three more of them queued (0.25 a block), or a KV
/// cache three quarters fuller. A known holder of more than this share of the
/// prompt wins outright.
pub const AGREEMENT_MARGIN: f64 = 0.75;

impl Scheduler {
    /// Whether routing state is shared with peer replicas right now. The
    /// replica-sync glue clears it at start, sets it once the shared state is
    /// loaded and followed, and clears it again while the sync server is
    /// unreachable; while it is clear, near-ties are broken by rendezvous
    /// hashing (see the module doc). Set by default.
    pub fn set_shared_state(&self, shared: bool) {
        self.shared_state.store(shared, Ordering::Relaxed);
    }

    /// See [`Scheduler::set_shared_state`].
    pub fn shared_state(&self) -> bool {
        self.shared_state.load(Ordering::Relaxed)
    }

    /// The near-tie chooser of a pick of `prompt` of `size` blocks while no
    /// state is shared; `None` when state is shared, the prompt has no blocks
    /// to key it, or costs are predicted seconds (`--scoring predicted`), where
    /// a margin counted in blocks means nothing.
    pub(super) fn agreement<'a>(&self, prompt: &PromptBlocks, size: u64) -> Option<Agreed<'a>> {
        if self.shared_state() || self.latency().is_some() {
            return None;
        }
        let key = prompt_key(&prompt.hashes)?;
        Some(Agreed::new(key, AGREEMENT_MARGIN * size.max(1) as f64))
    }
}

/// The rendezvous key of a prompt of chained block `hashes`: the hash of its first
/// [`AGREEMENT_BLOCKS`] blocks (of all of them when shorter).
pub(super) fn prompt_key(hashes: &[u64]) -> Option<u64> {
    let n = hashes.len().min(AGREEMENT_BLOCKS);
    n.checked_sub(1).map(|i| hashes[i])
}

/// The rendezvous weight of `worker` for a prompt keyed `key`
/// (SplitMix64's finaliser over both): the same on every replica.
pub(super) fn weight(key: u64, worker: WorkerKey) -> u64 {
    let mut z = key
        ^ worker.instance_id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(worker.dp_rank).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One offer within the margin of the least cost so far.
struct Near<'a> {
    cand: Cand<'a>,
    cost: f64,
    weight: u64,
    terms: TermCosts,
}

/// The argmin's choice while no state is shared: of the offers within
/// `margin` of the least cost, the one of highest rendezvous weight (ties of
/// weight, which two distinct workers hardly ever have, by the lower key).
/// NaN never counts.
pub(super) struct Agreed<'a> {
    key: u64,
    margin: f64,
    least: f64,
    /// The offers within `margin` of `least`, in offer order.
    near: Vec<Near<'a>>,
}

impl<'a> Agreed<'a> {
    /// Nothing offered yet, for a prompt keyed `key`.
    pub(super) fn new(key: u64, margin: f64) -> Self {
        Agreed {
            key,
            margin: margin.max(0.0),
            least: f64::INFINITY,
            near: Vec::new(),
        }
    }

    /// The winner with its cost term by term; `None` when nothing counted.
    pub(super) fn into_best(self) -> Option<(Cand<'a>, TermCosts)> {
        self.near
            .into_iter()
            .max_by_key(|n| (n.weight, std::cmp::Reverse(n.cand.key)))
            .map(|n| (n.cand, n.terms))
    }
}

impl<'a> Best<Cand<'a>> for Agreed<'a> {
    fn offer(&mut self, item: Cand<'a>, cost: f64, terms: &[f64], _guessed: bool) {
        if cost.is_nan() || cost > self.least + self.margin {
            return;
        }
        if cost < self.least {
            self.least = cost;
            let bar = cost + self.margin;
            self.near.retain(|n| n.cost <= bar);
        }
        self.near.push(Near {
            cand: item,
            cost,
            weight: weight(self.key, item.key),
            terms: TermCosts::from_slice(terms),
        });
    }

    /// No candidate costing at least `floor` can enter the margin.
    fn beats(&self, floor: f64) -> bool {
        self.least + self.margin < floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_depends_on_prompt_and_worker_only() {
        let w = WorkerKey {
            instance_id: 7,
            dp_rank: 0,
        };
        let r1 = WorkerKey { dp_rank: 1, ..w };
        assert_eq!(weight(1, w), weight(1, w));
        assert_ne!(weight(1, w), weight(2, w));
        assert_ne!(weight(1, w), weight(1, r1));
    }

    #[test]
    fn a_short_prompt_is_keyed_by_all_of_it_a_long_one_by_its_first_blocks() {
        let p = |n: usize| (1..=n as u64).collect::<Vec<_>>();
        assert_eq!(prompt_key(&p(0)), None);
        assert_eq!(prompt_key(&p(3)), Some(3));
        assert_eq!(
            prompt_key(&p(AGREEMENT_BLOCKS + 9)),
            Some(AGREEMENT_BLOCKS as u64)
        );
    }
}
