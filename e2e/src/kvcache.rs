//! A simulated paged KV cache: fixed-size token blocks identified by chained
//! hashes, a finite pool with LRU eviction, session pinning, and prefix-hit
//! accounting, with the events a real engine would publish.
//!
//! With an offload tier ([`KvCache::with_offload`]) a block evicted from the
//! GPU pool is copied to a bounded CPU pool first (its own LRU), as vLLM's CPU
//! offloading keeps it: a prompt whose leading blocks the GPU lacks but the
//! CPU pool holds loads them back (counted apart from GPU hits and from
//! prefill) and the CPU copies stay.

use std::collections::{BTreeSet, HashMap, HashSet};

/// What changed in the pool, in engine-event terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive full blocks were stored; `parent` is the block before the first.
    Stored {
        /// Hashes of the stored blocks, in prefix order.
        hashes: Vec<u64>,
        /// The hash of the block preceding the first one, if any.
        parent: Option<u64>,
        /// The tokens of all stored blocks, concatenated.
        tokens: Vec<u32>,
    },
    /// Blocks were evicted or freed.
    Removed(Vec<u64>),
    /// Blocks were copied to the CPU tier (before their GPU eviction).
    Offloaded(Vec<u64>),
    /// Blocks were dropped from the CPU tier.
    OffloadDropped(Vec<u64>),
}

/// The outcome of running one prompt through the cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Prompt tokens found in the cache (whole blocks of the longest cached prefix).
    pub hit_tokens: usize,
    /// Prompt tokens after those loaded back from the CPU tier (whole blocks
    /// continuing the cached prefix).
    pub cpu_hit_tokens: usize,
    /// Prompt tokens looked up.
    pub queried_tokens: usize,
    /// Events to publish, in order.
    pub events: Vec<CacheEvent>,
}

#[derive(Debug)]
struct Block {
    last_used: u64,
    pins: u32,
}

/// The block pool.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, Block>,
    /// Unpinned blocks by (last use, hash): the eviction order.
    lru: BTreeSet<(u64, u64)>,
    clock: u64,
    /// The CPU tier, when there is one.
    offload: Option<Offload>,
}

/// The CPU tier: a bounded pool of copies, least recently used out first.
#[derive(Debug)]
struct Offload {
    capacity: usize,
    /// Block → last use.
    blocks: HashMap<u64, u64>,
    lru: BTreeSet<(u64, u64)>,
}

impl Offload {
    /// Marks `hash` used at `now`; false when the tier does not hold it.
    fn touch(&mut self, hash: u64, now: u64) -> bool {
        let Some(last) = self.blocks.get_mut(&hash) else {
            return false;
        };
        self.lru.remove(&(*last, hash));
        *last = now;
        self.lru.insert((now, hash));
        true
    }

    /// Copies `hash` in at `now` (a copy it holds is touched): whether it is
    /// new, and the block dropped to make room.
    fn store(&mut self, hash: u64, now: u64) -> (bool, Option<u64>) {
        if self.touch(hash, now) {
            return (false, None);
        }
        let dropped = if self.blocks.len() >= self.capacity {
            self.lru.pop_first().map(|(_, h)| {
                self.blocks.remove(&h);
                h
            })
        } else {
            None
        };
        self.blocks.insert(hash, now);
        self.lru.insert((now, hash));
        (true, dropped)
    }
}

/// The hash of a block given its parent's hash and its tokens (64-bit FNV-1a over
/// the parent hash and the token ids, little-endian).
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    feed(&parent.unwrap_or(0).to_le_bytes());
    for t in tokens {
        feed(&t.to_le_bytes());
    }
    h
}

/// The chained hashes of every full block of `tokens`.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            let h = block_hash(parent, chunk);
            parent = Some(h);
            h
        })
        .collect()
}

impl KvCache {
    /// A pool of `capacity` blocks of `block_size` tokens.
    pub fn new(block_size: usize, capacity: usize) -> Self {
        KvCache {
            block_size: block_size.max(1),
            capacity: capacity.max(1),
            blocks: HashMap::new(),
            lru: BTreeSet::new(),
            clock: 0,
            offload: None,
        }
    }

    /// A pool of `capacity` blocks of `block_size` tokens whose evicted
    /// blocks go to a CPU tier of `cpu_capacity` blocks (none when 0).
    pub fn with_offload(block_size: usize, capacity: usize, cpu_capacity: usize) -> Self {
        KvCache {
            offload: (cpu_capacity > 0).then(|| Offload {
                capacity: cpu_capacity,
                blocks: HashMap::new(),
                lru: BTreeSet::new(),
            }),
            ..KvCache::new(block_size, capacity)
        }
    }

