//! The prefix index: which (worker, dp rank) holds which prefix blocks.
//!
//! One index per pool. Block hashes are chained (a block's hash names its whole
//! prefix), so a block is found by its hash alone. Blocks live in **runs**: a run
//! is a sequence of blocks stored together (one KV event, one routing decision)
//! that every holder holds entirely, with one holder set for the whole run. Each
//! (worker, rank) gets a dense slot number; a holder set is a sorted slot list, or
//! a bitset once that is smaller ([`SlotSet`]). A run is a piece of a **lineage**:
//! the chain it was first stored in, whose positions never change while a block
//! lives (splits keep them), so a block's (lineage, position) can be kept aside.
//! A table from block hash to that location finds where a prompt's blocks are
//! ([`BlockTable`]: open addressing placed by a per-table secret, so chosen
//! hashes cannot pile up in one probe sequence, with a tag byte per slot so an
//! absent block is settled without reading slots). With chained hashes
//! ([`IndexConfig::chained`]) it holds only each run's first block (and the
//! blocks approximate entries hold): any other block sits right after its parent,
//! which is how lookups and stores reach it; a worker's precise entries keep
//! their blocks' locations for removal.
//!
//! A lookup probes the map for the prompt's first block, then compares the prompt
//! with the run in place (no probe per block) until the run ends or differs, then
//! probes again (the probe for where the run ends is made before the comparison,
//! so that the two chains of cache misses overlap). At each run boundary it
//! intersects the set of workers still matching with the new run's holders; a
//! worker dropped there scores the blocks before it, and the walk stops when no
//! worker is left. The answer
//! ([`Overlaps`]) keeps those shrinking sets with their depths instead of a
//! (worker, depth) pair per holder, so building it costs the runs crossed, not the
//! workers holding the prompt; it is read per worker afterwards, without the lock
//! ([`PrefixIndex::lookup`] reads it for the scheduler's candidates).
//!
//! Writes split a run where holder sets start to differ (a worker storing part of
//! a run, or losing one block of it): the shorter side moves, so splitting costs
//! the smaller part; a run whose holders become those of the run before it in its
//! lineage is appended to it.
//!
//! Two ways in:
//! - approximate mode ([`PrefixIndex::insert`]): each routing decision records the
//!   request's blocks for the chosen worker; an LRU bound per worker (its capacity
//!   in blocks) keeps the guess close to what the engine still holds, and until
//!   that capacity is known ([`PrefixIndex::set_capacity`]) a TTL stands in for
//!   the engine's evictions;
//! - precise mode ([`PrefixIndex::store_engine_chain`],
//!   [`PrefixIndex::remove_engine_blocks`]): the engine's KV events say exactly
//!   what is stored and evicted; such entries have no TTL, and at most a per-worker
//!   cap of them is kept ([`PrefixIndex::set_precise_limit`]): stores beyond it are
//!   dropped and counted ([`PrefixIndex::precise_dropped`]), so a publisher
//!   flooding `BlockStored` cannot grow the index without bound.
//!
//! A worker marked precise ([`PrefixIndex::set_precise`]) takes no approximate
//! entries: its events are the truth.
//!
//! Concurrency: one reader-writer lock over the runs and the block table, and
//! one mutex over the workers' precise entries (engine hash → location), taken
//! first by precise writes only. In production every KV event is applied on one
//! thread (`kvevents::subscriber`'s `kv-ingest` thread), so that mutex has one
//! user but for discovery's clears; the other writers of the runs are the
//! request path's approximate inserts. Lookups share the lock; writers hold it
//! for at most [`WRITE_CHUNK`] blocks at a time (large batches, worker clears
//! and purges are cut into chunks), so a lookup waits behind ingest for at most
//! one chunk, a few microseconds. Waiting lookups spin rather than sleep
//! (waking a sleeper costs more than a chunk) and say so: a writer lets them in
//! before taking the lock for its next chunk. A precise store plans each chunk
//! under the read lock (what each block is for its worker, with the cache
//! misses that costs), changes the runs under the write lock, and records the
//! new locations in its worker's engine map after letting it go.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use smallvec::SmallVec;

use crate::keys::WorkerKey;
pub use crate::keys::{KeyHash, KeyHasher};
use crate::kv::lru::Lru;
use crate::kv::slots::SlotSet;
use crate::kv::table::{BlockTable, Place};

/// Default LRU bound per worker in blocks, when neither the engine's capacity nor
/// a flag says otherwise (the GIE prefix plugin's default).
pub const DEFAULT_CAPACITY_BLOCKS: usize = 31_250;

/// Default time an approximate entry stays valid after its last touch.
pub const DEFAULT_TTL: Duration = Duration::from_secs(900);

/// Default cap on a worker's precise entries until its engine's block count is known.
pub const DEFAULT_PRECISE_LIMIT: usize = 1_000_000;

/// Default slack over an engine's block count for its precise cap.
pub const DEFAULT_PRECISE_SLACK: f64 = 1.5;

/// Blocks a writer handles per lock acquisition.
pub const WRITE_CHUNK: usize = 64;

type Map<K, V> = HashMap<K, V, KeyHash>;

/// Where a block lives: its lineage and its absolute position there. Positions
/// never change while the block exists (splits keep them, merges join only
/// neighbouring pieces of one lineage), so a location kept aside stays valid;
/// [`Inner::run_at`] finds the run covering it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Loc {
    lineage: u32,
    pos: u32,
}

/// Consecutive blocks with one holder set.
#[derive(Debug, Default)]
struct Run {
    /// Absolute position of `hashes[0]` in its lineage.
    start: u32,
    /// A deque so that a split moving a short front away does not shift the rest.
    hashes: VecDeque<u64>,
    holders: SlotSet,
    lineage: u32,
    /// Whether blocks after the first may have an entry in the block table (every
    /// block does without chained hashes, and every block an approximate entry
    /// holds does); else only the first has one.
    indexed: bool,
}

impl Run {
    fn end(&self) -> u32 {
        self.start + self.hashes.len() as u32
    }
}

/// Per-worker bookkeeping.
#[derive(Debug, Default)]
struct Worker {
    key: Option<WorkerKey>,
    capacity: Option<usize>,
    precise_limit: Option<usize>,
    precise: bool,
    /// Approximate entries ordered by the key of their latest touch
    /// ([`PrefixIndex::key`]).
    recency: Lru,
    /// Stamp of the oldest live approximate entry (`u32::MAX`: none).
    oldest: u32,
    /// Precise entries: extra engine blocks naming a kvpick hash already held
    /// precisely (beyond the first); usually empty.
    extra: Map<u64, u32>,
    /// Approximate workers only: kvpick hashes held through a precise entry (a
    /// precise worker's held hashes are exactly its run holdings).
    precise_held: HashSet<u64, KeyHash>,
}

/// Every worker's precise entries: engine hash → where the block is (its kvpick
/// hash is there), and a store's scratch, kept between calls.
#[derive(Debug, Default)]
struct Engines {
    maps: Map<WorkerKey, BlockTable<Loc>>,
    plan: StorePlan,
    placed: Vec<(Loc, bool)>,
}

/// Settings of a [`PrefixIndex`].
#[derive(Debug, Clone, Copy)]
pub struct IndexConfig {
    /// LRU bound per worker in blocks until [`PrefixIndex::set_capacity`] is called.
    pub default_capacity: usize,
    /// How long an approximate entry of a worker whose capacity is unknown
    /// stays valid after its last touch (`None`: forever). Once
    /// [`PrefixIndex::set_capacity`] gives the engine's capacity, its LRU bound
    /// alone stands for the engine's evictions: an engine under no pressure
    /// keeps its blocks however old.
    pub ttl: Option<Duration>,
    /// Cap on a worker's precise entries until [`PrefixIndex::set_precise_limit`]
    /// is called.
    pub default_precise_limit: usize,
    /// The precise cap from an engine's block count is that count times this.
    pub precise_slack: f64,
    /// Block hashes are chained (a hash names its whole prefix, so a block has one
    /// parent and follows it wherever it is stored) and every write says where its
    /// chain continues ([`PrefixIndex::store_engine_chain`]'s parent, a prompt
    /// from its first block for [`PrefixIndex::insert`]). Then the block table
    /// needs only each run's first block (and the blocks approximate entries
    /// hold): the rest are found from their parent. Off, every block has an
    /// entry (for hashes that are not chained).
    pub chained: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            default_capacity: DEFAULT_CAPACITY_BLOCKS,
            ttl: Some(DEFAULT_TTL),
            default_precise_limit: DEFAULT_PRECISE_LIMIT,
            precise_slack: DEFAULT_PRECISE_SLACK,
            chained: true,
        }
    }
}

/// A lineage's runs.
#[derive(Debug)]
struct Lineage {
    /// Its runs by start; empty: the lineage is free.
    pieces: Vec<u32>,
}

/// Which worker each slot is, both ways.
#[derive(Debug, Default, Clone)]
struct SlotNames {
    slots: Map<WorkerKey, u32>,
    /// Slot → worker, the inverse of `slots`.
    keys: Vec<Option<WorkerKey>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Block hash → location: every run's first block, and more (see [`Run::indexed`]).
    blocks: BlockTable<Loc>,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    lineages: Vec<Lineage>,
    /// Per lineage, its run when it has only one, else `u32::MAX`: most have
    /// one, and a lookup then finds the run without reading the lineage's
    /// pieces, in an array dense enough to stay in cache.
    only_run: Vec<u32>,
    free_lineages: Vec<u32>,
    /// [`IndexConfig::chained`].
    chained: bool,
    /// Shared with the [`Overlaps`] answers still alive (copied on write then).
    names: Arc<SlotNames>,
    workers: Vec<Worker>,
    free_slots: Vec<u32>,
    /// (oldest approximate stamp, slot) of every worker with approximate entries.
    expiring: BTreeSet<(u32, u32)>,
    clock: Clock,
}

/// The index's two time scales: an LRU **key** (nanoseconds since the Unix
/// epoch, the order of touches, comparable between replicas) and a **stamp**
/// (whole seconds since the index's base, what TTLs count).
#[derive(Debug, Clone, Copy)]
struct Clock {
    base: Instant,
    /// The key of `base`.
    epoch: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::at(Instant::now())
    }
}

impl Clock {
    /// A clock whose base is `base`, placed on the system clock.
    fn at(base: Instant) -> Self {
        let wall = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let wall = wall.saturating_sub(Instant::now().saturating_duration_since(base));
        Clock {
            base,
            epoch: u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    fn key(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.base).as_nanos();
        self.epoch
            .saturating_add(u64::try_from(since).unwrap_or(u64::MAX))
    }

    fn stamp_of(&self, key: u64) -> u32 {
        let secs = key.saturating_sub(self.epoch) / 1_000_000_000;
        secs.min(u64::from(u32::MAX - 1)) as u32
    }
}

/// Which (worker, rank) holds which prefix blocks. Send + Sync; share it in an `Arc`.
#[derive(Debug)]
pub struct PrefixIndex {
    inner: RwLock<Inner>,
    /// Precise entries, locked before `inner` (never while holding it) by
    /// precise writes and clears, for a whole call.
    engines: Mutex<Engines>,
    config: IndexConfig,
    clock: Clock,
    entries: AtomicUsize,
    precise_dropped: AtomicU64,
    /// Lookups spinning for the lock; writers let them in before their next chunk.
    lookups_waiting: AtomicUsize,
    /// Lookups that ever spun for the lock (a writer waits for each at most once).
    lookups_announced: AtomicU64,
    /// `lookups_announced` when a writer last stopped waiting for a lookup that
    /// did not take the lock within [`YIELD`] (descheduled while spinning).
    writers_gave_up_at: AtomicU64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Self::with_base(config, Instant::now())
    }

    /// An empty index whose clock starts at `base` (for tests that pass their own
    /// instants; `now` arguments before `base` count as `base`).
    pub fn with_base(config: IndexConfig, base: Instant) -> Self {
        let clock = Clock::at(base);
        PrefixIndex {
            inner: RwLock::new(Inner {
                chained: config.chained,
                clock,
                ..Inner::default()
            }),
            engines: Mutex::default(),
            config,
            clock,
            entries: AtomicUsize::new(0),
            precise_dropped: AtomicU64::new(0),
            lookups_waiting: AtomicUsize::new(0),
            lookups_announced: AtomicU64::new(0),
            writers_gave_up_at: AtomicU64::new(0),
        }
    }

