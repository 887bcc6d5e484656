//! What each candidate holds of a prompt: the prefix index's answer and, for
//! precise workers, the prompts routed there whose KV events have not arrived.
//!
//! A precise worker's index entries come only from its KV events, which it
//! publishes once a prefill completes: a burst of requests sharing a prefix
//! would otherwise see no worker holding it until the first one's prefill ends,
//! and scatter. So a prompt routed to a precise worker is recorded as a guess
//! (provisional entries, `provisional.rs`); a candidate's overlap is the
//! larger of the two answers, and it is a guess when the guess is the larger.
//! Blocks it holds on lower storage tiers extend its overlap, each counted on
//! the best tier it is on (`kv::tier`).
//! A guess ends when the worker's KV events speak of its block (stored: the
//! precise index holds it now; removed or cleared: the worker does not), when
//! they have not confirmed it shortly after the request's response began, or
//! at its TTL, which the requests it attracts do not renew.

use std::iter::Peekable;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::candidates::Cand;
use super::{Decision, Scheduler};
use crate::endpoints::WorkerKey;
use crate::kv::index::Overlaps;
use crate::kv::tier::{self, Tier, TierBlocks};

/// How far past this replica's clock a peer's LRU key may rank (clock skew
/// beyond it, or a corrupt key, is cut to it).
pub(super) const PEER_KEY_AHEAD: Duration = Duration::from_secs(60);

/// Every worker's overlap with one prompt.
pub(super) struct PromptOverlaps {
    index: Overlaps,
    /// Provisional entries (`None` while there are none).
    provisional: Option<Overlaps>,
}

/// What a candidate holds of a prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Held {
    /// Its leading blocks, by the best tier each is on.
    pub(super) tiers: TierBlocks,
    /// Whether that many is only a guess (more than its events confirm).
    pub(super) guessed: bool,
}

impl Held {
    /// Its leading blocks, whatever their tier.
    pub(super) fn blocks(&self) -> usize {
        self.tiers.total()
    }
}

impl PromptOverlaps {
    /// Leading prompt blocks candidate `c` holds or is provisionally credited
    /// with (the index found through the slot hint `c`'s endpoint keeps), by
    /// tier: a guess counts as on the GPU, where the routed prompt is
    /// prefilled.
    pub(super) fn get(&self, c: &Cand<'_>) -> Held {
        let held = match c.ep.index_slot(c.rank) {
            Some(hint) => self.index.get_hinted(c.key, hint),
            None => self.index.get(c.key),
        };
        let (gpu, guess) = match self.provisional.as_ref().map(|p| p.get(c.key)) {
            Some(guess) if guess > held => (guess, true),
            _ => (held, false),
        };
        let (cpu, disk) = match self.index.tiered() {
            true => (
                self.index.get(tier::holder(c.key, Tier::Cpu)),
                self.index.get(tier::holder(c.key, Tier::Disk)),
            ),
            false => (0, 0),
        };
        Held {
            tiers: TierBlocks::of_depths(gpu, cpu, disk),
            guessed: guess && gpu > cpu.max(disk),
        }
    }

    /// The holder levels of both answers, deepest first: a worker's overlap is
    /// at most the depth of the first level one of its holders (its own key,
    /// or a lower tier's, `kv::tier::holder`) is found in, and a worker none
    /// of whose holders is found holds nothing of the prompt.
    pub(super) fn levels_deepest_first(&self) -> impl Iterator<Item = HolderLevel<'_>> {
        let (mut a, mut b): (Peekable<_>, Peekable<_>) = (
            deepest_first(&self.index).peekable(),
            self.provisional.iter().flat_map(deepest_first).peekable(),
        );
        std::iter::from_fn(move || match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if y.depth > x.depth => b.next(),
            (Some(_), _) => a.next(),
            (None, _) => b.next(),
        })
    }
}

/// The holder levels of one answer, deepest first.
fn deepest_first(of: &Overlaps) -> impl Iterator<Item = HolderLevel<'_>> {
    (0..of.levels()).rev().map(move |k| HolderLevel {
        of,
        k,
        depth: of.level_depth(k),
    })
}

