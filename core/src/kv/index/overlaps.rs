//! A lookup's answer: nested holder sets with their depths, read per worker
//! without the index's lock.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use smallvec::SmallVec;

use super::state::SlotNames;
use crate::keys::WorkerKey;
use crate::kv::slots::SlotSet;

/// A walk's holder sets with their depths (most walks have one or two).
pub(super) type Levels = SmallVec<[(SlotSet, u32); 2]>;

/// Every worker's overlap with one prompt ([`PrefixIndex::overlaps`]): nested
/// holder sets with their depths, read per worker without the index's lock.
#[derive(Debug, Clone)]
pub struct Overlaps {
    /// The index's slots when the answer was made.
    pub(super) names: Arc<SlotNames>,
    /// (holders, leading blocks held), each set a subset of the one before.
    pub(super) levels: Levels,
    /// (slot, depth) for workers whose expired approximate entries the walk counted.
    pub(super) corrected: Vec<(u32, usize)>,
    /// Whether the index had lower tiers' holders ([`crate::kv::tier`]).
    pub(super) tiered: bool,
}

impl Overlaps {
    /// How many leading blocks of the prompt `worker` holds.
    pub fn get(&self, worker: WorkerKey) -> usize {
        if self.levels.is_empty() {
            // No worker holds the first block: no need to find this one's slot.
            return 0;
        }
        self.names
            .slots
            .get(&worker)
            .map_or(0, |s| self.visible(*s))
    }

    /// Whether some worker held blocks on a lower tier: else no lower tier's
    /// holder holds any of the prompt, and [`Overlaps::get`] of the GPU's
    /// holder says all.
    pub fn tiered(&self) -> bool {
        self.tiered
    }

    /// [`Overlaps::get`] for a caller that keeps `worker`'s slot in `hint`: a
    /// hint naming the worker's slot saves the hash probe; any other value costs
    /// the probe and is corrected (so one hint per worker, kept across lookups,
    /// makes the read an array index).
    pub fn get_hinted(&self, worker: WorkerKey, hint: &AtomicU32) -> usize {
        if self.levels.is_empty() {
            return 0;
        }
        let slot = hint.load(Ordering::Relaxed);
        if self.names.keys.get(slot as usize) == Some(&Some(worker)) {
            return self.visible(slot);
        }
        match self.names.slots.get(&worker) {
            Some(&slot) => {
                hint.store(slot, Ordering::Relaxed);
                self.visible(slot)
            }
            None => 0,
        }
    }

    /// Every worker holding at least the first block, with its overlap (order
    /// unspecified; walks every known worker).
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, usize)> + '_ {
        self.names
            .slots
            .iter()
            .map(|(k, s)| (*k, self.visible(*s)))
            .filter(|(_, d)| *d > 0)
    }

    /// How many holder levels the walk found: level 0 holds the prompt's first
    /// block, each next level is a subset of the one before that holds more.
    pub fn levels(&self) -> usize {
        self.levels.len()
    }

    /// The most leading blocks a worker of level `k` holds (fewer for one whose
    /// expired entries were recounted; 0 past the last level).
    pub fn level_depth(&self, k: usize) -> usize {
        self.levels.get(k).map_or(0, |(_, d)| *d as usize)
    }

    /// How many workers level `k` holds (deeper levels' included).
    pub fn level_len(&self, k: usize) -> usize {
        self.levels.get(k).map_or(0, |(s, _)| s.len())
    }

    /// Calls `f` with each worker of level `k` that is in no deeper level (those
    /// whose overlap is at most [`Overlaps::level_depth`]`(k)` and more than the
    /// level below's), starting at a place chosen by `start` and wrapping around,
    /// until `f` breaks. Costs the level's set, not the index's workers.
    pub fn try_for_each_at_level(
        &self,
        k: usize,
        start: u64,
        mut f: impl FnMut(WorkerKey) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let Some((set, _)) = self.levels.get(k) else {
            return ControlFlow::Continue(());
        };
        let deeper = self.levels.get(k + 1).map(|(s, _)| s);
        let mut visit = |slot: u32| match self.names.keys.get(slot as usize) {
            Some(Some(worker)) if !deeper.is_some_and(|d| d.contains(slot)) => f(*worker),
            _ => ControlFlow::Continue(()),
        };
        match set {
            SlotSet::Few(v) if v.is_empty() => ControlFlow::Continue(()),
            SlotSet::Few(v) => {
                let (tail, head) = v.split_at(start as usize % v.len());
                head.iter().chain(tail).try_for_each(|s| visit(*s))
            }
            SlotSet::Many { words, .. } if words.is_empty() => ControlFlow::Continue(()),
            SlotSet::Many { words, .. } => {
                let from = start as usize % words.len();
                (from..words.len()).chain(0..from).try_for_each(|i| {
                    let mut bits = words[i];
                    while bits != 0 {
                        visit((i * 64) as u32 + bits.trailing_zeros())?;
                        bits &= bits - 1;
                    }
                    ControlFlow::Continue(())
                })
            }
        }
    }

    pub(super) fn visible(&self, slot: u32) -> usize {
        match self.corrected.iter().find(|(s, _)| *s == slot) {
            Some((_, d)) => *d,
            None => self.depth(slot),
        }
    }

    /// Depth the walk found for `slot`: that of the last (smallest) set holding it.
    pub(super) fn depth(&self, slot: u32) -> usize {
        let k = self.levels.partition_point(|(set, _)| set.contains(slot));
        k.checked_sub(1).map_or(0, |k| self.levels[k].1 as usize)
    }
}
