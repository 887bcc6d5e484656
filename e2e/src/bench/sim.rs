//! Simulated inference workers for the replay benchmark: a prefix KV block pool
//! with LRU eviction and a simple time model.
//!
//! Time model (all in simulated milliseconds):
//! - prefill runs one request at a time per worker, first come first served, and
//!   takes `prefill_fixed_ms + uncached_tokens / prefill_tokens_per_s`;
//! - a request's prefix hit is the number of its leading blocks already in the
//!   worker's pool when its prefill starts (prefix caching reuses leading blocks
//!   only); its blocks are then stored (touched) in the pool, evicting the least
//!   recently used beyond capacity;
//! - decode runs concurrently: each output token takes
//!   `decode_ms_per_token * (1 + decoding / decode_batch_knee)`, where `decoding` is
//!   the number of requests decoding on that worker when this one starts decoding;
//! - modeled TTFT is queueing for prefill plus the prefill itself.

use std::collections::{BTreeMap, HashMap, VecDeque};

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

/// A KV block pool with least-recently-used eviction, keyed by block id.
#[derive(Debug, Clone)]
pub struct BlockPool {
    capacity: usize,
    clock: u64,
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl BlockPool {
    /// An empty pool holding at most `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        BlockPool {
            capacity: capacity.max(1),
            clock: 0,
            last_use: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    /// Whether the pool is empty.
    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }

    /// Whether block `id` is held.
    pub fn contains(&self, id: u64) -> bool {
        self.last_use.contains_key(&id)
    }

    /// How many leading blocks of `ids` are held (stops at the first miss).
    pub fn prefix_hits(&self, ids: &[u64]) -> usize {
        ids.iter().take_while(|id| self.contains(**id)).count()
    }

    /// Stores or touches `ids` in order, evicting the least recently used blocks
    /// beyond capacity. Returns (newly stored ids, evicted ids).
    pub fn store(&mut self, ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let mut stored = Vec::new();
        for &id in ids {
            self.clock += 1;
            match self.last_use.insert(id, self.clock) {
                Some(old) => {
                    self.by_age.remove(&old);
                }
                None => stored.push(id),
            }
            self.by_age.insert(self.clock, id);
        }
        let mut evicted = Vec::new();
        while self.last_use.len() > self.capacity {
            let (_, id) = self.by_age.pop_first().expect("ages mirror entries");
            self.last_use.remove(&id);
            evicted.push(id);
        }
        // A block stored and evicted in the same call (request longer than the pool)
        // was never visible: report it in neither list.
        evicted.retain(|id| !stored.contains(id));
        stored.retain(|id| self.last_use.contains_key(id));
        (stored, evicted)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_counts_leading_hits_and_evicts_least_recent() {
        let mut p = BlockPool::new(3);
        assert_eq!(p.store(&[1, 2, 3]), (vec![1, 2, 3], vec![]));
        assert_eq!(p.prefix_hits(&[1, 2, 9, 3]), 2);
        // Touch 1, then add 4: 2 is now the least recently used.
        p.store(&[1]);
        assert_eq!(p.store(&[4]), (vec![4], vec![2]));
        assert!(p.contains(1) && p.contains(3) && p.contains(4) && !p.contains(2));
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn a_request_longer_than_the_pool_keeps_its_tail() {
        let mut p = BlockPool::new(2);
        p.store(&[7]);
        let (stored, evicted) = p.store(&[1, 2, 3]);
        assert_eq!(stored, vec![2, 3]);
        assert_eq!(evicted, vec![7]);
        assert_eq!(p.prefix_hits(&[2, 3]), 2);
    }

    #[test]
    fn time_model_scales_with_uncached_tokens_and_batch() {
        let m = TimeModel::default();
        assert!(m.prefill_ms(12_000) > m.prefill_ms(0) + 999.0);
        assert!(m.decode_ms(10, 32) > 1.9 * m.decode_ms(10, 0));
    }
}
