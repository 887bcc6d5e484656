use super::*;
use crate::kv::tier::{self, Tier};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU32;
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
        let blocks: Vec<(u64, u64)> = (0..100).map(|i| (e * 100 + i, mix(e * 100 + i))).collect();
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
            let blocks: Vec<(u64, u64)> = pinned.iter().map(|h| (*h ^ 0xfff << 40, *h)).collect();
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

/// Overlaps of `hashes` for `worker` on each tier (GPU, CPU, disk).
fn tier_depths(idx: &PrefixIndex, worker: WorkerKey, hashes: &[u64], t: Instant) -> [usize; 3] {
    let ov = idx.overlaps(hashes, t);
    [Tier::Gpu, Tier::Cpu, Tier::Disk].map(|tier| ov.get(tier::holder(worker, tier)))
}

/// A chain stored on the GPU, then copied to the CPU tier (vLLM's offload:
/// engine hashes only) and to disk: each tier answers its own leading run,
/// and a GPU eviction leaves the lower tiers' copies.
#[test]
fn lower_tiers_hold_copies_of_blocks_the_gpu_stored() {
    let (idx, t) = config_index(100, None, true);
    let w = wk(1);
    idx.set_precise(w, true);
    let chain: Vec<(u64, u64)> = (0..6).map(|i| (100 + i, 1 + i)).collect();
    let hashes: Vec<u64> = chain.iter().map(|&(_, h)| h).collect();
    idx.store_engine_chain(w, None, &chain, t);
    assert!(!idx.overlaps(&hashes, t).tiered());
    let cpu = idx.store_tier_copies(w, Tier::Cpu, &[100, 101, 102, 103], 1);
    assert_eq!((cpu.stored, cpu.orphans), (4, 0));
    let disk = idx.store_tier_copies(w, Tier::Disk, &[100, 101, 999], 1);
    assert_eq!(
        (disk.stored, disk.orphans),
        (2, 1),
        "999 was never on the GPU"
    );
    assert!(idx.overlaps(&hashes, t).tiered());
    assert_eq!(tier_depths(&idx, w, &hashes, t), [6, 4, 2]);
    // The GPU evicts the first three: the copies below stay.
    idx.remove_engine_blocks(w, &[100, 101, 102]);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 4, 2]);
    // A second copy of a block a tier holds changes nothing.
    assert_eq!(idx.store_tier_copies(w, Tier::Cpu, &[103], 1).stored, 0);
    // Stored again from the CPU copy: the GPU holds the same blocks again.
    idx.store_engine_chain(w, None, &chain[..3], t);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [6, 4, 2]);
    // The workers' own keys: the tiers' holders are none of them.
    assert_eq!(idx.overlaps(&hashes, t).get(w), 6);
}

/// `BlockRemoved` of one medium drops that tier's copy only.
#[test]
fn removal_per_medium_drops_that_tiers_copy_only() {
    let (idx, t) = config_index(100, None, true);
    let w = wk(1);
    idx.set_precise(w, true);
    let chain: Vec<(u64, u64)> = (0..4).map(|i| (100 + i, 1 + i)).collect();
    let hashes: Vec<u64> = chain.iter().map(|&(_, h)| h).collect();
    idx.store_engine_chain(w, None, &chain, t);
    idx.store_tier_copies(w, Tier::Cpu, &[100, 101, 102, 103], 1);
    idx.store_tier_copies(w, Tier::Disk, &[100, 101, 102, 103], 1);
    assert_eq!(idx.remove_tier_copies(w, Tier::Cpu, &[102, 103, 7]), 2);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [4, 2, 4]);
    assert_eq!(idx.remove_tier_copies(w, Tier::Disk, &[100]), 1);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [4, 2, 0]);
    // A GPU removal leaves the CPU copies; the last holder's removal frees them.
    idx.remove_engine_blocks(w, &[100, 101, 102, 103]);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 2, 0]);
    assert_eq!(
        idx.remove_tier_copies(w, Tier::Gpu, &[100]),
        0,
        "not a lower tier"
    );
    idx.remove_tier_copies(w, Tier::Cpu, &[100, 101]);
    idx.remove_tier_copies(w, Tier::Disk, &[101, 102, 103]);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 0, 0]);
    assert_eq!((idx.len(), idx.runs()), (0, 0));
}

/// An offloaded block spanning several GPU blocks (named by its last one)
/// covers them all, and its removal drops them all; clearing the worker
/// clears its tiers.
#[test]
fn a_tier_block_spanning_gpu_blocks_covers_them_and_clears_with_its_worker() {
    let (idx, t) = config_index(100, None, true);
    let w = wk(1);
    idx.set_precise(w, true);
    let chain: Vec<(u64, u64)> = (0..6).map(|i| (100 + i, 1 + i)).collect();
    let hashes: Vec<u64> = chain.iter().map(|&(_, h)| h).collect();
    idx.store_engine_chain(w, None, &chain, t);
    let stored = idx.store_tier_copies(w, Tier::Cpu, &[102, 105], 3);
    assert_eq!(stored.stored, 6);
    idx.remove_engine_blocks(w, &[100, 101, 102, 103, 104, 105]);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 6, 0]);
    idx.remove_tier_copies(w, Tier::Cpu, &[105]);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 3, 0]);
    idx.clear_worker(w);
    assert_eq!(tier_depths(&idx, w, &hashes, t), [0, 0, 0]);
    assert!(!idx.overlaps(&hashes, t).tiered());
    assert_eq!(idx.len(), 0);
}

/// A lower tier's copies count against that tier's precise cap.
#[test]
fn lower_tier_copies_are_capped() {
    let base = Instant::now();
    let idx = PrefixIndex::with_base(
        IndexConfig {
            default_precise_limit: 3,
            ..IndexConfig::default()
        },
        base,
    );
    let w = wk(1);
    idx.set_precise(w, true);
    idx.set_precise_limit(w, 10);
    let chain: Vec<(u64, u64)> = (0..3).map(|i| (100 + i, 1 + i)).collect();
    idx.store_engine_chain(w, None, &chain, base);
    let before = idx.precise_dropped();
    let s = idx.store_tier_copies(w, Tier::Cpu, &[100, 101, 102], 1);
    assert_eq!(s.stored, 3);
    idx.store_engine_chain(w, Some(102), &[(103, 4)], base);
    let s = idx.store_tier_copies(w, Tier::Cpu, &[103], 1);
    assert_eq!(s.dropped, 1);
    assert_eq!(idx.precise_dropped() - before, 1);
}