    /// Whether the CPU tier holds a copy of a block.
    pub fn offloaded(&self, hash: u64) -> bool {
        self.offload
            .as_ref()
            .is_some_and(|o| o.blocks.contains_key(&hash))
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks currently held.
    pub fn used(&self) -> usize {
        self.blocks.len()
    }

    /// Whether a block is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Counts the cached prefix of `tokens` without changing anything.
    pub fn peek_hit_tokens(&self, tokens: &[u32]) -> usize {
        prefix_hashes(tokens, self.block_size)
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
            * self.block_size
    }

    /// Runs a prompt through the cache: counts the cached prefix, refreshes it,
    /// and stores the prompt's remaining full blocks (evicting least recently used
    /// unpinned blocks when full). Returns the hashes of all the prompt's blocks now
    /// in the pool with the accounting and events.
    pub fn access(&mut self, tokens: &[u32]) -> (Access, Vec<u64>) {
        let hashes = prefix_hashes(tokens, self.block_size);
        let hit_blocks = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        // The blocks after the GPU's that the CPU tier holds load back.
        let cpu_blocks = match &self.offload {
            Some(o) => hashes[hit_blocks..]
                .iter()
                .take_while(|h| o.blocks.contains_key(h))
                .count(),
            None => 0,
        };
        let mut access = Access {
            hit_tokens: hit_blocks * self.block_size,
            cpu_hit_tokens: cpu_blocks * self.block_size,
            queried_tokens: tokens.len(),
            events: Vec::new(),
        };
        for h in &hashes[hit_blocks..hit_blocks + cpu_blocks] {
            self.clock += 1;
            if let Some(o) = &mut self.offload {
                o.touch(*h, self.clock);
            }
        }
        let mut present = Vec::with_capacity(hashes.len());
        for h in &hashes[..hit_blocks] {
            self.touch(*h);
            present.push(*h);
        }
        let mut stored = Vec::new();
        let mut stored_tokens = Vec::new();
        let mut removed = Vec::new();
        for (i, h) in hashes.iter().enumerate().skip(hit_blocks) {
            if self.blocks.contains_key(h) {
                // A later block survived while an earlier one was evicted: reuse it.
                self.touch(*h);
                present.push(*h);
                continue;
            }
            if self.blocks.len() >= self.capacity {
                match self.evict_one(&present) {
                    Some(victim) => removed.push(victim),
                    None => break, // everything is pinned or in use by this prompt
                }
            }
            self.clock += 1;
            self.blocks.insert(
                *h,
                Block {
                    last_used: self.clock,
                    pins: 0,
                },
            );
            self.lru.insert((self.clock, *h));
            present.push(*h);
            stored.push(*h);
            stored_tokens
                .extend_from_slice(&tokens[i * self.block_size..(i + 1) * self.block_size]);
        }
        if !removed.is_empty() {
            // Copied to the CPU tier before the GPU lets them go.
            let (offloaded, dropped) = self.offload_evicted(&removed);
            if !dropped.is_empty() {
                access.events.push(CacheEvent::OffloadDropped(dropped));
            }
            if !offloaded.is_empty() {
                access.events.push(CacheEvent::Offloaded(offloaded));
            }
            access.events.push(CacheEvent::Removed(removed));
        }
        if let Some(first) = stored.first() {
            let at = hashes.iter().position(|h| h == first).unwrap_or(0);
            access.events.push(CacheEvent::Stored {
                hashes: stored,
                parent: at.checked_sub(1).map(|p| hashes[p]),
                tokens: stored_tokens,
            });
        }
        (access, present)
    }

    fn touch(&mut self, hash: u64) {
        self.clock += 1;
        if let Some(b) = self.blocks.get_mut(&hash) {
            if b.pins == 0 {
                self.lru.remove(&(b.last_used, hash));
                self.lru.insert((self.clock, hash));
            }
            b.last_used = self.clock;
        }
    }

    /// Copies blocks the GPU evicts to the CPU tier: those new there, and
    /// those it drops to make room (a block both copied and dropped within
    /// the call is neither).
    fn offload_evicted(&mut self, evicted: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let (mut offloaded, mut dropped) = (Vec::new(), Vec::new());
        let Some(o) = &mut self.offload else {
            return (offloaded, dropped);
        };
        for h in evicted {
            self.clock += 1;
            let (new, out) = o.store(*h, self.clock);
            if new {
                offloaded.push(*h);
            }
            if let Some(d) = out {
                match offloaded.iter().position(|x| *x == d) {
                    Some(i) => {
                        offloaded.remove(i);
                    }
                    None => dropped.push(d),
                }
            }
        }
        (offloaded, dropped)
    }

    fn evict_one(&mut self, keep: &[u64]) -> Option<u64> {
        let victim = self.lru.iter().find(|(_, h)| !keep.contains(h)).copied()?;
        self.lru.remove(&victim);
        self.blocks.remove(&victim.1);
        Some(victim.1)
    }

    /// Pins blocks (a session holds them): they are not evicted until unpinned.
    pub fn pin(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(b) = self.blocks.get_mut(h) {
                if b.pins == 0 {
                    self.lru.remove(&(b.last_used, *h));
                }
                b.pins += 1;
            }
        }
    }

