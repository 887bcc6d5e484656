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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::keys::WorkerKey;
pub use crate::keys::{KeyHash, KeyHasher};
use crate::kv::lru::Chain;
use crate::kv::slots::SlotSet;
use crate::kv::table::BlockTable;
use crate::kv::tier::{self, Tier};

mod inner;
mod lock;
mod overlaps;
mod plan;
mod state;
#[cfg(test)]
mod tests;

use lock::{spin_for, FairWrite, SPIN, YIELD};
pub use overlaps::Overlaps;
use state::{Clock, Engines, Inner, Lineage, Loc, Run, StorePlan, Worker};
pub use state::{
    IndexConfig, DEFAULT_CAPACITY_BLOCKS, DEFAULT_PRECISE_LIMIT, DEFAULT_PRECISE_SLACK,
    DEFAULT_TTL, WRITE_CHUNK,
};

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
    /// `lookups_announced` when a writer most recently stopped waiting for a lookup that
    /// did not take the lock within [`YIELD`] (descheduled while spinning).
    writers_gave_up_at: AtomicU64,
}

/// Most blocks one lower-tier engine block may cover
/// ([`PrefixIndex::store_tier_copies`]): a publisher naming a larger span
/// is cut to it.
pub const MAX_TIER_SPAN: usize = 64;

/// What one [`PrefixIndex::store_tier_copies`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStore {
    /// Blocks the tier now holds that it did not.
    pub stored: usize,
    /// Engine blocks the worker's GPU events never placed.
    pub orphans: usize,
    /// Engine blocks beyond the tier holder's precise cap.
    pub dropped: usize,
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
            let mut chain = Chain::default();
            for (k, &h) in chunk.iter().enumerate() {
                let touched = first.saturating_add(k as u64);
                let new = match renew {
                    true => w.recency.touch_chain(h, touched, &mut chain),
                    false => !w.recency.contains(h) && w.recency.touch(h, touched),
                };
                if new {
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

    /// Precise mode: `worker` copied these blocks (by engine hash) to a lower
    /// `tier`, each engine block covering `span` blocks of its chain (the
    /// located one and those before it: vLLM's offloaded blocks may be a
    /// multiple of its GPU blocks, named by their last one's hash). A block is
    /// found where `worker`'s GPU engine map places it: the copy is of a block
    /// its events stored on the GPU, and the GPU events keep the chain's
    /// shape. Blocks not found there are orphans; stores beyond the tier
    /// holder's precise cap are dropped and counted.
    pub fn store_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
        span: usize,
    ) -> TierStore {
        let key = tier::holder(worker, tier);
        let span = span.clamp(1, MAX_TIER_SPAN) as u32;
        let mut out = TierStore::default();
        let mut engines = self.engines.lock();
        let found: Vec<(u64, Loc)> = match engines.maps.get(&tier::device(worker)) {
            Some(device) if tier != Tier::Gpu => engine_hashes
                .iter()
                .filter_map(|h| device.get(*h).map(|l| (*h, l)))
                .collect(),
            _ => Vec::new(),
        };
        out.orphans = engine_hashes.len() - found.len();
        if found.is_empty() {
            return out;
        }
        let known = self.inner.read().names.slots.get(&key).copied();
        let slot = known.unwrap_or_else(|| self.write().slot(key));
        let map = engines.maps.entry(key).or_default();
        for chunk in found.chunks(WRITE_CHUNK) {
            let mut g = self.write();
            let w = &mut g.workers[slot as usize];
            w.span = span;
            let limit = w.precise_limit.unwrap_or(self.config.default_precise_limit);
            let mut blocks = Vec::with_capacity(chunk.len() * span as usize);
            for &(engine, last) in chunk {
                if map.get(engine).is_some() {
                    continue;
                }
                if map.len() >= limit {
                    out.dropped += 1;
                    continue;
                }
                map.insert(engine, last);
                for pos in last.pos.saturating_sub(span - 1)..=last.pos {
                    let loc = Loc { pos, ..last };
                    blocks.extend(g.hash_at(loc).map(|h| (h, loc)));
                }
            }
            out.stored += g.add_holder_at(&blocks, slot, &self.entries);
        }
        self.precise_dropped
            .fetch_add(out.dropped as u64, Ordering::Relaxed);
        out
    }

    /// Precise mode: `worker` dropped these blocks (by engine hash) from a
    /// lower `tier`; its copies there, and on no other tier, are forgotten.
    /// Returns how many blocks it no longer holds there.
    pub fn remove_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
    ) -> usize {
        if tier == Tier::Gpu {
            return 0;
        }
        let key = tier::holder(worker, tier);
        let mut removed = 0;
        self.with_engine(key, false, |slot, e, _, _| {
            for chunk in engine_hashes.chunks(WRITE_CHUNK) {
                let locs: Vec<Loc> = chunk.iter().filter_map(|h| e.remove(*h)).collect();
                if locs.is_empty() {
                    continue;
                }
                let mut g = self.write();
                let span = g.workers[slot as usize].span.max(1);
                let mut blocks = Vec::with_capacity(locs.len() * span as usize);
                for last in locs {
                    for pos in last.pos.saturating_sub(span - 1)..=last.pos {
                        let loc = Loc { pos, ..last };
                        blocks.extend(g.hash_at(loc).map(|h| (h, loc)));
                    }
                }
                let before = self.entries.load(Ordering::Relaxed);
                g.remove_holder_runs(&blocks, slot, &self.entries);
                removed += before.saturating_sub(self.entries.load(Ordering::Relaxed));
            }
        });
        removed
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
    /// endpoint gone), on every tier. Its capacity, precise cap and precise
    /// flag are forgotten too.
    pub fn clear_worker(&self, worker: WorkerKey) {
        self.clear_holder(worker);
        if tier::tier_of(worker) == Tier::Gpu {
            for t in Tier::LOWER {
                self.clear_holder(tier::holder(worker, t));
            }
        }
    }

    /// [`PrefixIndex::clear_worker`] of one holder (one tier).
    fn clear_holder(&self, worker: WorkerKey) {
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
            if tier::tier_of(worker) != Tier::Gpu {
                g.tier_slots -= 1;
            }
            g.set_oldest(slot, u32::MAX);
            let w = std::mem::take(&mut g.workers[slot as usize]);
            // A lower tier's engine block covers its span of blocks.
            let span = w.span.max(1);
            let locs: Vec<Loc> = engine
                .map(|e| {
                    e.values()
                        .flat_map(|last| {
                            (last.pos.saturating_sub(span - 1)..=last.pos)
                                .map(move |pos| Loc { pos, ..last })
                        })
                        .collect()
                })
                .unwrap_or_default();
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
            tiered: g.tier_slots > 0,
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
