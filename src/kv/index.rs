//! The prefix index: which (worker, dp rank) holds which prefix blocks.
//!
//! One index per pool. Blocks live in a sharded [`DashMap`] keyed by block hash, so
//! a lookup only takes short read locks on the shards of the blocks it walks, and
//! a writer only locks one shard per block it touches. Per-worker bookkeeping (LRU
//! order, capacity, engine hashes) sits behind one small mutex per worker that
//! lookups never take.
//!
//! Two ways in:
//! - approximate mode ([`PrefixIndex::insert`]): each routing decision records the
//!   request's blocks for the chosen worker; an LRU bound per worker (its capacity
//!   in blocks) and a TTL keep the guess close to what the engine still holds;
//! - precise mode ([`PrefixIndex::store_engine_blocks`],
//!   [`PrefixIndex::remove_engine_blocks`]): the engine's KV events say exactly
//!   what is stored and evicted; such entries have no LRU bound and no TTL.
//!
//! A worker marked precise ([`PrefixIndex::set_precise`]) takes no approximate
//! entries: its events are the truth.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::Mutex;

use crate::endpoints::WorkerKey;

/// Default LRU bound per worker in blocks, when neither the engine's capacity nor
/// a flag says otherwise (the GIE prefix plugin's default).
pub const DEFAULT_CAPACITY_BLOCKS: usize = 31_250;

/// Default time an approximate entry stays valid after its last touch.
pub const DEFAULT_TTL: Duration = Duration::from_secs(900);

/// Stamp of a precise entry: never expires.
const PRECISE: u32 = u32::MAX;

/// Block hashes are already uniformly random: use them as their own hash.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type IdMap<V> = DashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// A fast hasher for small keys such as [`WorkerKey`] (FxHash's mixing step):
/// lookups and load reads hash one key per candidate on every decision.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// Build-hasher for maps keyed by [`WorkerKey`].
pub type KeyHash = BuildHasherDefault<KeyHasher>;

/// One (block, worker) entry.
#[derive(Debug, Clone, Copy)]
struct Holder {
    instance_id: u64,
    dp_rank: u32,
    /// Seconds since the index was created at the last touch, or [`PRECISE`].
    stamp: u32,
}

impl Holder {
    fn is(&self, w: WorkerKey) -> bool {
        self.instance_id == w.instance_id && self.dp_rank == w.dp_rank
    }
    fn key(&self) -> WorkerKey {
        WorkerKey {
            instance_id: self.instance_id,
            dp_rank: self.dp_rank,
        }
    }
}

/// Per-worker bookkeeping.
#[derive(Debug, Default)]
struct WorkerBlocks {
    /// Set when the worker was cleared and dropped from the map; writers retry.
    removed: bool,
    capacity: Option<usize>,
    precise: bool,
    /// Approximate entries: hash → (sequence number of the last touch, stamp).
    recency: HashMap<u64, (u64, u32)>,
    /// Touch order, oldest first; entries whose sequence number is no longer the
    /// one in `recency` are stale and skipped.
    order: VecDeque<(u64, u64)>,
    next_seq: u64,
    /// Precise entries: engine hash → kvpick hash.
    engine: HashMap<u64, u64>,
    /// Precise entries: kvpick hash → number of engine blocks naming it.
    precise_refs: HashMap<u64, u32>,
}

/// Settings of a [`PrefixIndex`].
#[derive(Debug, Clone, Copy)]
pub struct IndexConfig {
    /// LRU bound per worker in blocks until [`PrefixIndex::set_capacity`] is called.
    pub default_capacity: usize,
    /// How long an approximate entry stays valid after its last touch (`None`: forever).
    pub ttl: Option<Duration>,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            default_capacity: DEFAULT_CAPACITY_BLOCKS,
            ttl: Some(DEFAULT_TTL),
        }
    }
}