    /// The write lock, never taken while a lookup is spinning for it, and
    /// released fairly (a lookup asleep on it goes before this writer's next
    /// chunk). A lookup that does not take the lock within [`YIELD`] was
    /// descheduled while spinning: the writer goes on, and does not wait for
    /// that one again (waiting for it on every chunk burned the writer's CPU
    /// until it ran again). After [`SPIN`] the writer sleeps on the lock.
    fn write(&self) -> FairWrite<'_> {
        let announced = self.lookups_announced.load(Ordering::SeqCst);
        let mut let_in = announced > self.writers_gave_up_at.load(Ordering::Relaxed);
        let start = Instant::now();
        let spun = spin_for(SPIN, || {
            if let_in && self.lookups_waiting.load(Ordering::SeqCst) > 0 {
                if start.elapsed() < YIELD {
                    return None;
                }
                self.writers_gave_up_at
                    .fetch_max(announced, Ordering::Relaxed);
                let_in = false;
            }
            self.inner.try_write()
        });
        FairWrite(Some(spun.unwrap_or_else(|| self.inner.write())))
    }

    /// Runs `f` with the engine maps locked, on `worker`'s slot (a new one with
    /// `create`), its engine map and the store scratch.
    fn with_engine<T>(
        &self,
        worker: WorkerKey,
        create: bool,
        f: impl FnOnce(u32, &mut BlockTable<Loc>, &mut StorePlan, &mut Vec<(Loc, bool)>) -> T,
    ) -> Option<T> {
        let mut engines = self.engines.lock();
        let known = self.inner.read().names.slots.get(&worker).copied();
        let slot = match known {
            Some(s) => s,
            None if create => self.write().slot(worker),
            None => return None,
        };
        let Engines { maps, plan, placed } = &mut *engines;
        Some(f(slot, maps.entry(worker).or_default(), plan, placed))
    }

    /// The read lock for a lookup: while a writer holds it (one chunk, a few
    /// microseconds), spin and announce the wait, so the writer's next chunk waits
    /// for this lookup. After [`SPIN`] (the writer was descheduled holding it)
    /// keep polling but yield the core between polls: never sleep on the lock, so
    /// that the lookup runs the moment the writer lets go instead of waiting to be
    /// woken and then for a core, and is never handed the lock while it waits for
    /// one (which would stall the writer behind it).
    fn read_for_lookup(&self) -> RwLockReadGuard<'_, Inner> {
        if let Some(g) = self.inner.try_read() {
            return g;
        }
        self.lookups_waiting.fetch_add(1, Ordering::SeqCst);
        self.lookups_announced.fetch_add(1, Ordering::SeqCst);
        let g = spin_for(SPIN, || self.inner.try_read()).unwrap_or_else(|| loop {
            std::thread::yield_now();
            if let Some(g) = spin_for(Duration::ZERO, || self.inner.try_read()) {
                break g;
            }
        });
        self.lookups_waiting.fetch_sub(1, Ordering::SeqCst);
        g
    }

    fn stamp(&self, now: Instant) -> u32 {
        self.clock.stamp_of(self.clock.key(now))
    }

    /// The LRU key of a touch at `now`: nanoseconds since the Unix epoch by
    /// this index's clock (see [`PrefixIndex::insert_chain_at`]).
    pub fn key(&self, now: Instant) -> u64 {
        self.clock.key(now)
    }

    fn alive(&self, stamp: u32, now: u32) -> bool {
        match self.config.ttl {
            None => true,
            Some(ttl) => u64::from(now.saturating_sub(stamp)) < ttl.as_secs().max(1),
        }
    }

    /// [`Self::alive`] of an entry last touched at LRU key `key`.
    fn alive_at_key(&self, key: u64, now: u32) -> bool {
        self.alive(self.clock.stamp_of(key), now)
    }

    /// Approximate mode: records that `worker` now holds `hashes` (touching them in
    /// its LRU), then evicts its least recently used blocks beyond its capacity and
    /// its expired ones. Does nothing for a precise worker. Of a prompt longer
    /// than the worker's capacity only the leading blocks that fit are recorded:
    /// the rest would evict the prompt's own prefix, the part a later request can match.
    ///
    /// The touch's key (the newest of `now`'s and one past the worker's newest
    /// entry, so it ranks last) is returned when anything was touched: block `i`
    /// was touched at that key plus `i`. A peer replaying the touch at that key
    /// ([`PrefixIndex::insert_chain_at`]) orders it exactly as here.
    pub fn insert(&self, worker: WorkerKey, hashes: &[u64], now: Instant) -> Option<u64> {
        self.insert_unless(worker, hashes, now, None, true, |_, _, _| false)
    }

    /// [`PrefixIndex::insert`] of a chain: each of `hashes` names every block
    /// before it too (kvpick's prompt hashes). A prompt this worker's entries
    /// already hold from an insert within the same second (its last recorded
    /// block carries this second's stamp, so that insert touched every block
    /// before it then) is left as it is: inserting it again would only reorder
    /// its blocks among that second's touches. Returns the touch's key, `None`
    /// when it was left as it is (so it is no touch for peers either).
    pub fn insert_chain(&self, worker: WorkerKey, hashes: &[u64], now: Instant) -> Option<u64> {
        let clock = self.clock;
        self.insert_unless(worker, hashes, now, None, true, |w, last, stamp| {
            let newest = w.recency.newest_key().map_or(0, |k| clock.stamp_of(k));
            !w.precise && w.recency.key(last).map(|k| clock.stamp_of(k)) == Some(stamp.max(newest))
        })
    }

    /// A peer's [`PrefixIndex::insert_chain`] that touched `hashes` at key
    /// `at` (block `i` at `at + i`): each block ranks by the newest key it was
    /// touched with, here or by any peer, wherever the touch lands in the
    /// worker's LRU. Indexes that apply the same touches, in whatever order
    /// and however late, hold the same entries in the same order once capacity
    /// evictions are done (TTL expiry counts from each one's own `now`).
    pub fn insert_chain_at(&self, worker: WorkerKey, hashes: &[u64], at: u64, now: Instant) {
        self.insert_unless(worker, hashes, now, Some(at), true, |_, _, _| false);
    }

    /// [`PrefixIndex::insert_chain`] that renews nothing: blocks `worker`
    /// holds already keep their stamp (and expire when it says), only blocks
    /// new to it are recorded at `now`. For guesses that a later use must not
    /// keep alive (a precise worker's provisional entries).
    pub fn insert_chain_unrenewed(&self, worker: WorkerKey, hashes: &[u64], now: Instant) {
        self.insert_unless(worker, hashes, now, None, false, |w, last, _| {
            !w.precise && w.recency.contains(last)
        });
    }

    /// [`PrefixIndex::insert`], unless `recorded(worker's entries, the last
    /// block that fits, stamp)` says the insert would change nothing; blocks
    /// already held are touched again only with `renew`. Touches at key `at`
    /// (a peer's), else ranking after every entry; returns the key.
    fn insert_unless(
        &self,
        worker: WorkerKey,
        hashes: &[u64],
        now: Instant,
        at: Option<u64>,
        renew: bool,
        recorded: impl Fn(&Worker, u64, u32) -> bool,
    ) -> Option<u64> {
        let stamp = self.stamp(now);
        let hashes = {
            let g = self.inner.read();
            let w = g.names.slots.get(&worker).map(|s| &g.workers[*s as usize]);
            let cap = w
                .and_then(|w| w.capacity)
                .unwrap_or(self.config.default_capacity);
            let hashes = &hashes[..hashes.len().min(cap)];
            match (w, hashes.last()) {
                (Some(w), Some(&last)) if recorded(w, last, stamp) => return None,
                _ => hashes,
            }
        };
        let mut prev = None;
        let mut placed = Vec::new();
        let mut key = at;
        for (c, chunk) in hashes.chunks(WRITE_CHUNK).enumerate() {
            self.inner.read().warm_insert(worker, chunk);
            let mut g = self.write();
            let slot = g.slot(worker);
            let w = &mut g.workers[slot as usize];
            if w.precise {
                return None;
            }
            let first = *key.get_or_insert_with(|| {
                let newest = w.recency.newest_key().map_or(0, |k| k.saturating_add(1));
                self.clock.key(now).max(newest)
            });
            let first = first.saturating_add((c * WRITE_CHUNK) as u64);
            // One bit per block of the chunk new in the LRU.
            let mut fresh = 0u64;
            for (k, &h) in chunk.iter().enumerate() {
                let touched = first.saturating_add(k as u64);
                if (renew || !w.recency.contains(h)) && w.recency.touch(h, touched) {
                    fresh |= 1 << k;
                }
            }
            if w.oldest == u32::MAX || at.is_some() {
                g.settle_lru(slot);
            }
            // The whole chunk (blocks already held included) keeps the chain's
            // context; blocks the worker holds already are left as they are.
            placed.clear();
            g.add_holder_runs(chunk, prev, slot, true, &mut placed, &self.entries);
            for (k, (&h, &(loc, held))) in chunk.iter().zip(&placed).enumerate() {
                if g.chained && held && fresh & (1 << k) != 0 {
                    // Held precisely until now: the LRU finds its blocks by hash.
                    g.index_block(h, loc);
                }
            }
            prev = chunk.last().copied().zip(placed.last().map(|p| p.0));
        }
        // A local touch counts from its own key (it may rank after `now`).
        let now = match (at, key) {
            (None, Some(k)) => self.clock.stamp_of(k).max(stamp),
            _ => stamp,
        };
        self.evict(worker, now);
        key
    }

    /// Evicts `worker`'s approximate entries beyond its capacity and expired ones,
    /// a chunk per lock acquisition.
    fn evict(&self, worker: WorkerKey, now: u32) {
        loop {
            let mut g = self.write();
            let Some(&slot) = g.names.slots.get(&worker) else {
                return;
            };
            let cap = g.workers[slot as usize]
                .capacity
                .unwrap_or(self.config.default_capacity);
            let mut dropped = Vec::new();
            let done = {
                let w = &mut g.workers[slot as usize];
                loop {
                    if dropped.len() >= WRITE_CHUNK {
                        break false;
                    }
                    let Some((h, key)) = w.recency.oldest() else {
                        break true;
                    };
                    if w.recency.len() <= cap
                        && (w.capacity.is_some() || self.alive_at_key(key, now))
                    {
                        break true;
                    }
                    w.recency.pop_oldest();
                    if !w.precise_held.contains(&h) {
                        dropped.push(h);
                    }
                }
            };
            g.settle_lru(slot);
            g.remove_hashes(&dropped, slot, &self.entries);
            if done {
                return;
            }
        }
    }

    /// Drops `worker`'s approximate entries for these blocks (e.g. provisional
    /// entries whose KV event has arrived). Blocks it holds only precisely, or not
    /// at all, are left as they are; a block it holds both ways keeps its precise
    /// entry.
    pub fn forget(&self, worker: WorkerKey, hashes: &[u64]) {
        for chunk in hashes.chunks(WRITE_CHUNK) {
            self.inner.read().blocks.prefetch(chunk);
            let mut g = self.write();
            let Some(&slot) = g.names.slots.get(&worker) else {
                return;
            };
            let w = &mut g.workers[slot as usize];
            let mut dropped = Vec::new();
            for h in chunk {
                if w.recency.remove(*h) && !w.precise_held.contains(h) {
                    dropped.push(*h);
                }
            }
            g.settle_lru(slot);
            g.remove_hashes(&dropped, slot, &self.entries);
        }
    }

    /// Precise mode: `worker` stored these blocks (engine hash, kvpick hash), in
    /// chain order, following the block it holds under engine hash `parent`
    /// (`None`: from the chain's first block). With chained hashes a store whose
    /// parent `worker` does not hold is not applied: its blocks could not be placed.
    /// The engine hash is only kept to find the block again on removal. A store
    /// stops at the first block beyond the worker's precise cap (the rest follow
    /// it); what it drops is counted.
    ///
    /// Each chunk is planned under the read lock (what each block is for this
    /// worker), applied to the runs under the write lock, and recorded in the
    /// worker's engine map after it.
    pub fn store_engine_chain(
        &self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
        now: Instant,
    ) {
        // Precise entries never expire: `now` is accepted for symmetry with `insert`.
        let _ = now;
        self.with_engine(worker, true, |slot, e, plan, placed| {
            self.store_locked(slot, e, plan, placed, parent, blocks)
        });
    }

    /// [`PrefixIndex::store_engine_chain`] holding the worker's engine map `e`
    /// (and the scratch `plan`, `placed`).
    fn store_locked(
        &self,
        slot: u32,
        e: &mut BlockTable<Loc>,
        plan: &mut StorePlan,
        placed: &mut Vec<(Loc, bool)>,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
    ) {
        let mut prev: Option<(u64, Loc)> = None;
        for (k, chunk) in blocks.chunks(WRITE_CHUNK).enumerate() {
            // Room for the plan to claim every block's place without a rehash.
            e.reserve(chunk.len());
            // Both: a new block's engine hash is settled by its tags, and then
            // claims its home slot or one close by.
            e.prefetch(chunk.iter().map(|(e, _)| e));
            {
                let g = self.inner.read();
                // The write looks each new block up in the block table (chained,
                // to find a run it may start; else to give it an entry): load
                // their tags now, while lookups can still run.
                g.blocks.prefetch_tags(chunk.iter().map(|(_, h)| h));
                if k == 0 {
                    if let Some(p) = parent {
                        let found = e.get(p).and_then(|l| g.hash_at(l).map(|h| (h, l)));
                        if found.is_none() && g.chained {
                            return;
                        }
                        prev = found;
                    }
                }
                let limit = g.workers[slot as usize]
                    .precise_limit
                    .unwrap_or(self.config.default_precise_limit);
                plan.make(&g, e, chunk, limit);
            }
            placed.clear();
            {
                let mut g = self.write();
                g.add_holder_runs(&plan.chain, prev, slot, false, placed, &self.entries);
                let w = &mut g.workers[slot as usize];
                for &(i, _) in &plan.mapped {
                    let hash = chunk[i].1;
                    if w.precise {
                        if placed[i].1 {
                            // A second engine block naming a hash this worker holds precisely.
                            *w.extra.entry(hash).or_insert(0) += 1;
                        }
                    } else if !w.precise_held.insert(hash) {
                        // An approximate worker tracks precise holdings apart.
                        *w.extra.entry(hash).or_insert(0) += 1;
                    }
                }
                let here = plan
                    .released_here
                    .iter()
                    .map(|&j| (chunk[j].1, placed[j].0));
                plan.released.extend(here);
                g.release_precise(slot, &plan.released, &self.entries);
            }
            for &(i, place) in &plan.mapped {
                e.set(place, placed[i].0);
            }
            if let Some(i) = plan.stopped {
                let dropped = blocks.len() - k * WRITE_CHUNK - i;
                self.precise_dropped
                    .fetch_add(dropped as u64, Ordering::Relaxed);
                return;
            }
            prev = plan.chain.last().copied().zip(placed.last().map(|p| p.0));
        }
    }

    /// Precise mode: `worker` evicted these blocks (by engine hash); unknown ones
    /// are ignored. Returns the kvpick hashes of the blocks it knew.
    pub fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]) -> Vec<u64> {
        let mut known = Vec::new();
        self.with_engine(worker, false, |slot, e, _, _| {
            for chunk in engine_hashes.chunks(WRITE_CHUNK) {
                e.prefetch(chunk);
                let locs: Vec<Loc> = chunk.iter().filter_map(|h| e.remove(*h)).collect();
                if locs.is_empty() {
                    continue;
                }
                let mut g = self.write();
                let released: Vec<(u64, Loc)> = locs
                    .into_iter()
                    .filter_map(|l| g.hash_at(l).map(|h| (h, l)))
                    .collect();
                g.release_precise(slot, &released, &self.entries);
                known.extend(released.iter().map(|(h, _)| h));
            }
        });
        known
    }

    /// Forgets everything `worker` holds (event gap, engine restart, reconnect,
    /// endpoint gone). Its capacity, precise cap and precise flag are forgotten too.
    pub fn clear_worker(&self, worker: WorkerKey) {
        let (slot, locs, w) = {
            // The engine maps stay locked until the slot is unlinked: a precise
            // write for this worker then starts on a new slot.
            let mut engines = self.engines.lock();
            let engine = engines.maps.remove(&worker);
            let mut g = self.write();
            let names = Arc::make_mut(&mut g.names);
            let Some(slot) = names.slots.remove(&worker) else {
                return;
            };
            names.keys[slot as usize] = None;
            g.set_oldest(slot, u32::MAX);
            let w = std::mem::take(&mut g.workers[slot as usize]);
            let locs: Vec<Loc> = engine.map(|e| e.values().collect()).unwrap_or_default();
            (slot, locs, w)
        };
        // The slot has no key now (lookups skip it) and is reused only once empty.
        let hashes: Vec<u64> = w.recency.keys().collect();
        self.remove_in_run_order(slot, &hashes, &locs, None);
        self.write().free_slots.push(slot);
    }

    /// Removes `slot` from the blocks `hashes` (found by hash) and `locs` (found
    /// where they are) a chunk at a time, in run order so that each run is cut
    /// once, not once per block. With `owner`, stops if the slot no longer belongs
    /// to it (cleared meanwhile).
    fn remove_in_run_order(
        &self,
        slot: u32,
        hashes: &[u64],
        locs: &[Loc],
        owner: Option<WorkerKey>,
    ) {
        let mut items: Vec<(u64, Loc)> = {
            let g = self.inner.read();
            let by_hash = hashes
                .iter()
                .filter_map(|h| g.blocks.get(*h).map(|l| (*h, l)));
            let by_loc = locs.iter().filter_map(|l| g.hash_at(*l).map(|h| (h, *l)));
            by_hash.chain(by_loc).collect()
        };
        items.sort_unstable_by_key(|(_, l)| *l);
        for chunk in items.chunks(WRITE_CHUNK) {
            let mut g = self.write();
            if owner.is_some_and(|k| g.names.slots.get(&k) != Some(&slot)) {
                return;
            }
            g.remove_holder_runs(chunk, slot, &self.entries);
        }
    }

    /// Marks `worker` as fed by KV events (precise) or not. Turning precise on drops
    /// its approximate entries.
    pub fn set_precise(&self, worker: WorkerKey, precise: bool) {
        let dropped = self.with_engine(worker, true, |slot, e, _, _| {
            let mut g = self.write();
            let w = &mut g.workers[slot as usize];
            if w.precise == precise {
                return None;
            }
            w.precise = precise;
            if !precise {
                // Track precise holdings apart from approximate ones from now on.
                let held = e.values().filter_map(|l| g.hash_at(l)).collect();
                g.workers[slot as usize].precise_held = held;
                return None;
            }
            let precise_held = std::mem::take(&mut w.precise_held);
            let dropped: Vec<u64> = std::mem::take(&mut w.recency)
                .keys()
                .filter(|h| !precise_held.contains(h))
                .collect();
            g.set_oldest(slot, u32::MAX);
            Some((slot, dropped))
        });
        if let Some((slot, dropped)) = dropped.flatten() {
            self.remove_in_run_order(slot, &dropped, &[], Some(worker));
        }
    }

    /// `worker`'s approximate entries, least recently touched first.
    pub fn approximate_entries(&self, worker: WorkerKey) -> Vec<u64> {
        let g = self.inner.read();
        g.names
            .slots
            .get(&worker)
            .map(|s| g.workers[*s as usize].recency.keys().collect())
            .unwrap_or_default()
    }

    /// Whether `worker` is fed by KV events.
    pub fn is_precise(&self, worker: WorkerKey) -> bool {
        let g = self.inner.read();
        g.names
            .slots
            .get(&worker)
            .is_some_and(|s| g.workers[*s as usize].precise)
    }

    /// Sets the LRU bound of `worker` in blocks (e.g. from the engine's
    /// `num_gpu_blocks`), evicting at once if it shrank. Entries expired by then
    /// (at `now`) go first; from then on its entries do not expire.
    pub fn set_capacity(&self, worker: WorkerKey, blocks: usize, now: Instant) {
        {
            let g = self.inner.read();
            if g.names
                .slots
                .get(&worker)
                .is_some_and(|s| g.workers[*s as usize].capacity == Some(blocks))
            {
                return;
            }
        }
        let now = self.stamp(now);
        self.evict(worker, now);
        {
            let mut g = self.write();
            let slot = g.slot(worker);
            g.workers[slot as usize].capacity = Some(blocks);
            g.settle_lru(slot);
        }
        self.evict(worker, now);
    }

    /// Caps `worker`'s precise entries (e.g. the engine's `num_gpu_blocks` times a
    /// slack). Entries already held stay; stores beyond the cap are dropped.
    pub fn set_precise_limit(&self, worker: WorkerKey, blocks: usize) {
        {
            let g = self.inner.read();
            if g.names
                .slots
                .get(&worker)
                .is_some_and(|s| g.workers[*s as usize].precise_limit == Some(blocks))
            {
                return;
            }
        }
        let mut g = self.write();
        let slot = g.slot(worker);
        g.workers[slot as usize].precise_limit = Some(blocks);
    }

    /// Caps `worker`'s precise entries from its engine's block count
    /// (`num_gpu_blocks`, scraped or announced) times the configured slack.
    pub fn set_engine_blocks(&self, worker: WorkerKey, num_gpu_blocks: u64) {
        let cap = (num_gpu_blocks as f64 * self.config.precise_slack).ceil();
        self.set_precise_limit(worker, cap.min(usize::MAX as f64) as usize);
    }

    /// Precise stores dropped because a worker was at its cap, since start.
    pub fn precise_dropped(&self) -> u64 {
        self.precise_dropped.load(Ordering::Relaxed)
    }

    /// The kvpick hash `worker` holds precisely under `engine_hash`.
    pub fn engine_block(&self, worker: WorkerKey, engine_hash: u64) -> Option<u64> {
        self.with_engine(worker, false, |_, e, _, _| {
            let loc = e.get(engine_hash)?;
            self.inner.read().hash_at(loc)
        })
        .flatten()
    }

    /// Precise entries (engine blocks) `worker` holds.
    pub fn precise_len(&self, worker: WorkerKey) -> usize {
        self.engines.lock().maps.get(&worker).map_or(0, |e| e.len())
    }

    /// How many leading blocks of `hashes` each worker holds (counting stops at
    /// its first miss), as an answer read per worker in O(log runs crossed)
    /// ([`Overlaps::get`]): building it costs the runs the walk crosses, not the
    /// number of workers holding the prompt.
    pub fn overlaps(&self, hashes: &[u64], now: Instant) -> Overlaps {
        let now = self.stamp(now);
        let g = self.read_for_lookup();
        let levels = g.walk(hashes);
        let mut ov = Overlaps {
            names: Arc::clone(&g.names),
            levels,
            corrected: Vec::new(),
        };
        if ov.levels.is_empty() {
            return ov;
        }
        // Workers whose oldest approximate entry expired (none until some do, and
        // only until the next purge): the walk counted those entries, recount.
        for &(oldest, slot) in &g.expiring {
            if self.alive(oldest, now) {
                break;
            }
            let depth = ov.depth(slot);
            if depth > 0 {
                let w = &g.workers[slot as usize];
                let visible = hashes[..depth]
                    .iter()
                    .take_while(|h| {
                        w.precise_held.contains(h)
                            || w.recency
                                .key(**h)
                                .is_some_and(|k| self.alive_at_key(k, now))
                    })
                    .count();
                ov.corrected.push((slot, visible));
            }
        }
        ov
    }

    /// For each candidate, how many leading blocks of `hashes` it holds (counting
    /// stops at its first miss): [`PrefixIndex::overlaps`] read per candidate.
    pub fn lookup(&self, hashes: &[u64], candidates: &[WorkerKey], now: Instant) -> Vec<usize> {
        if candidates.is_empty() || hashes.is_empty() {
            return vec![0; candidates.len()];
        }
        let ov = self.overlaps(hashes, now);
        candidates.iter().map(|k| ov.get(*k)).collect()
    }

    /// Drops expired approximate entries of every worker (lookups already ignore them).
    pub fn purge_expired(&self, now: Instant) {
        let now = self.stamp(now);
        let expired: Vec<WorkerKey> = {
            let g = self.inner.read();
            g.expiring
                .iter()
                .take_while(|(oldest, _)| !self.alive(*oldest, now))
                .filter_map(|(_, slot)| g.workers[*slot as usize].key)
                .collect()
        };
        for key in expired {
            self.evict(key, now);
        }
    }

    /// Workers the index holds anything about.
    pub fn workers(&self) -> Vec<WorkerKey> {
        self.inner.read().names.slots.keys().copied().collect()
    }

    /// Indexed (block, worker) entries.
    pub fn len(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// Whether the index holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs (stretches of blocks sharing a holder set) in the index.
    pub fn runs(&self) -> usize {
        let g = self.inner.read();
        g.runs.len() - g.free_runs.len()
    }

    /// Estimated heap bytes held by the index (walks it; for metrics and benches).
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        fn table<K, V>(capacity: usize) -> usize {
            // hashbrown: one control byte per bucket besides the slot.
            capacity * (size_of::<(K, V)>() + 1)
        }
        // The engine maps before the index's lock (lock order).
        let engines = {
            let e = self.engines.lock();
            table::<WorkerKey, BlockTable<Loc>>(e.maps.capacity())
                + e.maps.values().map(BlockTable::heap_bytes).sum::<usize>()
        };
        let g = self.inner.read();
        let mut bytes = engines
            + g.blocks.heap_bytes()
            + g.runs.capacity() * size_of::<Run>()
            + g.lineages.capacity() * size_of::<Lineage>()
            + g.only_run.capacity() * size_of::<u32>()
            + g.lineages
                .iter()
                .map(|l| l.pieces.capacity() * 4)
                .sum::<usize>()
            + table::<WorkerKey, u32>(g.names.slots.capacity())
            + g.names.keys.capacity() * size_of::<Option<WorkerKey>>()
            + g.workers.capacity() * size_of::<Worker>();
        for r in &g.runs {
            bytes += r.hashes.capacity() * 8
                + match &r.holders {
                    SlotSet::Few(v) if v.spilled() => v.capacity() * 4,
                    SlotSet::Few(_) => 0,
                    SlotSet::Many { words, .. } => words.capacity() * 8,
                };
        }
        for w in &g.workers {
            bytes += w.recency.heap_bytes()
                + table::<u64, u32>(w.extra.capacity())
                + table::<u64, ()>(w.precise_held.capacity());
        }
        bytes
    }
}

