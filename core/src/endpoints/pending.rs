//! Which ranks have prefill pending, counted for the whole table as kvpick
//! books and releases load, so a pick learns in O(1) whether some rank has
//! nothing pending, with no pass over the pool.
//!
//! A rank has prefill pending while kvpick has uncached prompt blocks booked
//! there ([`ActiveLoad::uncached`](super::ActiveLoad::uncached)): requests it
//! routed whose prefill is not done. Each change of a rank's pending blocks is
//! one atomic read-modify-write, and the one that takes them from none to some
//! (or back) moves the table's count. An endpoint that leaves the table is
//! detached in the same word: a pending rank stops counting at once, and its
//! later releases count nowhere.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Set in a rank's pending word once its endpoint has left the table.
const DETACHED: u64 = 1 << 63;

/// The prompt blocks booked to prefill on one rank (the low 63 bits), and
/// whether its endpoint has left the table (the top bit).
#[derive(Debug, Default)]
pub(super) struct PendingBlocks(AtomicU64);

impl PendingBlocks {
    /// The blocks booked to prefill.
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed) & !DETACHED
    }

    /// Books `n` more blocks (saturating); a rank that had none starts
    /// counting in `count`.
    pub(super) fn add(&self, n: u64, count: &AtomicI64) {
        self.update(count, |v| v.saturating_add(n).min(!DETACHED));
    }

    /// Releases `n` blocks (never below zero); a rank left with none stops
    /// counting in `count`.
    pub(super) fn sub(&self, n: u64, count: &AtomicI64) {
        self.update(count, |v| v.saturating_sub(n));
    }

    /// The endpoint left the table: a pending rank stops counting in `count`,
    /// and no later change counts. Only the first call does anything.
    pub(super) fn detach(&self, count: &AtomicI64) {
        let before = self.0.fetch_or(DETACHED, Ordering::Relaxed);
        if before != 0 && before & DETACHED == 0 {
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Applies `f` to the blocks in one read-modify-write and moves `count` by
    /// the change of "some pending" it made, unless the rank is detached.
    fn update(&self, count: &AtomicI64, f: impl Fn(u64) -> u64) {
        let Ok(before) = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                Some((w & DETACHED) | f(w & !DETACHED))
            })
        else {
            return;
        };
        if before & DETACHED != 0 {
            return;
        }
        let (was_pending, is_pending) = (before != 0, f(before) != 0);
        if is_pending && !was_pending {
            count.fetch_add(1, Ordering::Relaxed);
        } else if was_pending && !is_pending {
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The table's ranks with prefill pending, apart for endpoints that serve
/// decode and prefill-only ones (the two sides a pick chooses from).
#[derive(Debug, Default)]
pub(super) struct PendingRanks([AtomicI64; 2]);

impl PendingRanks {
    /// The count of one side.
    pub(super) fn side(&self, serves_decode: bool) -> &AtomicI64 {
        &self.0[usize::from(serves_decode)]
    }

    /// Ranks of one side with prefill pending. Two changes on different ranks
    /// may reach the count in either order; a count briefly below zero reads
    /// as zero.
    pub(super) fn get(&self, serves_decode: bool) -> u64 {
        self.side(serves_decode).load(Ordering::Relaxed).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_counts_from_its_first_pending_block_to_its_last() {
        let count = AtomicI64::new(0);
        let blocks = PendingBlocks::default();
        blocks.add(0, &count);
        assert_eq!(
            count.load(Ordering::Relaxed),
            0,
            "booking nothing is not pending"
        );
        blocks.add(3, &count);
        blocks.add(2, &count);
        assert_eq!((blocks.get(), count.load(Ordering::Relaxed)), (5, 1));
        blocks.sub(4, &count);
        assert_eq!((blocks.get(), count.load(Ordering::Relaxed)), (1, 1));
        blocks.sub(9, &count);
        assert_eq!((blocks.get(), count.load(Ordering::Relaxed)), (0, 0));
        blocks.sub(1, &count);
        assert_eq!((blocks.get(), count.load(Ordering::Relaxed)), (0, 0));
        blocks.add(u64::MAX, &count);
        assert_eq!(blocks.get(), !DETACHED, "saturates below the flag");
        assert_eq!(count.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_detached_rank_stops_counting_once_and_for_good() {
        let count = AtomicI64::new(0);
        let (pending, idle) = (PendingBlocks::default(), PendingBlocks::default());
        pending.add(4, &count);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        pending.detach(&count);
        pending.detach(&count);
        idle.detach(&count);
        assert_eq!(count.load(Ordering::Relaxed), 0);
        assert_eq!(pending.get(), 4, "its load still reads");
        pending.sub(4, &count);
        idle.add(2, &count);
        assert_eq!(count.load(Ordering::Relaxed), 0);
        assert_eq!((pending.get(), idle.get()), (0, 2));
    }

    #[test]
    fn concurrent_books_and_releases_leave_the_count_exact() {
        let ranks = PendingRanks::default();
        let blocks: Vec<PendingBlocks> = (0..4).map(|_| PendingBlocks::default()).collect();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (ranks, blocks) = (&ranks, &blocks);
                s.spawn(move || {
                    for i in 0..20_000u64 {
                        let b = &blocks[((i + t) % 4) as usize];
                        let n = 1 + (i % 3);
                        b.add(n, ranks.side(true));
                        b.sub(n, ranks.side(true));
                    }
                });
            }
        });
        assert_eq!(ranks.side(true).load(Ordering::Relaxed), 0);
        blocks[1].add(1, ranks.side(true));
        assert_eq!((ranks.get(true), ranks.get(false)), (1, 0));
    }
}