    /// Unpins blocks; those in `free` that end up unpinned are removed from the pool.
    pub fn release(&mut self, hashes: &[u64], free: &HashSet<u64>) -> Vec<u64> {
        let mut removed = Vec::new();
        for h in hashes {
            let Some(b) = self.blocks.get_mut(h) else {
                continue;
            };
            b.pins = b.pins.saturating_sub(1);
            if b.pins > 0 {
                continue;
            }
            if free.contains(h) {
                self.blocks.remove(h);
                removed.push(*h);
            } else {
                self.lru.insert((b.last_used, *h));
            }
        }
        removed
    }

    /// Drops every block, on both tiers.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        if let Some(o) = &mut self.offload {
            o.blocks.clear();
            o.lru.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn second_access_hits_the_full_block_prefix() {
        let mut c = KvCache::new(16, 100);
        let t = toks(40, 0);
        let (a, present) = c.access(&t);
        assert_eq!((a.hit_tokens, a.queried_tokens), (0, 40));
        assert_eq!(present.len(), 2);
        let CacheEvent::Stored {
            hashes,
            parent,
            tokens,
        } = &a.events[0]
        else {
            panic!("expected a store, got {:?}", a.events)
        };
        assert_eq!((hashes.len(), *parent, tokens.len()), (2, None, 32));
        let mut longer = t.clone();
        longer.extend(toks(20, 1));
        let (b, _) = c.access(&longer);
        assert_eq!(b.hit_tokens, 32);
        let CacheEvent::Stored { parent, .. } = &b.events[0] else {
            panic!()
        };
        assert_eq!(
            *parent,
            Some(present[1]),
            "new blocks chain to the cached prefix"
        );
    }

    #[test]
    fn full_pool_evicts_least_recently_used_unpinned() {
        let mut c = KvCache::new(4, 3);
        let (_, a) = c.access(&toks(4, 1));
        let (_, b) = c.access(&toks(4, 2));
        let (_, d) = c.access(&toks(4, 3));
        c.pin(&a);
        c.access(&toks(4, 3)); // d becomes most recent
        let (e, _) = c.access(&toks(4, 4));
        assert_eq!(e.events[0], CacheEvent::Removed(b.clone()));
        assert!(c.contains(a[0]) && c.contains(d[0]) && !c.contains(b[0]));
        assert_eq!(c.used(), 3);
    }

    #[test]
    fn release_frees_only_the_listed_unpinned_blocks() {
        let mut c = KvCache::new(4, 10);
        let (_, shared) = c.access(&toks(4, 1));
        let (_, own) = c.access(&toks(8, 1));
        c.pin(&own);
        c.pin(&shared);
        let free: HashSet<u64> = [own[1]].into_iter().collect();
        let removed = c.release(&own, &free);
        assert_eq!(removed, vec![own[1]]);
        assert!(c.contains(shared[0]), "still pinned once");
        assert_eq!(c.used(), 1);
    }

    #[test]
    fn evicted_blocks_go_to_the_cpu_tier_and_load_back_from_it() {
        let mut c = KvCache::with_offload(4, 4, 8);
        let p = toks(16, 1);
        let (_, held) = c.access(&p);
        // Another prompt takes the whole pool: p's blocks are copied to the
        // CPU tier before the GPU evicts them.
        let (a, _) = c.access(&toks(16, 2));
        let at = |e: &dyn Fn(&CacheEvent) -> bool| a.events.iter().position(e);
        let copied = at(&|e| matches!(e, CacheEvent::Offloaded(h) if *h == held));
        let evicted = at(&|e| matches!(e, CacheEvent::Removed(h) if *h == held));
        assert!(copied.is_some() && copied < evicted, "{:?}", a.events);
        assert!(held.iter().all(|h| c.offloaded(*h) && !c.contains(*h)));
        // p again: no GPU hit, every block loaded back from the CPU tier.
        let (b, _) = c.access(&p);
        assert_eq!((b.hit_tokens, b.cpu_hit_tokens), (0, 16));
        assert!(held.iter().all(|h| c.contains(*h) && c.offloaded(*h)));
        // The CPU tier is bounded (8 blocks: p's and the second prompt's):
        // a third prompt's evicted blocks drop its least recently used
        // copies, the second prompt's, each reported once; p's, touched by
        // its load, stay.
        let (_, second) = c.access(&toks(16, 2));
        c.access(&toks(16, 3));
        let (d, _) = c.access(&p);
        let dropped: Vec<u64> = d
            .events
            .iter()
            .flat_map(|e| match e {
                CacheEvent::OffloadDropped(h) => h.clone(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(dropped.len(), 4, "{:?}", d.events);
        assert!(second.iter().all(|h| !c.offloaded(*h)));
        assert!(held.iter().all(|h| c.offloaded(*h)));
    }

    #[test]
    fn without_an_offload_tier_nothing_is_copied() {
        let mut c = KvCache::new(4, 1);
        c.access(&toks(4, 1));
        let (a, _) = c.access(&toks(4, 2));
        assert!(a
            .events
            .iter()
            .all(|e| !matches!(e, CacheEvent::Offloaded(_))));
        assert_eq!(c.access(&toks(4, 1)).0.cpu_hit_tokens, 0);
    }
}