/// How long a writer or a lookup spins for the lock before yielding the core
/// between polls: a writer holds it for one chunk and a lookup or a plan for
/// one walk, microseconds all, while a thread descheduled holding it is away
/// for milliseconds.
const SPIN: Duration = Duration::from_micros(50);

/// How long a writer waits for a lookup spinning for the lock to take it: a
/// running lookup takes it within nanoseconds of the writer's last chunk.
const YIELD: Duration = Duration::from_micros(5);

/// Polls `f` until it yields or `limit` has passed.
fn spin_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    if let Some(t) = f() {
        return Some(t);
    }
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if let Some(t) = f() {
                return Some(t);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= limit {
            return None;
        }
    }
}

/// A write guard that hands the lock to waiting readers when dropped (parking_lot
/// otherwise lets a writer that releases and re-locks at once barge ahead of
/// them).
struct FairWrite<'a>(Option<RwLockWriteGuard<'a, Inner>>);

impl std::ops::Deref for FairWrite<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for FairWrite<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.0.as_mut().expect("held until drop")
    }
}

impl Drop for FairWrite<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            RwLockWriteGuard::unlock_fair(g);
        }
    }
}

/// What one chunk of a precise store does for its worker, planned from the
/// worker's engine map under the read lock
/// ([`PrefixIndex::store_engine_chain`]).
#[derive(Debug, Default)]
struct StorePlan {
    /// The blocks to hold, in chain order: the chunk, up to `stopped`.
    chain: Vec<u64>,
    /// Chain indexes of the engine hashes mapped by this chunk, with their
    /// places in the engine map (claimed by the plan for new ones; their
    /// locations are set once the write has placed the blocks).
    mapped: Vec<(usize, Place)>,
    /// Blocks that engine hashes remapped by this chunk named before it.
    released: Vec<(u64, Loc)>,
    /// Remapped engine hashes first mapped earlier in this chunk (chain index).
    released_here: Vec<usize>,
    /// Chain index of the first block beyond the worker's precise cap.
    stopped: Option<usize>,
}