/// Which (worker, rank) holds which prefix blocks. Send + Sync; share it in an `Arc`.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: IdMap<Vec<Holder>>,
    workers: DashMap<WorkerKey, Arc<Mutex<WorkerBlocks>>, KeyHash>,
    config: IndexConfig,
    base: Instant,
    entries: AtomicUsize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        PrefixIndex {
            blocks: IdMap::default(),
            workers: DashMap::default(),
            config,
            base: Instant::now(),
            entries: AtomicUsize::new(0),
        }
    }

    /// An empty index whose clock starts at `base` (for tests that pass their own
    /// instants; `now` arguments before `base` count as `base`).
    pub fn with_base(config: IndexConfig, base: Instant) -> Self {
        PrefixIndex {
            base,
            ..Self::new(config)
        }
    }

    fn stamp(&self, now: Instant) -> u32 {
        let secs = now.saturating_duration_since(self.base).as_secs();
        secs.min(u64::from(PRECISE - 1)) as u32
    }

    fn alive(&self, stamp: u32, now: u32) -> bool {
        match self.config.ttl {
            _ if stamp == PRECISE => true,
            None => true,
            Some(ttl) => u64::from(now.saturating_sub(stamp)) < ttl.as_secs().max(1),
        }
    }

    /// Runs `f` on the worker's bookkeeping under its lock, creating it if needed.
    fn with_worker<R>(&self, worker: WorkerKey, mut f: impl FnMut(&mut WorkerBlocks) -> R) -> R {
        loop {
            let slot = Arc::clone(self.workers.entry(worker).or_default().value());
            let mut w = slot.lock();
            if w.removed {
                continue;
            }
            return f(&mut w);
        }
    }

    /// Approximate mode: records that `worker` now holds `hashes` (touching them in
    /// its LRU), then evicts its least recently used blocks beyond its capacity and
    /// its expired ones. Does nothing for a precise worker.
    pub fn insert(&self, worker: WorkerKey, hashes: &[u64], now: Instant) {
        let stamp = self.stamp(now);
        self.with_worker(worker, |w| {
            if w.precise {
                return;
            }
            for &h in hashes {
                let seq = w.next_seq;
                w.next_seq += 1;
                let previous = w.recency.insert(h, (seq, stamp));
                w.order.push_back((h, seq));
                // A block touched again within the same stamp (second) already has a
                // holder with this stamp (or a precise one): skip the shared map.
                if previous.is_none_or(|(_, s)| s != stamp) {
                    self.upsert_holder(h, worker, stamp);
                }
            }
            self.evict(worker, w, stamp);
        });
    }

    /// Adds or refreshes the (block, worker) holder; a precise stamp is never
    /// downgraded by an approximate touch.
    fn upsert_holder(&self, hash: u64, worker: WorkerKey, stamp: u32) {
        let mut holders = self.blocks.entry(hash).or_default();
        match holders.iter_mut().find(|x| x.is(worker)) {
            Some(x) => {
                if x.stamp != PRECISE {
                    x.stamp = stamp;
                }
            }
            None => {
                holders.push(Holder {
                    instance_id: worker.instance_id,
                    dp_rank: worker.dp_rank,
                    stamp,
                });
                self.entries.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Removes the (block, worker) holder if present.
    fn remove_holder(&self, hash: u64, worker: WorkerKey) {
        let emptied = match self.blocks.get_mut(&hash) {
            Some(mut holders) => {
                if let Some(pos) = holders.iter().position(|x| x.is(worker)) {
                    holders.swap_remove(pos);
                    self.entries.fetch_sub(1, Ordering::Relaxed);
                }
                holders.is_empty()
            }
            None => false,
        };
        if emptied {
            self.blocks.remove_if(&hash, |_, v| v.is_empty());
        }
    }

    /// Drops one approximate entry of `w`; the holder goes unless a precise entry keeps it.
    fn drop_approx(&self, worker: WorkerKey, w: &mut WorkerBlocks, hash: u64) {
        w.recency.remove(&hash);
        if !w.precise_refs.contains_key(&hash) {
            self.remove_holder(hash, worker);
        }
    }

    fn evict(&self, worker: WorkerKey, w: &mut WorkerBlocks, now: u32) {
        let cap = w.capacity.unwrap_or(self.config.default_capacity);
        while let Some(&(h, seq)) = w.order.front() {
            let live = w.recency.get(&h).copied().filter(|(s, _)| *s == seq);
            match live {
                None => {
                    w.order.pop_front();
                }
                Some((_, stamp)) if w.recency.len() > cap || !self.alive(stamp, now) => {
                    w.order.pop_front();
                    self.drop_approx(worker, w, h);
                }
                Some(_) => break,
            }
        }
        // Keep the stale tail of the order queue bounded.
        if w.order.len() > 2 * w.recency.len() + 64 {
            let mut live: Vec<(u64, u64)> = w.recency.iter().map(|(h, (s, _))| (*h, *s)).collect();
            live.sort_unstable_by_key(|(_, s)| *s);
            w.order = live.into();
        }
    }

    /// Precise mode: `worker` stored these blocks (engine hash, kvpick hash). The
    /// engine hash is only kept to find the block again on removal.
    pub fn store_engine_blocks(&self, worker: WorkerKey, blocks: &[(u64, u64)], now: Instant) {
        // Precise entries never expire: `now` is accepted for symmetry with `insert`.
        let _ = now;
        self.with_worker(worker, |w| {
            for &(engine, hash) in blocks {
                if let Some(old) = w.engine.insert(engine, hash) {
                    if old == hash {
                        continue;
                    }
                    self.release_precise(worker, w, old);
                }
                *w.precise_refs.entry(hash).or_insert(0) += 1;
                self.upsert_holder(hash, worker, PRECISE);
            }
        });
    }

    /// Precise mode: `worker` evicted these blocks (by engine hash); unknown ones are ignored.
    pub fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]) {
        if !self.workers.contains_key(&worker) {
            return;
        }
        self.with_worker(worker, |w| {
            for e in engine_hashes {
                if let Some(hash) = w.engine.remove(e) {
                    self.release_precise(worker, w, hash);
                }
            }
        });
    }

    fn release_precise(&self, worker: WorkerKey, w: &mut WorkerBlocks, hash: u64) {
        let Some(n) = w.precise_refs.get_mut(&hash) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        w.precise_refs.remove(&hash);
        match w.recency.get(&hash) {
            // An approximate entry remains: demote the holder to it.
            Some(&(_, stamp)) => {
                if let Some(mut holders) = self.blocks.get_mut(&hash) {
                    if let Some(x) = holders.iter_mut().find(|x| x.is(worker)) {
                        x.stamp = stamp;
                    }
                }
            }
            None => self.remove_holder(hash, worker),
        }
    }

    /// Forgets everything `worker` holds (event gap, engine restart, reconnect,
    /// endpoint gone). Its capacity and precise flag are forgotten too.
    pub fn clear_worker(&self, worker: WorkerKey) {
        let Some(slot) = self.workers.get(&worker).map(|s| Arc::clone(s.value())) else {
            return;
        };
        let mut w = slot.lock();
        let hashes: Vec<u64> = w
            .recency
            .keys()
            .chain(w.precise_refs.keys())
            .copied()
            .collect();
        for h in hashes {
            self.remove_holder(h, worker);
        }
        *w = WorkerBlocks {
            removed: true,
            ..Default::default()
        };
        self.workers
            .remove_if(&worker, |_, v| Arc::ptr_eq(v, &slot));
    }

    /// Marks `worker` as fed by KV events (precise) or not. Turning precise on drops
    /// its approximate entries.
    pub fn set_precise(&self, worker: WorkerKey, precise: bool) {
        self.with_worker(worker, |w| {
            if precise && !w.precise {
                let hashes: Vec<u64> = w.recency.keys().copied().collect();
                for h in hashes {
                    self.drop_approx(worker, w, h);
                }
                w.order.clear();
            }
            w.precise = precise;
        });
    }

    /// Whether `worker` is fed by KV events.
    pub fn is_precise(&self, worker: WorkerKey) -> bool {
        // Never lock a worker while holding a map shard (clear_worker does the reverse).
        let slot = self.workers.get(&worker).map(|s| Arc::clone(s.value()));
        slot.is_some_and(|w| w.lock().precise)
    }

    /// Sets the LRU bound of `worker` in blocks (e.g. from the engine's
    /// `num_gpu_blocks`), evicting at once if it shrank.
    pub fn set_capacity(&self, worker: WorkerKey, blocks: usize) {
        let now = self.stamp(Instant::now());
        self.with_worker(worker, |w| {
            if w.capacity != Some(blocks) {
                w.capacity = Some(blocks);
                self.evict(worker, w, now);
            }
        });
    }

    /// For each candidate, how many leading blocks of `hashes` it holds (counting
    /// stops at its first miss). Candidates should be distinct.
    pub fn lookup(&self, hashes: &[u64], candidates: &[WorkerKey], now: Instant) -> Vec<usize> {
        let mut counts = vec![0usize; candidates.len()];
        if candidates.is_empty() {
            return counts;
        }
        let now = self.stamp(now);
        let pos: HashMap<WorkerKey, usize, KeyHash> = candidates
            .iter()
            .enumerate()
            .map(|(i, k)| (*k, i))
            .collect();
        for (i, h) in hashes.iter().enumerate() {
            let Some(holders) = self.blocks.get(h) else {
                break;
            };
            let mut any = false;
            for x in holders.iter() {
                if !self.alive(x.stamp, now) {
                    continue;
                }
                if let Some(&c) = pos.get(&x.key()) {
                    if counts[c] == i {
                        counts[c] = i + 1;
                        any = true;
                    }
                }
            }
            if !any {
                break;
            }
        }
        counts
    }

    /// Drops expired approximate entries of every worker (lookups already ignore them).
    pub fn purge_expired(&self, now: Instant) {
        let now = self.stamp(now);
        let workers: Vec<(WorkerKey, Arc<Mutex<WorkerBlocks>>)> = self
            .workers
            .iter()
            .map(|e| (*e.key(), Arc::clone(e.value())))
            .collect();
        for (key, slot) in workers {
            let mut w = slot.lock();
            if !w.removed {
                self.evict(key, &mut w, now);
            }
        }
    }

    /// Workers the index holds anything about.
    pub fn workers(&self) -> Vec<WorkerKey> {
        self.workers.iter().map(|e| *e.key()).collect()
    }

    /// Indexed (block, worker) entries.
    pub fn len(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// Whether the index holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Estimated heap bytes held by the index (walks it; for metrics and benches).
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        // hashbrown: one control byte per bucket besides the slot.
        let slot = size_of::<(u64, Vec<Holder>)>() + 1;
        let mut bytes = self.blocks.capacity() * slot;
        for e in self.blocks.iter() {
            bytes += e.value().capacity() * size_of::<Holder>();
        }
        let slots: Vec<Arc<Mutex<WorkerBlocks>>> =
            self.workers.iter().map(|e| Arc::clone(e.value())).collect();
        for slot in slots {
            let w = slot.lock();
            bytes += size_of::<WorkerBlocks>()
                + w.recency.capacity() * (size_of::<(u64, (u64, u32))>() + 1)
                + w.order.capacity() * size_of::<(u64, u64)>()
                + w.engine.capacity() * (size_of::<(u64, u64)>() + 1)
                + w.precise_refs.capacity() * (size_of::<(u64, u32)>() + 1);
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    fn wk(i: u64) -> WorkerKey {
        WorkerKey {
            instance_id: i,
            dp_rank: 0,
        }
    }

    fn index(cap: usize, ttl_secs: Option<u64>) -> (PrefixIndex, Instant) {
        let base = Instant::now();
        let idx = PrefixIndex::with_base(
            IndexConfig {
                default_capacity: cap,
                ttl: ttl_secs.map(Duration::from_secs),
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
    fn lru_bound_evicts_least_recently_used() {
        let (idx, t) = index(3, None);
        idx.insert(wk(1), &[1, 2, 3], t);
        idx.insert(wk(1), &[1], t); // touch 1: 2 is now the oldest
        idx.insert(wk(1), &[4], t);
        assert_eq!(idx.lookup(&[1], &[wk(1)], t), vec![1]);
        assert_eq!(idx.lookup(&[2], &[wk(1)], t), vec![0]);
        assert_eq!(idx.lookup(&[3, 4], &[wk(1)], t), vec![2]);
        assert_eq!(idx.len(), 3);
        idx.set_capacity(wk(1), 1);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.lookup(&[4], &[wk(1)], t), vec![1]);
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
        idx.store_engine_blocks(wk(1), &[(100, 1), (200, 2)], t);
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
        Remove(u64, Vec<u64>),
        Clear(u64),
        Capacity(u64, usize),
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
            1 => w.clone().prop_map(Op::Clear),
            1 => (w.clone(), 1usize..8).prop_map(|(w, c)| Op::Capacity(w, c)),
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
                || self.lru.iter().any(|(x, t)| *x == h && now - t < TTL)
        }
        fn evict(&mut self, now: u64) {
            let cap = self.capacity.unwrap_or(CAP);
            while let Some(&(_, t)) = self.lru.first() {
                if self.lru.len() > cap || now - t >= TTL {
                    self.lru.remove(0);
                } else {
                    break;
                }
            }
        }
    }

    proptest! {
        #[test]
        fn index_agrees_with_naive_model(ops in prop::collection::vec(op(), 1..60), precise_w in 0u64..5) {
            let (idx, base) = index(CAP, Some(TTL));
            let mut model: HashMap<u64, Model> = HashMap::new();
            let mut now = 0u64;
            // One worker (maybe none: 4) runs in precise mode from the start.
            if precise_w < 4 {
                idx.set_precise(wk(precise_w), true);
                model.entry(precise_w).or_default().precise = true;
            }
            for op in ops {
                let at = base + Duration::from_secs(now);
                match op {
                    Op::Insert(w, hs) => {
                        idx.insert(wk(w), &hs, at);
                        let m = model.entry(w).or_default();
                        if !m.precise {
                            for h in hs {
                                m.lru.retain(|(x, _)| *x != h);
                                m.lru.push((h, now));
                            }
                            m.evict(now);
                        }
                    }
                    Op::Store(w, bs) => {
                        idx.store_engine_blocks(wk(w), &bs, at);
                        let m = model.entry(w).or_default();
                        for (e, h) in bs {
                            m.engine.insert(e, h);
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
                    Op::Clear(w) => {
                        idx.clear_worker(wk(w));
                        model.remove(&w);
                    }
                    Op::Capacity(w, c) => {
                        idx.set_capacity(wk(w), c);
                        let m = model.entry(w).or_default();
                        m.capacity = Some(c);
                        // set_capacity evicts by size; expired entries are invisible anyway.
                        let cap = c;
                        while m.lru.len() > cap {
                            m.lru.remove(0);
                        }
                    }
                    Op::Advance(s) => now += s,
                    Op::Lookup(hs) => {
                        let cands: Vec<WorkerKey> = (0..4).map(wk).collect();
                        let got = idx.lookup(&hs, &cands, at);
                        let want: Vec<usize> = (0..4u64)
                            .map(|w| {
                                let m = model.get(&w).cloned().unwrap_or_default();
                                hs.iter().take_while(|h| m.holds(**h, now)).count()
                            })
                            .collect();
                        prop_assert_eq!(got, want);
                    }
                }
            }
            // The entry count matches the distinct (block, worker) pairs still tracked.
            idx.purge_expired(base + Duration::from_secs(now));
            let mut pairs = HashSet::new();
            for (w, m) in &model {
                for (h, t) in &m.lru {
                    if now - t < TTL {
                        pairs.insert((*w, *h));
                    }
                }
                for h in m.engine.values() {
                    pairs.insert((*w, *h));
                }
            }
            prop_assert_eq!(idx.len(), pairs.len());
        }
    }
}
