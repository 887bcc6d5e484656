//! Simulated inference workers for the replay benchmark: a paged KV block pool
//! with LRU eviction that pins the blocks of running requests, and a time model.
//!
//! KV model (after vLLM's block manager, in 512-token blocks):
//! - a running request holds (pins) its prompt blocks and the blocks its output
//!   will fill; pinned blocks are never evicted;
//! - when a request finishes its prompt blocks stay cached but evictable, freed
//!   tail first so that the least recently used block of a chain is its tail and
//!   shared prefixes are evicted last (vLLM frees a request's blocks in reverse);
//!   its output blocks are dropped (no later prompt names them);
//! - a request's prefill may start only when its new blocks fit next to the
//!   pinned ones (evicting cached blocks as needed); until then it waits at the
//!   head of the worker's queue, as in vLLM's first-come-first-served waiting
//!   queue. A request larger than the whole pool starts only on an idle worker.
//!
//! Time model (all in simulated milliseconds):
//! - prefill runs one request at a time per worker, first come first served, and
//!   takes `prefill_fixed_ms + uncached_tokens / prefill_tokens_per_s`;
//! - a request's prefix hit is the number of its leading blocks already in the
//!   worker's pool when its prefill starts (prefix caching reuses leading blocks
//!   only);
//! - decode runs batched: each output token takes
//!   `decode_ms_per_token * (1 + decoding / decode_batch_knee)`, where `decoding`
//!   is the number of requests decoding on that worker when this one starts;
//! - modeled TTFT is queueing (for prefill and for KV room) plus the prefill.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::trace::{TraceRequest, BLOCK_TOKENS};

/// Parameters of the time model.
#[derive(Debug, Clone, Copy)]
pub struct TimeModel {
    /// Prefill throughput of one worker on uncached tokens.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of every prefill (scheduling, first forward pass).
    pub prefill_fixed_ms: f64,
    /// Time per output token of a lone request.
    pub decode_ms_per_token: f64,
    /// Decoding requests at which per-token time has doubled.
    pub decode_batch_knee: f64,
}

impl Default for TimeModel {
    fn default() -> Self {
        TimeModel {
            prefill_tokens_per_s: 12_000.0,
            prefill_fixed_ms: 20.0,
            decode_ms_per_token: 25.0,
            decode_batch_knee: 32.0,
        }
    }
}

impl TimeModel {
    /// Prefill time of `uncached` tokens.
    pub fn prefill_ms(&self, uncached: usize) -> f64 {
        self.prefill_fixed_ms + uncached as f64 * 1000.0 / self.prefill_tokens_per_s
    }

    /// Decode time of `output` tokens when `decoding` other requests decode alongside.
    pub fn decode_ms(&self, output: usize, decoding: usize) -> f64 {
        output as f64 * self.decode_ms_per_token * (1.0 + decoding as f64 / self.decode_batch_knee)
    }
}

/// Blocks a running request's output fills beyond its prompt blocks.
pub fn output_blocks(r: &TraceRequest) -> usize {
    (r.input_length + r.output_length)
        .div_ceil(BLOCK_TOKENS)
        .saturating_sub(r.hash_ids.len())
}

/// What a pool did for one request: leading hits, blocks newly stored, blocks evicted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// Leading blocks found in the pool.
    pub hits: usize,
    /// Ids newly stored, in prompt order.
    pub stored: Vec<u64>,
    /// Ids evicted to make room.
    pub evicted: Vec<u64>,
}

/// A paged KV block pool: blocks pinned by running requests, cached blocks with
/// least-recently-used eviction, and anonymous output blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    capacity: usize,
    clock: u64,
    /// Cached, unpinned blocks → last use.
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    /// Blocks held by running requests → holders.
    pinned: HashMap<u64, u32>,
    /// Output blocks held by running requests.
    reserved: usize,
}

