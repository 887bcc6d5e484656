//! What each candidate holds of a prompt: the prefix index's answer and, for
//! precise workers, the prompts routed there whose KV events have not arrived.
//!
//! A precise worker's index entries come only from its KV events, which it
//! publishes once a prefill completes: a burst of requests sharing a prefix
//! would otherwise see no worker holding it until the first one's prefill ends,
//! and scatter. So a prompt routed to a precise worker is recorded as
//! provisional (approximate) entries in a second index whose entries live
//! [`SchedulerConfig::provisional_ttl`](super::SchedulerConfig::provisional_ttl);
//! a candidate's overlap is the larger of the two answers. A provisional entry
//! ends when the worker's KV events speak of its block (stored: the precise
//! index holds it now; removed: the worker evicted it), so it never outlives
//! what the worker reports; the TTL only bounds entries whose events never come.

use std::time::Instant;

use super::cost::Cand;
use super::Scheduler;
use crate::endpoints::WorkerKey;
use crate::kv::index::Overlaps;

/// Every worker's overlap with one prompt.
pub(super) struct PromptOverlaps {
    index: Overlaps,
    /// Provisional entries (`None` while there are none).
    provisional: Option<Overlaps>,
}

impl PromptOverlaps {
    /// Leading prompt blocks candidate `c` holds or is provisionally credited
    /// with (the index found through the slot hint `c`'s endpoint keeps).
    pub(super) fn get(&self, c: &Cand<'_>) -> usize {
        let held = match c.ep.index_slot(c.rank) {
            Some(hint) => self.index.get_hinted(c.key, hint),
            None => self.index.get(c.key),
        };
        self.provisional
            .as_ref()
            .map_or(held, |p| held.max(p.get(c.key)))
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
    /// approximate worker, provisional ones for a precise worker.
    pub(super) fn record_prompt(&self, worker: WorkerKey, hashes: &[u64], now: Instant) {
        match self.index.is_precise(worker) {
            true => self.provisional.insert(worker, hashes, now),
            false => self.index.insert(worker, hashes, now),
        }
    }

    /// `worker`'s KV events stored or removed these blocks (kvpick hashes): its
    /// provisional entries for them end, the events speak for it from now on.
    pub fn settle_provisional(&self, worker: WorkerKey, hashes: &[u64]) {
        if !self.provisional.is_empty() {
            self.provisional.forget(worker, hashes);
        }
    }
}