impl StorePlan {
    /// Plans `chunk` for a worker whose engine map is `map` and cap `limit`: a
    /// block already stored under its engine hash is kept for the chain's
    /// context, an engine hash naming another block releases that one.
    fn make(&mut self, g: &Inner, map: &mut BlockTable<Loc>, chunk: &[(u64, u64)], limit: usize) {
        self.chain.clear();
        self.mapped.clear();
        self.released.clear();
        self.released_here.clear();
        self.stopped = None;
        // One bit per `engine % 1024` of the engine hashes mapped in this chunk
        // (1,024 bits for [`WRITE_CHUNK`] hashes: a repeat is rarely suspected
        // wrongly, and a suspected one is checked).
        let mut in_chunk = [0u64; 16];
        for (i, &(engine, hash)) in chunk.iter().enumerate() {
            let (word, bit) = ((engine >> 6) as usize % 16, 1u64 << (engine % 64));
            let earlier = if in_chunk[word] & bit != 0 {
                self.mapped
                    .iter()
                    .rev()
                    .copied()
                    .find(|&(j, _)| chunk[j].0 == engine)
            } else {
                None
            };
            let place = match earlier {
                Some((j, _)) if chunk[j].1 == hash => {
                    self.chain.push(hash);
                    continue;
                }
                Some((j, place)) => {
                    self.released_here.push(j);
                    place
                }
                None => match map.place(engine) {
                    Ok((place, l)) => {
                        match g.hash_at(l) {
                            Some(h) if h == hash => {
                                self.chain.push(hash);
                                continue;
                            }
                            Some(h) => self.released.push((h, l)),
                            None => {}
                        }
                        place
                    }
                    Err(_) if map.len() >= limit => {
                        self.stopped = Some(i);
                        break;
                    }
                    // Claimed now (one probe per block), its location set after the write.
                    Err(place) => map.claim(place, engine),
                },
            };
            in_chunk[word] |= bit;
            self.mapped.push((i, place));
            self.chain.push(hash);
        }
    }
}