impl BlockPool {
    /// An empty pool holding at most `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        BlockPool {
            capacity: capacity.max(1),
            clock: 0,
            last_use: HashMap::new(),
            by_age: BTreeMap::new(),
            pinned: HashMap::new(),
            reserved: 0,
        }
    }

    /// Blocks held, cached or pinned (output blocks not counted).
    pub fn len(&self) -> usize {
        self.last_use.len() + self.pinned.len()
    }

    /// Whether the pool holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks in use by running requests (pinned prompt blocks and output blocks).
    pub fn in_use(&self) -> usize {
        self.pinned.len() + self.reserved
    }

    /// Share of the pool in use by running requests, 0..1 (what vLLM reports as
    /// KV-cache usage: cached free blocks do not count).
    pub fn usage(&self) -> f64 {
        (self.in_use() as f64 / self.capacity as f64).min(1.0)
    }

    /// Whether block `id` is held.
    pub fn contains(&self, id: u64) -> bool {
        self.last_use.contains_key(&id) || self.pinned.contains_key(&id)
    }

    /// How many leading blocks of `ids` are held (stops at the first miss).
    pub fn prefix_hits(&self, ids: &[u64]) -> usize {
        ids.iter().take_while(|id| self.contains(**id)).count()
    }

    /// Whether a request with prompt blocks `ids` and `extra` output blocks fits
    /// next to the pinned blocks (cached blocks can be evicted for it).
    pub fn fits(&self, ids: &[u64], extra: usize) -> bool {
        let new_pins = ids
            .iter()
            .filter(|id| !self.pinned.contains_key(id))
            .count();
        self.pinned.len() + new_pins + self.reserved + extra <= self.capacity
    }

    /// Stores or touches `ids` without pinning them, tail first (so the head is
    /// the most recent), evicting least recently used blocks beyond capacity.
    pub fn store(&mut self, ids: &[u64]) -> Stored {
        let hits = self.prefix_hits(ids);
        let mut stored = Vec::new();
        for &id in ids.iter().rev() {
            if !self.contains(id) {
                stored.push(id);
            }
            if !self.pinned.contains_key(&id) {
                self.touch(id);
            }
        }
        stored.reverse();
        let evicted = self.evict();
        stored.retain(|id| self.contains(*id));
        Stored {
            hits,
            stored,
            evicted,
        }
    }

    /// A request starts: pins its prompt blocks `ids` and reserves `extra` output
    /// blocks, evicting cached blocks to make room.
    pub fn acquire(&mut self, ids: &[u64], extra: usize) -> Stored {
        let hits = self.prefix_hits(ids);
        let mut stored = Vec::new();
        for &id in ids {
            if !self.contains(id) {
                stored.push(id);
            }
            if let Some(age) = self.last_use.remove(&id) {
                self.by_age.remove(&age);
            }
            *self.pinned.entry(id).or_insert(0) += 1;
        }
        self.reserved += extra;
        let evicted = self.evict();
        Stored {
            hits,
            stored,
            evicted,
        }
    }

    /// A request finished: unpins its prompt blocks (tail first, so its head is
    /// the most recently used) and drops its output blocks. Returns evicted ids
    /// (a pool overfilled by a request larger than itself shrinks back).
    pub fn release(&mut self, ids: &[u64], extra: usize) -> Vec<u64> {
        self.reserved = self.reserved.saturating_sub(extra);
        for &id in ids.iter().rev() {
            let Some(n) = self.pinned.get_mut(&id) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.pinned.remove(&id);
                self.touch(id);
            }
        }
        self.evict()
    }

    fn touch(&mut self, id: u64) {
        self.clock += 1;
        if let Some(old) = self.last_use.insert(id, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, id);
    }

    /// Evicts cached blocks, least recently used first, while over capacity.
    fn evict(&mut self) -> Vec<u64> {
        let mut evicted = Vec::new();
        while self.len() + self.reserved > self.capacity {
            let Some((_, id)) = self.by_age.pop_first() else {
                break;
            };
            self.last_use.remove(&id);
            evicted.push(id);
        }
        evicted
    }
}

/// One simulated worker: its block pool, its prefill queue and its decoders.
#[derive(Debug, Clone)]
pub struct Worker {
    /// The KV block pool.
    pub pool: BlockPool,
    /// Requests (by index) waiting for prefill, in arrival order.
    pub queue: VecDeque<usize>,
    /// The request in prefill, if any.
    pub prefilling: Option<usize>,
    /// Requests decoding now.
    pub decoding: usize,
    /// Requests routed here and not finished.
    pub in_flight: usize,
}

