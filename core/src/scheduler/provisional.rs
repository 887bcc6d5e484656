//! Guesses: the prompts routed to a precise worker, credited there before its
//! KV events say so (see `overlap.rs` for how they count).
//!
//! A guess is an entry of a second prefix index, recorded when a prompt is
//! routed to a precise worker. It is a bet that the worker is computing the
//! prompt, so it must not outlive the evidence:
//! - the requests it attracts do not renew it: blocks the worker is already
//!   credited with keep their stamp, and the whole guess ends at
//!   [`SchedulerConfig::provisional_ttl`](super::SchedulerConfig::provisional_ttl)
//!   after the first routing at the latest;
//! - the worker's events end it: a stored block is held for real from then
//!   on, a removed block or `AllBlocksCleared` contradicts it;
//! - once the request's response began (or the request ended without one),
//!   the worker has [`SchedulerConfig::provisional_confirm`](super::SchedulerConfig::provisional_confirm)
//!   to report the blocks; what it has not reported by then is dropped (the
//!   request failed there, was cancelled, or the engine dropped the blocks).
//!
//! At equal cost a candidate whose overlap is a guess loses to one whose
//! events confirm it (`cost.rs`, [`super::cost`]'s `Least`).
//!
//! The prompts awaiting confirmation are held (their block hashes, shared with
//! their decisions) for the confirmation bound only, and at most
//! [`MAX_AWAITING_BLOCKS`] blocks of them: past it the oldest is settled early
//! (its guess dropped), so no client's request rate grows it without bound.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::endpoints::WorkerKey;
use crate::kv::index::{IndexConfig, Overlaps, PrefixIndex};
use crate::time::Epoch;

/// Most prompt blocks awaiting confirmation at once (8 bytes each: 32 MiB).
pub const MAX_AWAITING_BLOCKS: usize = 1 << 22;

/// Nothing awaits confirmation (`next_due`).
const NONE_DUE: i64 = i64::MAX;

/// The guesses of every precise worker.
#[derive(Debug)]
pub(super) struct Guesses {
    /// Guessed blocks per worker, each expiring at the provisional TTL.
    pub(super) index: PrefixIndex,
    /// How long after its response began a guess waits for the events.
    confirm_within: Duration,
    awaiting: Mutex<Awaiting>,
    /// When the first awaiting guess is due ([`Epoch::process`] code), so a
    /// pick checks it without the lock.
    next_due: AtomicI64,
}

/// Guesses whose response began, in the order they are due.
#[derive(Debug, Default)]
struct Awaiting {
    queue: VecDeque<Unconfirmed>,
    /// Blocks in `queue`.
    blocks: usize,
}

/// One guess awaiting its worker's events.
#[derive(Debug)]
struct Unconfirmed {
    due: Instant,
    worker: WorkerKey,
    hashes: Arc<[u64]>,
}

impl Guesses {
    /// No guesses; entries live `ttl` at most and wait `confirm_within` for
    /// their events once their response began.
    pub(super) fn new(index: IndexConfig, ttl: Duration, confirm_within: Duration) -> Self {
        Guesses {
            index: PrefixIndex::new(IndexConfig {
                ttl: Some(ttl),
                ..index
            }),
            confirm_within,
            awaiting: Mutex::default(),
            next_due: AtomicI64::new(NONE_DUE),
        }
    }

    /// Whether no worker is credited with anything.
    pub(super) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Every worker's guessed overlap with a prompt of `hashes`.
    pub(super) fn overlaps(&self, hashes: &[u64], now: Instant) -> Overlaps {
        self.index.overlaps(hashes, now)
    }

    /// `worker` was sent a prompt of `hashes`: the blocks it is not credited
    /// with yet are, from `now`; those it is keep their stamp (not renewed).
    pub(super) fn record(&self, worker: WorkerKey, hashes: &[u64], now: Instant) {
        self.index.insert_chain_unrenewed(worker, hashes, now);
    }

    /// `worker`'s events spoke of these blocks (stored or removed): they are
    /// no longer guesses.
    pub(super) fn settle(&self, worker: WorkerKey, hashes: &[u64]) {
        if !self.index.is_empty() {
            self.index.forget(worker, hashes);
        }
    }

    /// `worker` is gone or cleared its cache: none of its guesses stand.
    pub(super) fn clear_worker(&self, worker: WorkerKey) {
        self.index.clear_worker(worker);
    }

    /// The response of a request that sent `hashes` to `worker` began (or the
    /// request ended without one) at `now`: the guess must be confirmed by
    /// its events within the bound.
    pub(super) fn await_confirmation(&self, worker: WorkerKey, hashes: Arc<[u64]>, now: Instant) {
        let due = crate::time::saturating_add(now, self.confirm_within);
        let mut early = Vec::new();
        {
            let mut a = self.awaiting.lock();
            a.blocks += hashes.len();
            a.queue.push_back(Unconfirmed {
                due,
                worker,
                hashes,
            });
            while a.blocks > MAX_AWAITING_BLOCKS && a.queue.len() > 1 {
                early.extend(a.pop());
            }
            self.set_next_due(&a);
        }
        for u in early {
            self.settle(u.worker, &u.hashes);
        }
    }

    /// Drops the guesses due by `now` that their events have not confirmed.
    /// Cheap when none is due (one atomic load).
    pub(super) fn expire(&self, now: Instant) {
        if Epoch::process().encode(now) < self.next_due.load(Ordering::Relaxed) {
            return;
        }
        let due: Vec<Unconfirmed> = {
            let mut a = self.awaiting.lock();
            let mut due = Vec::new();
            while a.queue.front().is_some_and(|u| u.due <= now) {
                due.extend(a.pop());
            }
            self.set_next_due(&a);
            due
        };
        for u in due {
            self.settle(u.worker, &u.hashes);
        }
    }

    /// Publishes when the first queued guess is due (the queue is in arrival
    /// order, and every guess waits as long, so the front is due first).
    fn set_next_due(&self, a: &Awaiting) {
        let next = a
            .queue
            .front()
            .map_or(NONE_DUE, |u| Epoch::process().encode(u.due));
        self.next_due.store(next, Ordering::Relaxed);
    }
}

impl Awaiting {
    fn pop(&mut self) -> Option<Unconfirmed> {
        let u = self.queue.pop_front()?;
        self.blocks -= u.hashes.len();
        Some(u)
    }
}