/// One holder level of one answer (see [`PromptOverlaps::levels_deepest_first`]).
pub(super) struct HolderLevel<'a> {
    of: &'a Overlaps,
    k: usize,
    /// The most leading blocks its workers hold.
    pub(super) depth: usize,
}

impl HolderLevel<'_> {
    /// How many workers it holds (deeper levels' included).
    pub(super) fn len(&self) -> usize {
        self.of.level_len(self.k)
    }

    /// Calls `f` with the level's workers that are in no deeper level of the
    /// same answer, from a place chosen by `start`, until `f` breaks.
    pub(super) fn try_for_each(
        &self,
        start: u64,
        f: impl FnMut(WorkerKey) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.of.try_for_each_at_level(self.k, start, f)
    }
}

impl Scheduler {
    /// The overlaps of a prompt's `hashes` (`None` for an empty prompt).
    pub(super) fn overlaps(&self, hashes: &[u64], now: Instant) -> Option<PromptOverlaps> {
        (!hashes.is_empty()).then(|| PromptOverlaps {
            index: self.index.overlaps(hashes, now),
            provisional: (!self.provisional.is_empty())
                .then(|| self.provisional.overlaps(hashes, now)),
        })
    }

    /// `worker` was sent a prompt of `hashes`: approximate entries for an
    /// approximate worker, a guess (not renewing one it has) for a precise
    /// worker. Whether it was a guess, and the LRU key peers record it at
    /// (`None`: the approximate entries were left as they were, nothing to share).
    pub(super) fn record_prompt(
        &self,
        worker: WorkerKey,
        hashes: &[u64],
        now: Instant,
    ) -> (bool, Option<u64>) {
        match self.index.is_precise(worker) {
            true => {
                self.provisional.record(worker, hashes, now);
                (true, Some(self.index.key(now)))
            }
            false => (false, self.index.insert_chain(worker, hashes, now)),
        }
    }

    /// A peer sent `worker` a prompt of `hashes`, touching it at LRU key `at`:
    /// approximate entries ranked by that key, or a guess from `now` for a
    /// precise worker. A key more than [`PEER_KEY_AHEAD`] past this replica's
    /// clock counts as that far ahead: local touches rank after the newest
    /// entry, so a far-future key would drag every later one with it.
    pub(super) fn record_peer_prompt(
        &self,
        worker: WorkerKey,
        hashes: &[u64],
        at: u64,
        now: Instant,
    ) {
        let ahead = PEER_KEY_AHEAD.as_nanos() as u64;
        let at = at.min(self.index.key(now).saturating_add(ahead));
        match self.index.is_precise(worker) {
            true => self.provisional.record(worker, hashes, now),
            false => self.index.insert_chain_at(worker, hashes, at, now),
        }
    }

    /// `worker`'s KV events stored or removed these blocks (kvpick hashes): its
    /// provisional entries for them end, the events speak for it from now on.
    pub fn settle_provisional(&self, worker: WorkerKey, hashes: &[u64]) {
        self.provisional.settle(worker, hashes);
    }

    /// `worker`'s KV events cleared its cache (or its stream was reset): none
    /// of its provisional entries stand.
    pub fn clear_provisional(&self, worker: WorkerKey) {
        self.provisional.clear_worker(worker);
    }

    /// The response of `decision`'s request began, or the request ended
    /// without one: what it guessed on its precise targets must be confirmed
    /// by their events within [`SchedulerConfig::provisional_confirm`](super::SchedulerConfig::provisional_confirm).
    pub(super) fn await_confirmation(&self, decision: &Decision, now: Instant) {
        let Some(hashes) = &decision.guess else {
            return;
        };
        let targets = std::iter::once(&decision.decode).chain(&decision.prefill);
        for t in targets {
            if self.index.is_precise(t.key()) {
                self.provisional
                    .await_confirmation(t.key(), Arc::clone(hashes), now);
            }
        }
    }
}