impl Worker {
    /// An idle worker with an empty pool of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Worker {
            pool: BlockPool::new(capacity),
            queue: VecDeque::new(),
            prefilling: None,
            decoding: 0,
            in_flight: 0,
        }
    }

    /// Requests in prefill or decode.
    pub fn running(&self) -> usize {
        self.decoding + usize::from(self.prefilling.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_counts_leading_hits_and_evicts_tails_first() {
        let mut p = BlockPool::new(3);
        let s = p.store(&[1, 2, 3]);
        assert_eq!((s.hits, s.stored, s.evicted), (0, vec![1, 2, 3], vec![]));
        assert_eq!(p.prefix_hits(&[1, 2, 9, 3]), 2);
        // Stored tail first: 3 is the least recent, then 2; touching 2 leaves 3.
        p.store(&[2]);
        assert_eq!(p.store(&[4]).evicted, vec![3]);
        assert!(p.contains(1) && p.contains(2) && p.contains(4) && !p.contains(3));
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn a_request_longer_than_the_pool_keeps_its_head() {
        let mut p = BlockPool::new(2);
        p.store(&[7]);
        let s = p.store(&[1, 2, 3]);
        assert_eq!(s.stored, vec![1, 2]);
        assert_eq!(s.evicted, vec![7, 3]);
        assert_eq!(p.prefix_hits(&[1, 2]), 2);
    }

    #[test]
    fn eviction_never_takes_blocks_of_running_requests() {
        let mut p = BlockPool::new(4);
        // A running request pins 1, 2 and one output block.
        let s = p.acquire(&[1, 2], 1);
        assert_eq!((s.hits, s.stored.len()), (0, 2));
        assert_eq!(p.in_use(), 3);
        assert!((p.usage() - 0.75).abs() < 1e-9);
        // Cached blocks 5 and 6 squeeze in; only unpinned ones are evicted.
        p.store(&[5]);
        let s = p.store(&[6]);
        assert_eq!(s.evicted, vec![5]);
        assert!(p.contains(1) && p.contains(2) && p.contains(6));
        // Nothing beyond the pinned blocks fits a 2-block request with no room.
        assert!(!p.fits(&[8, 9], 0));
        assert!(
            p.fits(&[1, 2, 8], 0),
            "pinned blocks are shared, not counted twice"
        );
        // Finished: its blocks become cached (head most recent), output dropped.
        assert!(p.release(&[1, 2], 1).is_empty());
        assert_eq!(p.in_use(), 0);
        assert!(p.fits(&[8, 9, 10, 11], 0));
        let s = p.acquire(&[8, 9, 10], 0);
        // LRU order now: 6 (oldest), 2, 1: two go, the head 1 stays.
        assert_eq!(s.evicted, vec![6, 2]);
        assert!(p.contains(1));
    }

    #[test]
    fn shared_blocks_stay_pinned_until_every_holder_finishes() {
        let mut p = BlockPool::new(3);
        p.acquire(&[1, 2], 0);
        let s = p.acquire(&[1, 3], 0);
        assert_eq!((s.hits, s.stored), (1, vec![3]));
        p.release(&[1, 2], 0);
        // 1 is still held by the second request: a 2-block newcomer can only evict 2.
        let s = p.store(&[4]);
        assert_eq!(s.evicted, vec![2]);
        assert!(p.contains(1) && p.contains(3) && p.contains(4));
        assert!(!p.fits(&[5, 6], 0));
    }

    #[test]
    fn output_blocks_cover_the_generated_tokens() {
        let r = TraceRequest {
            timestamp: 0,
            input_length: 1000,
            output_length: 100,
            hash_ids: vec![1, 2],
        };
        assert_eq!(output_blocks(&r), 1);
        let short = TraceRequest {
            output_length: 24,
            ..r.clone()
        };
        assert_eq!(output_blocks(&short), 0);
    }

    #[test]
    fn prefill_time_grows_with_uncached_tokens_and_decode_with_the_batch() {
        let m = TimeModel::default();
        assert!(m.prefill_ms(12_000) > m.prefill_ms(0) + 999.0);
        assert!(m.prefill_ms(1024) > m.prefill_ms(512));
        assert!(m.decode_ms(10, 32) > 1.9 * m.decode_ms(10, 0));
    }
}