impl Inner {
    /// The slot of `key`, allocating one if needed.
    fn slot(&mut self, key: WorkerKey) -> u32 {
        if let Some(s) = self.names.slots.get(&key) {
            return *s;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.workers.push(Worker::default());
                (self.workers.len() - 1) as u32
            }
        };
        self.workers[slot as usize] = Worker {
            key: Some(key),
            oldest: u32::MAX,
            ..Default::default()
        };
        let names = Arc::make_mut(&mut self.names);
        names.slots.insert(key, slot);
        let keys = &mut names.keys;
        if keys.len() <= slot as usize {
            keys.resize(slot as usize + 1, None);
        }
        keys[slot as usize] = Some(key);
        slot
    }

    /// Sets `slot`'s oldest approximate stamp, keeping `expiring` in step.
    fn set_oldest(&mut self, slot: u32, oldest: u32) {
        let w = &mut self.workers[slot as usize];
        if w.oldest == oldest {
            return;
        }
        if w.oldest != u32::MAX {
            self.expiring.remove(&(w.oldest, slot));
        }
        if oldest != u32::MAX {
            self.expiring.insert((oldest, slot));
        }
        w.oldest = oldest;
    }

    /// After `slot`'s approximate entries or capacity changed: records its
    /// oldest stamp, none for a worker whose capacity is known (its entries do
    /// not expire).
    fn settle_lru(&mut self, slot: u32) {
        let w = &self.workers[slot as usize];
        let oldest = match w.capacity {
            Some(_) => u32::MAX,
            None => w
                .recency
                .oldest()
                .map_or(u32::MAX, |(_, k)| self.clock.stamp_of(k)),
        };
        self.set_oldest(slot, oldest);
    }

    /// Loads what an approximate insert of `chunk` by `worker` will touch, under
    /// the read lock (the cache misses are then taken while lookups can still
    /// run, and the write lock is held for less): its LRU nodes, and the global
    /// slots of only the blocks its LRU does not hold yet (the insert adds
    /// holders for those alone; a repeated prompt's blocks are mostly held).
    fn warm_insert(&self, worker: WorkerKey, chunk: &[u64]) {
        match self.names.slots.get(&worker) {
            Some(&slot) => {
                let absent = self.workers[slot as usize].recency.prefetch(chunk);
                self.blocks.prefetch(absent);
            }
            None => self.blocks.prefetch(chunk),
        }
    }

    /// The run covering `loc`.
    fn run_at(&self, loc: Loc) -> Option<u32> {
        let run = match *self.only_run.get(loc.lineage as usize)? {
            u32::MAX => {
                let pieces = &self.lineages[loc.lineage as usize].pieces;
                let k = pieces.partition_point(|r| self.runs[*r as usize].start <= loc.pos);
                *pieces.get(k.checked_sub(1)?)?
            }
            run => run,
        };
        let r = &self.runs[run as usize];
        (r.start <= loc.pos && loc.pos < r.end()).then_some(run)
    }

    /// The block at `loc`.
    fn hash_at(&self, loc: Loc) -> Option<u64> {
        let r = &self.runs[self.run_at(loc)? as usize];
        r.hashes.get((loc.pos - r.start) as usize).copied()
    }

    /// The run and location of block `hash`, if it has a table entry.
    fn find(&self, hash: u64) -> Option<(u32, Loc)> {
        let loc = self.blocks.get(hash)?;
        Some((self.run_at(loc)?, loc))
    }

    /// [`Inner::find`] for a block a lookup expects to find.
    fn find_likely(&self, hash: u64) -> Option<(u32, Loc)> {
        let loc = self.blocks.get_likely_present(hash)?;
        Some((self.run_at(loc)?, loc))
    }

    /// Gives block `hash` at `loc` a table entry.
    fn index_block(&mut self, hash: u64, loc: Loc) {
        if let Some(run) = self.run_at(loc) {
            self.runs[run as usize].indexed = true;
            self.blocks.insert(hash, loc);
        }
    }

    /// Block `hash` if it sits right after `prev`.
    fn successor(&self, prev: Loc, hash: u64) -> Option<(u32, Loc)> {
        let loc = Loc {
            lineage: prev.lineage,
            pos: prev.pos + 1,
        };
        let run = self.run_at(loc)?;
        let r = &self.runs[run as usize];
        (r.hashes[(loc.pos - r.start) as usize] == hash).then_some((run, loc))
    }

    /// Where block `hash` is: right after `prev` when given, else by its table entry.
    fn locate(&self, prev: Option<Loc>, hash: u64) -> Option<(u32, Loc)> {
        prev.and_then(|p| self.successor(p, hash))
            .or_else(|| self.find(hash))
    }

    /// Drops one precise reference of `slot` to each block; a block loses the
    /// holder when its last reference goes and no approximate entry keeps it.
    fn release_precise(&mut self, slot: u32, blocks: &[(u64, Loc)], entries: &AtomicUsize) {
        let mut gone = Vec::new();
        let w = &mut self.workers[slot as usize];
        for &(h, loc) in blocks {
            if let Some(n) = w.extra.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    w.extra.remove(&h);
                }
                continue;
            }
            if !w.precise {
                w.precise_held.remove(&h);
                if w.recency.contains(h) {
                    // An approximate entry remains: the holder stays for it.
                    continue;
                }
            }
            gone.push((h, loc));
        }
        self.remove_holder_runs(&gone, slot, entries);
    }

    fn new_lineage(&mut self) -> u32 {
        self.free_lineages.pop().unwrap_or_else(|| {
            self.lineages.push(Lineage { pieces: Vec::new() });
            self.only_run.push(u32::MAX);
            (self.lineages.len() - 1) as u32
        })
    }

    /// Stores `run` and lists it among its lineage's pieces.
    fn new_run(&mut self, run: Run) -> u32 {
        let id = match self.free_runs.pop() {
            Some(r) => {
                self.runs[r as usize] = run;
                r
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        };
        let (k, l) = self.piece_of(id);
        self.lineages[l as usize].pieces.insert(k, id);
        self.settle_lineage(l);
        id
    }

    /// Where `run` goes (or is) among its lineage's pieces, and the lineage.
    fn piece_of(&self, run: u32) -> (usize, u32) {
        let r = &self.runs[run as usize];
        let pieces = &self.lineages[r.lineage as usize].pieces;
        let k = pieces.partition_point(|p| self.runs[*p as usize].start < r.start);
        (k, r.lineage)
    }

    /// Takes `run` out of its lineage's pieces (freeing an emptied lineage).
    fn unlist(&mut self, run: u32) {
        let (k, l) = self.piece_of(run);
        let pieces = &mut self.lineages[l as usize].pieces;
        debug_assert_eq!(pieces.get(k), Some(&run));
        pieces.remove(k);
        if pieces.is_empty() {
            pieces.shrink_to_fit();
            self.free_lineages.push(l);
        }
        self.settle_lineage(l);
    }

    /// Records in `only_run` whether lineage `l` has one run.
    fn settle_lineage(&mut self, l: u32) {
        self.only_run[l as usize] = match self.lineages[l as usize].pieces.as_slice() {
            [run] => *run,
            _ => u32::MAX,
        };
    }

    /// Forgets `run` (no holder left) and its blocks' table entries.
    fn free_run(&mut self, run: u32) {
        self.unlist(run);
        let r = std::mem::take(&mut self.runs[run as usize]);
        if r.indexed {
            self.blocks.prefetch(&r.hashes);
            for h in &r.hashes {
                self.blocks.remove(*h);
            }
        } else if let Some(h) = r.hashes.front() {
            self.blocks.remove(*h);
        }
        self.free_runs.push(run);
    }

    /// Splits `run` before absolute position `at` (strictly inside it), moving the
    /// shorter side to a new run; returns (left, right) run ids. Positions stay,
    /// so no table entry moves; the right side's first block gets one.
    fn split(&mut self, run: u32, at: u32) -> (u32, u32) {
        let r = &mut self.runs[run as usize];
        let left_len = (at - r.start) as usize;
        let (holders, lineage, indexed) = (r.holders.clone(), r.lineage, r.indexed);
        let (left, right) = if left_len <= r.hashes.len() - left_len {
            let hashes: VecDeque<u64> = r.hashes.drain(..left_len).collect();
            let start = r.start;
            r.start = at;
            let id = self.new_run(Run {
                start,
                hashes,
                holders,
                lineage,
                indexed,
            });
            (id, run)
        } else {
            let hashes = r.hashes.split_off(left_len);
            r.hashes.shrink_to_fit();
            let id = self.new_run(Run {
                start: at,
                hashes,
                holders,
                lineage,
                indexed,
            });
            (run, id)
        };
        let first = self.runs[right as usize].hashes[0];
        self.blocks.insert(first, Loc { lineage, pos: at });
        (left, right)
    }

    /// The run holding exactly positions `from..to` of `run`, splitting as needed.
    fn isolate(&mut self, mut run: u32, from: u32, to: u32) -> u32 {
        if from > self.runs[run as usize].start {
            run = self.split(run, from).1;
        }
        if to < self.runs[run as usize].end() {
            run = self.split(run, to).0;
        }
        run
    }

    /// Appends run `right` to the run ending with block `prev` when it is the next
    /// piece of the same lineage with the same holders and not the longer one
    /// (writes cut into chunks would otherwise leave a shared prefix in pieces).
    fn merge_after(&mut self, prev: Loc, right: u32) {
        let Some(left) = self.run_at(prev) else {
            return;
        };
        let (l, r) = (&self.runs[left as usize], &self.runs[right as usize]);
        if left == right
            || l.lineage != r.lineage
            || prev.pos + 1 != l.end()
            || r.start != l.end()
            || r.hashes.len() > l.hashes.len()
            || l.holders != r.holders
        {
            return;
        }
        self.unlist(right);
        let moved = std::mem::take(&mut self.runs[right as usize]);
        let l = &mut self.runs[left as usize];
        if !(l.indexed || moved.indexed) {
            // Its first block no longer starts a run.
            self.blocks.remove(moved.hashes[0]);
        }
        l.indexed |= moved.indexed;
        l.hashes.extend(moved.hashes);
        self.free_runs.push(right);
    }

    /// The longest stretch of `hashes` (from its start) lying at consecutive
    /// positions of `run`, starting at `loc`.
    fn stretch(&self, run: u32, loc: Loc, hashes: &[u64]) -> usize {
        let r = &self.runs[run as usize];
        let i = (loc.pos - r.start) as usize;
        hashes
            .iter()
            .zip(r.hashes.range(i..))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Adds `slot` as holder of each block of `chain` (in chain order, following
    /// block `prev`: (hash, location)), creating the missing blocks; pushes each
    /// block's location and whether `slot` held it already to `placed` (a block
    /// twice in `chain` is held the second time). With `index_all` every block of
    /// `chain` gets a table entry, else only the first of each run.
    fn add_holder_runs(
        &mut self,
        chain: &[u64],
        prev: Option<(u64, Loc)>,
        slot: u32,
        index_all: bool,
        placed: &mut Vec<(Loc, bool)>,
        entries: &AtomicUsize,
    ) {
        let index_all = index_all || !self.chained;
        // Where the previous block of the chain lives (checked: it may have gone
        // while the lock was let go between chunks).
        let mut prev: Option<Loc> = prev.and_then(|(h, l)| {
            (self.hash_at(l) == Some(h))
                .then_some(l)
                .or_else(|| self.blocks.get(h))
        });
        let mut i = 0;
        while i < chain.len() {
            match self.locate(prev, chain[i]) {
                Some((run, loc)) => {
                    let n = self.stretch(run, loc, &chain[i..]);
                    let held = self.runs[run as usize].holders.contains(slot);
                    let mid = if held {
                        run
                    } else {
                        let mid = self.isolate(run, loc.pos, loc.pos + n as u32);
                        self.runs[mid as usize].holders.insert(slot);
                        entries.fetch_add(n, Ordering::Relaxed);
                        mid
                    };
                    if index_all && self.chained && !held {
                        self.runs[mid as usize].indexed = true;
                        for (k, h) in chain[i..i + n].iter().enumerate() {
                            let pos = loc.pos + k as u32;
                            self.blocks.insert(*h, Loc { pos, ..loc });
                        }
                    }
                    placed.extend((0..n as u32).map(|k| {
                        let pos = loc.pos + k;
                        (Loc { pos, ..loc }, held)
                    }));
                    let last = Loc {
                        pos: loc.pos + n as u32 - 1,
                        ..loc
                    };
                    if !held {
                        if let Some(p) = prev {
                            self.merge_after(p, mid);
                        }
                    }
                    i += n;
                    prev = Some(last);
                }
                None => {
                    let (n, loc) = self.add_new_blocks(&chain[i..], prev, slot, index_all, entries);
                    placed.extend((0..n as u32).map(|k| {
                        let pos = loc.pos + k;
                        (Loc { pos, ..loc }, false)
                    }));
                    i += n;
                    prev = Some(Loc {
                        pos: loc.pos + n as u32 - 1,
                        ..loc
                    });
                }
            }
        }
    }

    /// Creates the leading blocks of `chain` that the index does not have yet
    /// (`chain[0]` is known to be new), held by `slot`: right after `prev` when
    /// that ends its lineage (appended to its run when `slot` alone holds it, else
    /// a new run there), else as a new lineage. Returns how many and where the
    /// first went.
    fn add_new_blocks(
        &mut self,
        chain: &[u64],
        prev: Option<Loc>,
        slot: u32,
        index_all: bool,
        entries: &AtomicUsize,
    ) -> (usize, Loc) {
        let after = prev.and_then(|p| {
            let run = self.run_at(p)?;
            let r = &self.runs[run as usize];
            let last = self.lineages[r.lineage as usize].pieces.last() == Some(&run);
            (last && p.pos + 1 == r.end()).then_some((run, r.lineage, p.pos + 1))
        });
        let (run, loc) = match after {
            Some((run, lineage, pos)) if self.runs[run as usize].holders.is_only(slot) => {
                (run, Loc { lineage, pos })
            }
            _ => {
                let loc = match after {
                    Some((_, lineage, pos)) => Loc { lineage, pos },
                    None => Loc {
                        lineage: self.new_lineage(),
                        pos: 0,
                    },
                };
                let run = self.new_run(Run {
                    start: loc.pos,
                    hashes: VecDeque::with_capacity(chain.len()),
                    holders: SlotSet::one(slot),
                    lineage: loc.lineage,
                    indexed: index_all,
                });
                // The first block of a run always has an entry.
                self.blocks.insert(chain[0], loc);
                (run, loc)
            }
        };
        let n = if index_all {
            // Up to the first block met again (a repeat in `chain`, or a known one).
            self.blocks.reserve(chain.len());
            self.blocks.prefetch(chain);
            let mut n = 0u32;
            for h in chain {
                let at = Loc {
                    pos: loc.pos + n,
                    ..loc
                };
                if !self.blocks.insert_new(*h, at) && self.blocks.get(*h) != Some(at) {
                    break;
                }
                n += 1;
            }
            self.runs[run as usize].indexed = true;
            n as usize
        } else {
            // Chained: a block after a new one can only exist as some run's first
            // block, which has an entry.
            1 + chain[1..]
                .iter()
                .take_while(|h| self.blocks.get(**h).is_none())
                .count()
        };
        self.runs[run as usize].hashes.extend(&chain[..n]);
        entries.fetch_add(n, Ordering::Relaxed);
        (n, loc)
    }

    /// Removes `slot` as holder of each of these blocks (found by their table
    /// entries) it holds.
    fn remove_hashes(&mut self, hashes: &[u64], slot: u32, entries: &AtomicUsize) {
        let blocks: Vec<(u64, Loc)> = hashes
            .iter()
            .filter_map(|h| self.blocks.get(*h).map(|l| (*h, l)))
            .collect();
        self.remove_holder_runs(&blocks, slot, entries);
    }

    /// Removes `slot` as holder of each block (hash, location) it holds; blocks
    /// left with no holder are forgotten. A location no longer holding its hash
    /// is skipped.
    fn remove_holder_runs(&mut self, blocks: &[(u64, Loc)], slot: u32, entries: &AtomicUsize) {
        let mut i = 0;
        while i < blocks.len() {
            let (h, loc) = blocks[i];
            let Some(run) = self.run_at(loc).filter(|_| self.hash_at(loc) == Some(h)) else {
                i += 1;
                continue;
            };
            let hashes: Vec<u64> = blocks[i..]
                .iter()
                .enumerate()
                .take_while(|(k, (_, l))| l.lineage == loc.lineage && l.pos == loc.pos + *k as u32)
                .map(|(_, (h, _))| *h)
                .collect();
            let n = self.stretch(run, loc, &hashes);
            i += n;
            if !self.runs[run as usize].holders.contains(slot) {
                continue;
            }
            let mid = self.isolate(run, loc.pos, loc.pos + n as u32);
            let r = &mut self.runs[mid as usize];
            r.holders.remove(slot);
            entries.fetch_sub(n, Ordering::Relaxed);
            if r.holders.is_empty() {
                self.free_run(mid);
            }
        }
    }

    /// Walks `hashes` run by run: returns the holder sets of the first block
    /// shrinking at run boundaries, each (set, leading blocks its members hold),
    /// every set a subset of the one before.
    fn walk(&self, hashes: &[u64]) -> Levels {
        let mut levels = Levels::new();
        let Some((mut run, mut loc)) = hashes.first().and_then(|h| self.find_likely(*h)) else {
            return levels;
        };
        // Borrowed until a boundary narrows it: most walks never copy a set but
        // the last.
        let mut active = Cow::Borrowed(&self.runs[run as usize].holders);
        let mut i = 1usize;
        while i < hashes.len() {
            let r = &self.runs[run as usize];
            let off = ((loc.pos + 1 - r.start) as usize).min(r.hashes.len());
            // The run after this one if the prompt follows it to its end, found
            // (and its first blocks loaded) before this run is compared: the two
            // chains of cache misses then overlap instead of queueing.
            let end = i + r.hashes.len() - off;
            let ahead = hashes.get(end).and_then(|h| self.find_likely(*h));
            if let Some((next, _)) = ahead {
                std::hint::black_box(self.runs[next as usize].hashes.front().copied());
            }
            let same = hashes[i..]
                .iter()
                .zip(r.hashes.range(off..))
                .take_while(|(a, b)| a == b)
                .count();
            i += same;
            if i == hashes.len() {
                break;
            }
            // The next block starts a run (or is unknown).
            let found = if i == end {
                ahead
            } else {
                self.find_likely(hashes[i])
            };
            let Some((next, at)) = found else {
                break;
            };
            if next != run {
                if let Some(kept) = active.narrowed_by(&self.runs[next as usize].holders) {
                    levels.push((
                        std::mem::replace(&mut active, Cow::Owned(kept)).into_owned(),
                        i as u32,
                    ));
                    if active.is_empty() {
                        return levels;
                    }
                }
            }
            run = next;
            loc = at;
            i += 1;
        }
        levels.push((active.into_owned(), i as u32));
        levels
    }
}

/// A walk's holder sets with their depths (most walks have one or two).
type Levels = SmallVec<[(SlotSet, u32); 2]>;

/// Every worker's overlap with one prompt ([`PrefixIndex::overlaps`]): nested
/// holder sets with their depths, read per worker without the index's lock.
#[derive(Debug, Clone)]
pub struct Overlaps {
    /// The index's slots when the answer was made.
    names: Arc<SlotNames>,
    /// (holders, leading blocks held), each set a subset of the one before.
    levels: Levels,
    /// (slot, depth) for workers whose expired approximate entries the walk counted.
    corrected: Vec<(u32, usize)>,
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

    fn visible(&self, slot: u32) -> usize {
        match self.corrected.iter().find(|(s, _)| *s == slot) {
            Some((_, d)) => *d,
            None => self.depth(slot),
        }
    }

    /// Depth the walk found for `slot`: that of the last (smallest) set holding it.
    fn depth(&self, slot: u32) -> usize {
        let k = self.levels.partition_point(|(set, _)| set.contains(slot));
        k.checked_sub(1).map_or(0, |k| self.levels[k].1 as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};
    use std::sync::Arc;

    fn wk(i: u64) -> WorkerKey {
        WorkerKey {
            instance_id: i,
            dp_rank: 0,
        }
    }

    /// An index for arbitrary (not chained) hashes.
    fn index(cap: usize, ttl_secs: Option<u64>) -> (PrefixIndex, Instant) {
        config_index(cap, ttl_secs, false)
    }

    fn config_index(cap: usize, ttl_secs: Option<u64>, chained: bool) -> (PrefixIndex, Instant) {
        let base = Instant::now();
        let idx = PrefixIndex::with_base(
            IndexConfig {
                default_capacity: cap,
                ttl: ttl_secs.map(Duration::from_secs),
                chained,
                ..IndexConfig::default()
            },
            base,
        );
        (idx, base)
    }

    #[test]
    fn lookup_counts_leading_blocks_only() {
        let (idx, t) = index(100, None);
        idx.insert(wk(1), &[1, 2, 3], t);
        idx.insert(wk(2), &[1, 9, 3], t);
        let r = idx.lookup(&[1, 2, 3, 4], &[wk(1), wk(2), wk(3)], t);
        assert_eq!(r, vec![3, 1, 0]);
        assert_eq!(idx.lookup(&[5, 1], &[wk(1)], t), vec![0]);
        assert_eq!(idx.len(), 6);
    }

    #[test]
    fn a_slot_hint_is_checked_so_a_stale_one_never_reads_another_worker() {
        let (idx, t) = index(100, None);
        idx.insert(wk(1), &[1, 2, 3], t);
        idx.insert(wk(2), &[1, 2], t);
        let ov = idx.overlaps(&[1, 2, 3], t);
        // A wrong hint costs a probe and is corrected to the worker's slot.
        let hint = AtomicU32::new(u32::MAX);
        assert_eq!(ov.get_hinted(wk(2), &hint), 2);
        let slot2 = hint.load(Ordering::Relaxed);
        assert_ne!(slot2, u32::MAX);
        assert_eq!(ov.get_hinted(wk(2), &hint), 2);
        // Worker 1's hint pointing at worker 2's slot still reads worker 1.
        let wrong = AtomicU32::new(slot2);
        assert_eq!(ov.get_hinted(wk(1), &wrong), 3);
        assert_ne!(wrong.load(Ordering::Relaxed), slot2);
        // Worker 2 leaves and worker 3 takes its slot: 2's hint now names a slot
        // that belongs to 3, and reads nothing for 2.
        idx.clear_worker(wk(2));
        idx.insert(wk(3), &[1], t);
        let ov = idx.overlaps(&[1, 2, 3], t);
        assert_eq!(ov.get_hinted(wk(3), &AtomicU32::new(slot2)), 1);
        assert_eq!(ov.get_hinted(wk(2), &hint), 0);
        assert_eq!(ov.get(wk(2)), 0);
    }

    #[test]
    fn lru_bound_evicts_least_recently_used() {
        let (idx, t) = index(3, None);
        idx.insert(wk(1), &[1, 2, 3], t);
        idx.insert(wk(1), &[1], t); // touch 1: 2 is now the oldest
        idx.insert(wk(1), &[4], t);
        assert_eq!(idx.lookup(&[1], &[wk(1)], t), vec![1]);
        assert_eq!(idx.lookup(&[2], &[wk(1)], t), vec![0]);
        assert_eq!(idx.lookup(&[3, 4], &[wk(1)], t), vec![2]);
        assert_eq!(idx.len(), 3);
        idx.set_capacity(wk(1), 1, t);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.lookup(&[4], &[wk(1)], t), vec![1]);
    }

    #[test]
    fn a_prompt_longer_than_the_capacity_keeps_its_prefix() {
        let (idx, t) = index(3, None);
        idx.insert(wk(1), &[1, 2, 3, 4, 5], t);
        // Recording all five would have kept 3, 4, 5 and lost the prefix.
        assert_eq!(idx.lookup(&[1, 2, 3, 4, 5], &[wk(1)], t), vec![3]);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn a_chain_recorded_this_second_is_not_touched_again_until_the_next() {
        let (idx, t) = index(6, None);
        let (a, b, c) = ([1, 2], [3, 4], [5, 6]);
        idx.insert_chain(wk(1), &a, t);
        idx.insert_chain(wk(1), &b, t);
        // Held from this second: left as it is, so a stays the oldest.
        idx.insert_chain(wk(1), &a, t + Duration::from_millis(500));
        idx.insert_chain(wk(1), &c, t);
        idx.insert_chain(wk(1), &[7, 8], t);
        assert_eq!(idx.lookup(&a, &[wk(1)], t), vec![0]);
        assert_eq!(idx.lookup(&b, &[wk(1)], t), vec![2]);
        // A longer chain is recorded: its last block is new.
        idx.insert_chain(wk(1), &[3, 4, 9], t);
        assert_eq!(idx.lookup(&[3, 4, 9], &[wk(1)], t), vec![3]);
        // In the next second the same chain is touched again: b becomes the newest.
        let later = t + Duration::from_secs(1);
        idx.insert_chain(wk(1), &b, later);
        idx.insert_chain(wk(1), &[10, 11, 12, 13], later);
        assert_eq!(idx.lookup(&b, &[wk(1)], later), vec![2]);
        assert_eq!(idx.lookup(&[3, 4, 9], &[wk(1)], later), vec![2]);
        assert_eq!(idx.len(), 6);
    }

    #[test]
    fn lru_order_survives_compacting_repeated_touches() {
        let (idx, t) = index(20, None);
        let (a, b, c): (Vec<u64>, Vec<u64>, Vec<u64>) =
            ((1..=10).collect(), (11..=20).collect(), (21..=30).collect());
        idx.insert(wk(1), &b, t);
        // 500 touches of a while b stays untouched.
        for _ in 0..50 {
            idx.insert(wk(1), &a, t);
        }
        // Over capacity: the least recently touched (b) goes, a and c stay.
        idx.insert(wk(1), &c, t);
        assert_eq!(idx.lookup(&a, &[wk(1)], t), vec![10]);
        assert_eq!(idx.lookup(&b, &[wk(1)], t), vec![0]);
        assert_eq!(idx.lookup(&c, &[wk(1)], t), vec![10]);
        assert_eq!(idx.len(), 20);
    }

    #[test]
    fn ttl_expires_approximate_entries() {
        let (idx, t) = index(100, Some(10));
        idx.insert(wk(1), &[1, 2], t);
        idx.insert(wk(1), &[1], t + Duration::from_secs(8));
        let later = t + Duration::from_secs(12);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1)], later), vec![1]);
        idx.purge_expired(later);
        assert_eq!(idx.len(), 1);
        idx.purge_expired(t + Duration::from_secs(30));
        assert!(idx.is_empty());
    }

    #[test]
    fn entries_expire_by_ttl_only_until_the_capacity_is_known() {
        let (idx, t) = index(100, Some(10));
        idx.insert(wk(1), &[1, 2], t);
        idx.insert(wk(2), &[1, 2], t);
        idx.set_capacity(wk(1), 50, t + Duration::from_secs(5));
        let later = t + Duration::from_secs(1000);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1), wk(2)], later), vec![2, 0]);
        idx.purge_expired(later);
        assert_eq!(idx.len(), 2);
        // Expired before the capacity came: gone, not brought back.
        idx.set_capacity(wk(2), 50, later);
        assert_eq!(idx.lookup(&[1, 2], &[wk(2)], later), vec![0]);
        // The bound still evicts.
        idx.insert(wk(1), &(10..60).collect::<Vec<_>>(), later);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1)], later), vec![0]);
    }

    #[test]
    fn precise_workers_take_events_not_decisions() {
        let (idx, t) = index(100, Some(10));
        idx.insert(wk(1), &[1, 2], t);
        idx.set_precise(wk(1), true);
        assert!(idx.is_precise(wk(1)));
        assert!(idx.is_empty(), "approximate entries dropped");
        idx.insert(wk(1), &[1, 2], t);
        assert!(
            idx.is_empty(),
            "decisions do not insert for precise workers"
        );
        idx.store_engine_chain(wk(1), None, &[(100, 1), (200, 2)], t);
        // Precise entries do not expire.
        let much_later = t + Duration::from_secs(1000);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1)], much_later), vec![2]);
        idx.remove_engine_blocks(wk(1), &[200, 999]);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1)], much_later), vec![1]);
        idx.clear_worker(wk(1));
        assert!(idx.is_empty());
        assert!(!idx.is_precise(wk(1)));
        assert_eq!(idx.lookup(&[1], &[wk(1)], t), vec![0]);
    }

    #[test]
    fn forget_drops_approximate_entries_only() {
        let (idx, t) = index(100, None);
        idx.insert(wk(1), &[1, 2, 3], t);
        idx.store_engine_chain(wk(1), None, &[(20, 2)], t);
        idx.store_engine_chain(wk(2), None, &[(10, 1), (20, 2)], t);
        idx.set_precise(wk(2), true);
        idx.forget(wk(1), &[2, 3, 4]);
        idx.forget(wk(2), &[1, 2]);
        idx.forget(wk(3), &[1]);
        // Block 2 stays held precisely; 3 is gone; the precise worker is untouched.
        assert_eq!(idx.lookup(&[1, 2, 3], &[wk(1), wk(2)], t), vec![2, 2]);
        assert_eq!(idx.len(), 4);
        idx.remove_engine_blocks(wk(1), &[20]);
        assert_eq!(idx.lookup(&[1, 2], &[wk(1)], t), vec![1]);
        // The forgotten entries no longer count against the capacity.
        idx.set_capacity(wk(1), 1, t);
        assert_eq!(idx.lookup(&[1], &[wk(1)], t), vec![1]);
    }

    /// A lookup announced as spinning for the lock but never taking it (it was
    /// descheduled) is waited for once, not on every chunk after.
    #[test]
    fn writers_wait_once_for_a_lookup_that_does_not_come() {
        let (idx, t) = index(100, None);
        idx.lookups_waiting.fetch_add(1, Ordering::SeqCst);
        idx.lookups_announced.fetch_add(1, Ordering::SeqCst);
        idx.insert(wk(1), &[1], t);
        assert_eq!(idx.writers_gave_up_at.load(Ordering::SeqCst), 1);
        // Still announced: the next writes go on without waiting (nothing to
        // observe but that they finish and keep the mark).
        for h in 2..100 {
            idx.insert(wk(1), &[h], t);
        }
        assert_eq!(idx.writers_gave_up_at.load(Ordering::SeqCst), 1);
        // A new lookup spinning for the lock is waited for again.
        idx.lookups_announced.fetch_add(1, Ordering::SeqCst);
        idx.insert(wk(1), &[100], t);
        assert_eq!(idx.writers_gave_up_at.load(Ordering::SeqCst), 2);
        idx.lookups_waiting.fetch_sub(1, Ordering::SeqCst);
        assert_eq!(idx.lookup(&[1], &[wk(1)], t), vec![1]);
    }

    #[test]
    fn dp_ranks_are_separate_holders() {
        let (idx, t) = config_index(100, None, true);
        let r0 = WorkerKey {
            instance_id: 7,
            dp_rank: 0,
        };
        let r1 = WorkerKey {
            instance_id: 7,
            dp_rank: 1,
        };
        idx.store_engine_chain(r0, None, &[(1, 10), (2, 20)], t);
        idx.store_engine_chain(r1, None, &[(1, 10)], t);
        assert_eq!(idx.lookup(&[10, 20], &[r0, r1], t), vec![2, 1]);
        idx.clear_worker(r0);
        assert_eq!(idx.lookup(&[10, 20], &[r0, r1], t), vec![0, 1]);
    }

    #[test]
    fn shared_prefix_is_one_run_and_splits_on_partial_removal() {
        let (idx, t) = config_index(100, None, true);
        let prefix: Vec<u64> = (100..228).collect();
        for w in 0..100 {
            let blocks: Vec<(u64, u64)> = prefix.iter().map(|h| (*h, *h)).collect();
            idx.store_engine_chain(wk(w), None, &blocks, t);
        }
        assert_eq!(
            idx.runs(),
            1,
            "one run, one holder set for 128 blocks × 100 workers"
        );
        assert_eq!(idx.len(), 12_800);
        idx.remove_engine_blocks(wk(3), &[150]);
        assert_eq!(idx.runs(), 3);
        let all: Vec<WorkerKey> = (0..100).map(wk).collect();
        let counts = idx.lookup(&prefix, &all, t);
        assert_eq!(counts[3], 50);
        assert!(counts.iter().enumerate().all(|(i, c)| i == 3 || *c == 128));
        let ov = idx.overlaps(&prefix, t);
        assert_eq!(ov.iter().count(), 100);
        assert_eq!(ov.get(wk(3)), 50);
        assert_eq!(ov.get(wk(100)), 0);
    }

    #[test]
    fn precise_cap_drops_and_counts_a_flood_of_stored_blocks() {
        let (idx, t) = config_index(100, None, true);
        let w = wk(1);
        idx.set_precise(w, true);
        idx.set_precise_limit(w, 1_000);
        // A publisher flooding BlockStored: 50 events of 100 new blocks each.
        for e in 0..50u64 {
            let blocks: Vec<(u64, u64)> =
                (0..100).map(|i| (e * 100 + i, mix(e * 100 + i))).collect();
            idx.store_engine_chain(w, None, &blocks, t);
        }
        assert_eq!(idx.precise_len(w), 1_000);
        assert_eq!(idx.len(), 1_000);
        assert_eq!(idx.precise_dropped(), 4_000);
        // Evictions make room again.
        let evicted: Vec<u64> = (0..100).collect();
        idx.remove_engine_blocks(w, &evicted);
        idx.store_engine_chain(w, None, &[(9_999_999, 42)], t);
        assert_eq!(idx.precise_len(w), 901);
    }

    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn memory_estimate_grows_with_entries() {
        let (idx, t) = index(100_000, None);
        let empty = idx.memory_bytes();
        let hashes: Vec<u64> = (0..10_000).collect();
        idx.insert(wk(1), &hashes, t);
        assert!(idx.memory_bytes() > empty + 10_000 * 16);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, Vec<u64>),
        Store(u64, Vec<(u64, u64)>),
        /// A store following the block held under an engine hash.
        Chain(u64, Option<u64>, Vec<(u64, u64)>),
        Remove(u64, Vec<u64>),
        Forget(u64, Vec<u64>),
        Clear(u64),
        Capacity(u64, usize),
        Precise(u64, bool),
        Advance(u64),
        Lookup(Vec<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let w = 0u64..4;
        let h = 0u64..12;
        prop_oneof![
            4 => (w.clone(), prop::collection::vec(h.clone(), 1..6)).prop_map(|(w, v)| Op::Insert(w, v)),
            2 => (w.clone(), prop::collection::vec((0u64..20, h.clone()), 1..4)).prop_map(|(w, v)| Op::Store(w, v)),
            1 => (w.clone(), prop::collection::vec(0u64..20, 1..4)).prop_map(|(w, v)| Op::Remove(w, v)),
            1 => (w.clone(), prop::collection::vec(h.clone(), 1..4)).prop_map(|(w, v)| Op::Forget(w, v)),
            1 => w.clone().prop_map(Op::Clear),
            1 => (w.clone(), 1usize..8).prop_map(|(w, c)| Op::Capacity(w, c)),
            1 => (w.clone(), any::<bool>()).prop_map(|(w, p)| Op::Precise(w, p)),
            1 => (0u64..6).prop_map(Op::Advance),
            3 => prop::collection::vec(h, 0..8).prop_map(Op::Lookup),
        ]
    }

    /// A naive model: per worker an LRU list (oldest first) of (hash, touched secs)
    /// for approximate entries, and an engine-hash map for precise ones.
    #[derive(Default, Clone)]
    struct Model {
        lru: Vec<(u64, u64)>,
        engine: HashMap<u64, u64>,
        capacity: Option<usize>,
        precise: bool,
    }

    const CAP: usize = 5;
    const TTL: u64 = 7;

    impl Model {
        fn holds(&self, h: u64, now: u64) -> bool {
            self.engine.values().any(|v| *v == h)
                || self.lru.iter().any(|(x, t)| *x == h && self.alive(*t, now))
        }
        /// Entries of a worker with a known capacity do not expire.
        fn alive(&self, t: u64, now: u64) -> bool {
            self.capacity.is_some() || now - t < TTL
        }
        fn evict(&mut self, now: u64) {
            let cap = self.capacity.unwrap_or(CAP);
            while let Some(&(_, t)) = self.lru.first() {
                if self.lru.len() > cap || !self.alive(t, now) {
                    self.lru.remove(0);
                } else {
                    break;
                }
            }
        }
    }

    fn apply(
        idx: &PrefixIndex,
        model: &mut HashMap<u64, Model>,
        op: &Op,
        base: Instant,
        now: &mut u64,
    ) -> Option<(Vec<usize>, Vec<usize>)> {
        let at = base + Duration::from_secs(*now);
        match op.clone() {
            Op::Insert(w, hs) => {
                idx.insert(wk(w), &hs, at);
                let m = model.entry(w).or_default();
                if !m.precise {
                    // Only the leading blocks that fit are recorded.
                    let fit = m.capacity.unwrap_or(CAP);
                    for h in hs.into_iter().take(fit) {
                        m.lru.retain(|(x, _)| *x != h);
                        m.lru.push((h, *now));
                    }
                    m.evict(*now);
                }
            }
            Op::Store(w, bs) => {
                idx.store_engine_chain(wk(w), None, &bs, at);
                let m = model.entry(w).or_default();
                for (e, h) in bs {
                    m.engine.insert(e, h);
                }
            }
            Op::Chain(w, parent, bs) => {
                idx.store_engine_chain(wk(w), parent, &bs, at);
                let m = model.entry(w).or_default();
                // Chained, a store whose parent the worker does not hold is not applied.
                if parent.is_none_or(|p| m.engine.contains_key(&p)) {
                    for (e, h) in bs {
                        m.engine.insert(e, h);
                    }
                }
            }
            Op::Remove(w, es) => {
                idx.remove_engine_blocks(wk(w), &es);
                if let Some(m) = model.get_mut(&w) {
                    for e in es {
                        m.engine.remove(&e);
                    }
                }
            }
            Op::Forget(w, hs) => {
                idx.forget(wk(w), &hs);
                if let Some(m) = model.get_mut(&w) {
                    m.lru.retain(|(x, _)| !hs.contains(x));
                }
            }
            Op::Clear(w) => {
                idx.clear_worker(wk(w));
                model.remove(&w);
            }
            Op::Capacity(w, c) => {
                idx.set_capacity(wk(w), c, at);
                let m = model.entry(w).or_default();
                // Expired entries go first; then the bound is by size alone.
                m.evict(*now);
                m.capacity = Some(c);
                m.evict(*now);
            }
            Op::Precise(w, p) => {
                idx.set_precise(wk(w), p);
                let m = model.entry(w).or_default();
                if p && !m.precise {
                    m.lru.clear();
                }
                m.precise = p;
            }
            Op::Advance(s) => *now += s,
            Op::Lookup(hs) => {
                let cands: Vec<WorkerKey> = (0..4).map(wk).collect();
                let got = idx.lookup(&hs, &cands, at);
                let want: Vec<usize> = (0..4u64)
                    .map(|w| {
                        let m = model.get(&w).cloned().unwrap_or_default();
                        hs.iter().take_while(|h| m.holds(**h, *now)).count()
                    })
                    .collect();
                // The whole answer lists exactly the workers with a nonzero overlap.
                let mut every: Vec<(WorkerKey, usize)> = idx.overlaps(&hs, at).iter().collect();
                every.sort_unstable_by_key(|(k, _)| k.instance_id);
                let nonzero: Vec<(WorkerKey, usize)> = cands
                    .iter()
                    .copied()
                    .zip(want.iter().copied())
                    .filter(|(_, d)| *d > 0)
                    .collect();
                assert_eq!(every, nonzero, "overlaps() after {op:?}");
                return Some((got, want));
            }
        }
        None
    }

    fn model_pairs(model: &HashMap<u64, Model>, now: u64) -> usize {
        let mut pairs = HashSet::new();
        for (w, m) in model {
            for (h, t) in &m.lru {
                if m.alive(*t, now) {
                    pairs.insert((*w, *h));
                }
            }
            for h in m.engine.values() {
                pairs.insert((*w, *h));
            }
        }
        pairs.len()
    }

    proptest! {
        #[test]
        fn index_agrees_with_naive_model(ops in prop::collection::vec(op(), 1..80), precise_w in 0u64..5) {
            let (idx, base) = index(CAP, Some(TTL));
            let mut model: HashMap<u64, Model> = HashMap::new();
            let mut now = 0u64;
            // One worker (maybe none: 4) runs in precise mode from the start.
            if precise_w < 4 {
                idx.set_precise(wk(precise_w), true);
                model.entry(precise_w).or_default().precise = true;
            }
            for op in &ops {
                if let Some((got, want)) = apply(&idx, &mut model, op, base, &mut now) {
                    prop_assert_eq!(got, want, "after {:?}", op);
                }
            }
            // The entry count matches the distinct (block, worker) pairs still tracked.
            idx.purge_expired(base + Duration::from_secs(now));
            prop_assert_eq!(idx.len(), model_pairs(&model, now));
        }

        /// Chained hashes (each block follows one parent wherever it is), with
        /// only run starts in the block table: stores name their parent, prompts
        /// start at their first block, and chains share prefixes, so runs split,
        /// append, merge within a lineage and meet blocks stored inside another
        /// worker's run.
        #[test]
        fn runs_agree_with_naive_model_on_chains(
            ops in prop::collection::vec(chain_op(), 1..50),
            precise_w in 0u64..4,
        ) {
            let (idx, base) = config_index(CAP, Some(TTL), true);
            let mut model: HashMap<u64, Model> = HashMap::new();
            let mut now = 0;
            for w in 0..precise_w {
                idx.set_precise(wk(w), true);
                model.entry(w).or_default().precise = true;
            }
            for op in ops {
                let op = op.resolve();
                apply(&idx, &mut model, &op, base, &mut now);
                for c in 0..CHAINS {
                    let q: Vec<u64> = (0..CHAIN_LEN).map(|i| block(c, i)).collect();
                    let (got, want) = apply(&idx, &mut model, &Op::Lookup(q), base, &mut now).expect("lookup");
                    prop_assert_eq!(got, want, "after {:?}", op);
                }
            }
            idx.purge_expired(base + Duration::from_secs(now));
            prop_assert_eq!(idx.len(), model_pairs(&model, now));
            for w in 0..4 {
                idx.clear_worker(wk(w));
            }
            prop_assert_eq!(idx.runs(), 0);
            prop_assert!(idx.is_empty());
        }
    }

    const CHAINS: u64 = 4;
    const CHAIN_LEN: u64 = 80;

    /// Block `i` of chain `c`: chain `c` shares its first `10 c` blocks with chain
    /// `c - 1`, so each block has one parent, as chained hashes do.
    fn block(c: u64, i: u64) -> u64 {
        c.min(i / 10) * 1000 + i + 1
    }

    /// Worker `w`'s engine hash for `block`.
    fn engine_of(w: u64, block: u64) -> u64 {
        block ^ (w + 1) << 40
    }

    /// An operation over the chains: (kind, worker, chain, from, len).
    #[derive(Debug, Clone)]
    struct ChainOp(u8, u64, u64, u64, u64);

    fn chain_op() -> impl Strategy<Value = ChainOp> {
        (0u8..10, 0u64..4, 0..CHAINS, 0..CHAIN_LEN, 1u64..40)
            .prop_map(|(k, w, c, from, len)| ChainOp(k, w, c, from, len))
    }

    impl ChainOp {
        fn resolve(&self) -> Op {
            let &ChainOp(kind, w, c, from, len) = self;
            let range = from..(from + len).min(CHAIN_LEN);
            let blocks: Vec<u64> = range.clone().map(|i| block(c, i)).collect();
            match kind {
                0..=3 => Op::Chain(
                    w,
                    from.checked_sub(1).map(|p| engine_of(w, block(c, p))),
                    blocks.iter().map(|h| (engine_of(w, *h), *h)).collect(),
                ),
                4 | 5 => Op::Remove(w, blocks.iter().map(|h| engine_of(w, *h)).collect()),
                6 => Op::Insert(w, (0..len.min(CHAIN_LEN)).map(|i| block(c, i)).collect()),
                7 => Op::Forget(w, blocks),
                8 => match from % 4 {
                    0 => Op::Clear(w),
                    1 => Op::Precise(w, len % 2 == 0),
                    2 => Op::Capacity(w, 1 + len as usize % 8),
                    _ => Op::Advance(len % 5),
                },
                _ => Op::Store(
                    w,
                    (0..len.min(CHAIN_LEN))
                        .map(|i| (engine_of(w, block(c, i)), block(c, i)))
                        .collect(),
                ),
            }
        }
    }

    proptest! {
        /// The chained model with long runs and no LRU bound: whole chains and
        /// their tails stored and evicted by many workers.
        #[test]
        fn long_chains_agree_with_naive_model(
            ops in prop::collection::vec((0u64..4, 0..CHAINS, 0..CHAIN_LEN, 1u64..80, any::<bool>()), 1..40),
        ) {
            let (idx, base) = config_index(10_000, None, true);
            let mut model: HashMap<u64, Model> = HashMap::new();
            let mut now = 0;
            for w in 0..4 {
                idx.set_precise(wk(w), true);
                model.entry(w).or_default().precise = true;
            }
            for (w, c, from, len, store) in ops {
                let op = ChainOp(if store { 0 } else { 4 }, w, c, from, len).resolve();
                apply(&idx, &mut model, &op, base, &mut now);
                for c in 0..CHAINS {
                    let q: Vec<u64> = (0..CHAIN_LEN).map(|i| block(c, i)).collect();
                    let (got, want) = apply(&idx, &mut model, &Op::Lookup(q), base, &mut now).expect("lookup");
                    prop_assert_eq!(got, want, "after {:?}", op);
                }
            }
            prop_assert_eq!(idx.len(), model_pairs(&model, now));
        }
    }

    /// The two kinds of writer production has, racing: a precise writer (the
    /// ingest thread) stores and evicts segments of the shared chains (with
    /// their parents) for precise workers and for an approximate one, while an
    /// approximate writer (the request path) inserts and forgets prompts for
    /// approximate workers, that one included; a reader looks up. Every worker
    /// keeps a pinned prefix throughout, so each lookup must count it; at the
    /// end the index must equal both writers' steps replayed on the naive model
    /// (precise and approximate entries are kept apart, so the replay order
    /// does not matter), so an update either writer lost shows.
    #[test]
    fn two_writers_agree_with_a_sequential_replay() {
        /// Worker both writers write (approximate, with precise entries too).
        const SHARED: u64 = 4;
        const PINNED: u64 = 5;
        let idx = Arc::new(PrefixIndex::new(IndexConfig::default()));
        let engine = |w: u64, block: u64| engine_of(w, block) ^ 1 << 50;
        let pinned: Vec<u64> = (0..PINNED).map(|i| block(0, i)).collect();
        let mut model: HashMap<u64, Model> = HashMap::new();
        let t0 = Instant::now();
        for w in 0..=SHARED {
            let m = model.entry(w).or_default();
            if w % 2 == 0 && w != SHARED {
                idx.set_precise(wk(w), true);
                m.precise = true;
            }
            if w % 2 == 0 {
                let blocks: Vec<(u64, u64)> =
                    pinned.iter().map(|h| (*h ^ 0xfff << 40, *h)).collect();
                idx.store_engine_chain(wk(w), None, &blocks, t0);
                m.engine.extend(blocks);
            } else {
                idx.insert(wk(w), &pinned, t0);
                m.lru.extend(pinned.iter().map(|h| (*h, 0)));
            }
        }
        // Writer `t`'s steps: (worker, chain, from, len, add). The precise
        // writer (0) writes workers 0, 2 and SHARED, the approximate one (1)
        // workers 1, 3 and SHARED.
        let steps = |t: u64| -> Vec<(u64, u64, u64, u64, bool)> {
            let mut z = 0x9e37_79b9 ^ t;
            (0..3_000)
                .map(|_| {
                    z = mix(z);
                    let w = if z % 3 == 0 {
                        SHARED
                    } else {
                        t + 2 * (z >> 8 & 1)
                    };
                    let (c, from) = ((z >> 16) % CHAINS, (z >> 24) % CHAIN_LEN);
                    (w, c, from, 1 + (z >> 40) % 40, z >> 60 != 0)
                })
                .collect()
        };
        let precise = {
            let idx = Arc::clone(&idx);
            std::thread::spawn(move || {
                for (w, c, from, len, store) in steps(0) {
                    let blocks: Vec<u64> = (from..(from + len).min(CHAIN_LEN))
                        .map(|i| block(c, i))
                        .collect();
                    if store {
                        let parent = from.checked_sub(1).map(|p| engine(w, block(c, p)));
                        let pairs: Vec<(u64, u64)> =
                            blocks.iter().map(|h| (engine(w, *h), *h)).collect();
                        idx.store_engine_chain(wk(w), parent, &pairs, Instant::now());
                    } else {
                        let gone: Vec<u64> = blocks.iter().map(|h| engine(w, *h)).collect();
                        idx.remove_engine_blocks(wk(w), &gone);
                    }
                }
            })
        };
        // A prompt is recorded from its first block; a forget never reaches
        // the pinned prefix.
        let prompt = |c: u64, from: u64, len: u64| -> Vec<u64> {
            (0..(from + len).min(CHAIN_LEN))
                .map(|i| block(c, i))
                .collect()
        };
        let forgotten = |c: u64, from: u64, len: u64| -> Vec<u64> {
            (from.max(PINNED)..(from + len).min(CHAIN_LEN))
                .map(|i| block(c, i))
                .collect()
        };
        let approximate = {
            let idx = Arc::clone(&idx);
            std::thread::spawn(move || {
                for (w, c, from, len, insert) in steps(1) {
                    if insert {
                        idx.insert(wk(w), &prompt(c, from, len), t0);
                    } else {
                        idx.forget(wk(w), &forgotten(c, from, len));
                    }
                }
            })
        };
        let reader = {
            let idx = Arc::clone(&idx);
            std::thread::spawn(move || {
                let cands: Vec<WorkerKey> = (0..=SHARED).map(wk).collect();
                let q: Vec<u64> = (0..CHAIN_LEN).map(|i| block(0, i)).collect();
                for _ in 0..2_000 {
                    for n in idx.lookup(&q, &cands, t0) {
                        assert!(n >= PINNED as usize, "pinned prefix lost: {n}");
                    }
                }
            })
        };
        // Holds the read lock for a while, again and again, so that both
        // writers' calls are in flight at once (whatever the cores do): each
        // waits for its write phase while the other plans or waits too.
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let staller = {
            let (idx, done) = (Arc::clone(&idx), Arc::clone(&done));
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let held = idx.inner.read();
                    std::thread::sleep(Duration::from_micros(300));
                    drop(held);
                    std::thread::sleep(Duration::from_micros(100));
                }
            })
        };
        precise.join().expect("precise writer");
        approximate.join().expect("approximate writer");
        done.store(true, Ordering::Relaxed);
        staller.join().expect("staller");
        reader.join().expect("reader");
        for (w, c, from, len, store) in steps(0) {
            let m = model.entry(w).or_default();
            let range = from..(from + len).min(CHAIN_LEN);
            if store {
                let parent = from.checked_sub(1).map(|p| engine(w, block(c, p)));
                if parent.is_none_or(|p| m.engine.contains_key(&p)) {
                    for i in range {
                        m.engine.insert(engine(w, block(c, i)), block(c, i));
                    }
                }
            } else {
                for i in range {
                    m.engine.remove(&engine(w, block(c, i)));
                }
            }
        }
        for (w, c, from, len, insert) in steps(1) {
            let m = model.entry(w).or_default();
            if insert {
                for h in prompt(c, from, len) {
                    m.lru.retain(|(x, _)| *x != h);
                    m.lru.push((h, 0));
                }
            } else {
                let gone = forgotten(c, from, len);
                m.lru.retain(|(x, _)| !gone.contains(x));
            }
        }
        let cands: Vec<WorkerKey> = (0..=SHARED).map(wk).collect();
        for c in 0..CHAINS {
            let q: Vec<u64> = (0..CHAIN_LEN).map(|i| block(c, i)).collect();
            let want: Vec<usize> = (0..=SHARED)
                .map(|w| q.iter().take_while(|h| model[&w].holds(**h, 0)).count())
                .collect();
            assert_eq!(idx.lookup(&q, &cands, t0), want, "chain {c}");
        }
        for (w, m) in &model {
            assert_eq!(idx.precise_len(wk(*w)), m.engine.len(), "worker {w}");
            for (e, h) in &m.engine {
                assert_eq!(idx.engine_block(wk(*w), *e), Some(*h));
            }
        }
        assert_eq!(idx.len(), model_pairs(&model, 0));
        for w in 0..=SHARED {
            idx.clear_worker(wk(w));
        }
        assert!(idx.is_empty());
        assert_eq!(idx.runs(), 0);
    }

    /// Writers and readers at once: every worker keeps its first 25 blocks from
    /// the start, so every lookup must count at least 25 for each; the final state
    /// matches a sequential replay of each writer's steps.
    #[test]
    fn concurrent_writers_and_readers_agree_with_the_model() {
        let idx = Arc::new(PrefixIndex::new(IndexConfig::default()));
        let chain: Vec<u64> = (1..=300).collect();
        let steps = |w: u64| -> Vec<(usize, usize)> {
            (0..50u64)
                .map(|round| {
                    let n = 50 + ((round * 37 + w * 11) % 250) as usize;
                    (n, n / 2)
                })
                .collect()
        };
        for w in 0..3u64 {
            idx.set_precise(wk(w), true);
            let blocks: Vec<(u64, u64)> = chain[..25].iter().map(|h| (*h, *h)).collect();
            idx.store_engine_chain(wk(w), None, &blocks, Instant::now());
        }
        let writers: Vec<_> = (0..3u64)
            .map(|w| {
                let idx = Arc::clone(&idx);
                let chain = chain.clone();
                let steps = steps(w);
                std::thread::spawn(move || {
                    for (n, keep) in steps {
                        let blocks: Vec<(u64, u64)> = chain[..n].iter().map(|h| (*h, *h)).collect();
                        idx.store_engine_chain(wk(w), None, &blocks, Instant::now());
                        let evict: Vec<u64> = chain[keep..n].iter().rev().copied().collect();
                        idx.remove_engine_blocks(wk(w), &evict);
                    }
                })
            })
            .collect();
        let reader = {
            let idx = Arc::clone(&idx);
            let chain = chain.clone();
            std::thread::spawn(move || {
                let cands: Vec<WorkerKey> = (0..3).map(wk).collect();
                for _ in 0..2_000 {
                    for c in idx.lookup(&chain, &cands, Instant::now()) {
                        assert!((25..=300).contains(&c), "count {c}");
                    }
                }
            })
        };
        for w in writers {
            w.join().expect("writer");
        }
        reader.join().expect("reader");
        let cands: Vec<WorkerKey> = (0..3).map(wk).collect();
        let mut want = Vec::new();
        let mut entries = 0;
        for w in 0..3u64 {
            let mut held: HashSet<u64> = chain[..25].iter().copied().collect();
            for (n, keep) in steps(w) {
                held.extend(&chain[..n]);
                for h in &chain[keep..n] {
                    held.remove(h);
                }
            }
            want.push(chain.iter().take_while(|h| held.contains(h)).count());
            entries += held.len();
        }
        assert_eq!(idx.lookup(&chain, &cands, Instant::now()), want);
        assert_eq!(idx.len(), entries);
        for w in 0..3 {
            idx.clear_worker(wk(w));
        }
        assert!(idx.is_empty());
        assert_eq!(idx.runs(), 0);
    }
}
