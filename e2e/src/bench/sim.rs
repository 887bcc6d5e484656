//! Simulated inference workers for the replay benchmark: a paged KV block pool
//! with LRU eviction that pins the blocks of running requests, a time model, and
//! an engine that steps like vLLM's scheduler ([`Engine`], used by `replay`).
//!
//! KV model (after vLLM's block manager, in blocks of the trace's block size):
//! - a running request holds (pins) its prompt blocks and the blocks its output
//!   will fill; pinned blocks are never evicted;
//! - when a request finishes its prompt blocks stay cached but evictable, freed
//!   tail first so that the least recently used block of a chain is its tail and
//!   shared prefixes are evicted last (vLLM frees a request's blocks in reverse);
//!   its output blocks are dropped (no later prompt names them);
//! - a request is admitted only when its new blocks fit next to the pinned ones
//!   (evicting cached blocks as needed); until then it waits at the head of the
//!   worker's queue, as in vLLM's first-come-first-served waiting queue. A
//!   request larger than the whole pool is admitted only on an idle worker;
//! - a request's prefix hit is the number of its leading blocks already in the
//!   worker's pool when it is admitted (prefix caching reuses leading blocks only).
//!
//! Engine model ([`Engine`], after vLLM's scheduler with chunked prefill), in
//! simulated milliseconds. The engine runs steps back to back while it has work.
//! Each step has a budget of `max_num_batched_tokens` tokens and at most
//! `max_num_seqs` running requests: every running request past its prefill
//! decodes one token first; the rest of the budget goes to prefills in first-come
//! first-served order, partial prefills of running requests before newly admitted
//! waiting ones, each taking as much of its uncached prompt as the budget leaves
//! (a chunk). A step takes [`TimeModel::step_ms`]: `prefill_fixed_ms +
//! prefill_tokens / prefill_tokens_per_s` if it prefills anything, plus
//! `decode_ms_per_token * (1 + (decodes - 1) / decode_batch_knee)` if it decodes
//! anything. A request's first token comes at the end of the step that completes
//! its prefill (at least one token is computed, even on a full hit); its
//! remaining `output_length - 1` tokens take one decoding step each. Modeled TTFT
//! is arrival to that step's end: queueing for admission, for budget and behind
//! other requests' chunks, plus the prefill.
//!
//! [`Worker`] is the older serial model the overload bench still uses: one
//! prefill at a time per worker taking [`TimeModel::prefill_ms`], then a decode of
//! [`TimeModel::decode_ms`] batched with the requests decoding when it starts.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::trace::TraceRequest;

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
    /// Tokens an engine step may compute (vLLM's `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Requests an engine may run at once (vLLM's `max_num_seqs`).
    pub max_num_seqs: usize,
}

impl Default for TimeModel {
    fn default() -> Self {
        TimeModel {
            prefill_tokens_per_s: 12_000.0,
            prefill_fixed_ms: 20.0,
            decode_ms_per_token: 25.0,
            decode_batch_knee: 32.0,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
        }
    }
}

impl TimeModel {
    /// `n` engines as one: `n`× the prefill throughput, step budget, running
    /// requests and decode batch knee, the same fixed and per-token costs. A
    /// step of it takes as long as `n` engines' steps side by side, each with
    /// `1/n` of its prefill tokens and decodes.
    pub fn pooled(&self, n: usize) -> TimeModel {
        let n = n.max(1);
        TimeModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s * n as f64,
            decode_batch_knee: self.decode_batch_knee * n as f64,
            max_num_batched_tokens: self.max_num_batched_tokens * n,
            max_num_seqs: self.max_num_seqs * n,
            ..*self
        }
    }

    /// A worker `speed` times as fast (a GPU generation apart): prefill
    /// throughput times `speed`, fixed and per-token times over it. A speed
    /// that is not finite and positive reads as 1.
    pub fn at_speed(&self, speed: f64) -> TimeModel {
        let s = match speed.is_finite() && speed > 0.0 {
            true => speed,
            false => 1.0,
        };
        TimeModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s * s,
            prefill_fixed_ms: self.prefill_fixed_ms / s,
            decode_ms_per_token: self.decode_ms_per_token / s,
            ..*self
        }
    }

    /// Prefill time of `uncached` tokens.
    pub fn prefill_ms(&self, uncached: usize) -> f64 {
        self.prefill_fixed_ms + uncached as f64 * 1000.0 / self.prefill_tokens_per_s
    }

    /// Decode time of `output` tokens when `decoding` other requests decode alongside.
    pub fn decode_ms(&self, output: usize, decoding: usize) -> f64 {
        output as f64 * self.decode_ms_per_token * (1.0 + decoding as f64 / self.decode_batch_knee)
    }

    /// Time of one engine step computing `prefill_tokens` prompt tokens and one
    /// token for each of `decodes` requests.
    pub fn step_ms(&self, prefill_tokens: usize, decodes: usize) -> f64 {
        let prefill = match prefill_tokens {
            0 => 0.0,
            n => self.prefill_ms(n),
        };
        let decode = match decodes {
            0 => 0.0,
            n => self.decode_ms(1, n - 1),
        };
        prefill + decode
    }
}

/// Blocks (of `block` tokens) a running request's output fills beyond its
/// prompt blocks.
pub fn output_blocks(r: &TraceRequest, block: usize) -> usize {
    (r.input_length + r.output_length)
        .div_ceil(block)
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

/// A request an [`Engine`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seq {
    /// Trace index.
    pub request: usize,
    /// Uncached prompt tokens still to compute.
    pub prefill_left: usize,
    /// Output tokens still to decode after the first.
    pub decode_left: usize,
    /// Tokens scheduled in the current step.
    scheduled: usize,
}

/// A request an [`Engine`] admitted at the start of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Trace index.
    pub request: usize,
    /// What the pool did: leading hits, stored and evicted blocks.
    pub stored: Stored,
}

/// The start of an engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStart {
    /// Its duration.
    pub ms: f64,
    /// Requests admitted for it, in admission order.
    pub admitted: Vec<Admitted>,
}

/// The end of an engine step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepEnd {
    /// Requests whose prefill completed (their first token is out).
    pub first_token: Vec<usize>,
    /// Requests that finished (their blocks released).
    pub finished: Vec<usize>,
    /// Blocks evicted when finished requests released theirs.
    pub evicted: Vec<u64>,
}

/// One simulated vLLM-style engine (see the module doc): a block pool, a
/// waiting queue, the running requests, and whether a step is under way.
#[derive(Debug, Clone)]
pub struct Engine {
    /// The KV block pool.
    pub pool: BlockPool,
    /// Requests (by index) waiting for admission, in arrival order.
    pub waiting: VecDeque<usize>,
    /// Running requests, in admission order.
    pub running: Vec<Seq>,
    /// Whether a step is under way.
    pub stepping: bool,
    /// Requests routed here and not finished.
    pub in_flight: usize,
    block: usize,
}

impl Engine {
    /// An idle engine with an empty pool of `capacity` blocks of `block` tokens.
    pub fn new(capacity: usize, block: usize) -> Self {
        Engine {
            pool: BlockPool::new(capacity),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stepping: false,
            in_flight: 0,
            block: block.max(1),
        }
    }

    /// Requests waiting or in prefill (admitted, prompt not done).
    pub fn ahead(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        let prefilling = self.running.iter().filter(|s| s.prefill_left > 0);
        self.waiting
            .iter()
            .copied()
            .chain(prefilling.map(|s| s.request))
    }

    /// Starts a step if there is work: decodes first, then partial prefills, then
    /// admissions from the waiting queue while budget, sequence slots and KV room
    /// last. `None` when idle (nothing runs and nothing can be admitted).
    pub fn begin_step(&mut self, trace: &[TraceRequest], model: &TimeModel) -> Option<StepStart> {
        debug_assert!(!self.stepping);
        let mut budget = model.max_num_batched_tokens.max(1);
        let mut decodes = 0;
        for seq in self.running.iter_mut().filter(|s| s.prefill_left == 0) {
            seq.scheduled = usize::from(budget > 0);
            budget -= seq.scheduled;
            decodes += seq.scheduled;
        }
        let mut prefill = 0;
        for seq in self.running.iter_mut().filter(|s| s.prefill_left > 0) {
            seq.scheduled = seq.prefill_left.min(budget);
            budget -= seq.scheduled;
            prefill += seq.scheduled;
        }
        let mut admitted = Vec::new();
        while budget > 0 && self.running.len() < model.max_num_seqs.max(1) {
            let Some(&r) = self.waiting.front() else {
                break;
            };
            let req = &trace[r];
            let extra = output_blocks(req, self.block);
            if !self.pool.fits(&req.hash_ids, extra) && !self.running.is_empty() {
                break;
            }
            self.waiting.pop_front();
            let stored = self.pool.acquire(&req.hash_ids, extra);
            let uncached = req
                .input_length
                .saturating_sub(stored.hits * self.block)
                .max(1);
            let scheduled = uncached.min(budget);
            budget -= scheduled;
            prefill += scheduled;
            self.running.push(Seq {
                request: r,
                prefill_left: uncached,
                decode_left: req.output_length.saturating_sub(1),
                scheduled,
            });
            admitted.push(Admitted { request: r, stored });
        }
        if prefill + decodes == 0 {
            return None;
        }
        self.stepping = true;
        Some(StepStart {
            ms: model.step_ms(prefill, decodes),
            admitted,
        })
    }

    /// Ends the step under way: applies its tokens, releases finished requests.
    pub fn end_step(&mut self, trace: &[TraceRequest]) -> StepEnd {
        self.stepping = false;
        let mut end = StepEnd::default();
        for seq in &mut self.running {
            let n = std::mem::take(&mut seq.scheduled);
            if seq.prefill_left > 0 {
                seq.prefill_left -= n;
                if seq.prefill_left == 0 {
                    end.first_token.push(seq.request);
                }
            } else {
                seq.decode_left -= n;
            }
        }
        let block = self.block;
        let pool = &mut self.pool;
        self.running.retain(|seq| {
            let done = seq.prefill_left == 0 && seq.decode_left == 0;
            if done {
                let req = &trace[seq.request];
                end.finished.push(seq.request);
                end.evicted
                    .extend(pool.release(&req.hash_ids, output_blocks(req, block)));
            }
            !done
        });
        self.in_flight -= end.finished.len();
        end
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
        assert_eq!(output_blocks(&r, 512), 1);
        assert_eq!(output_blocks(&r, 64), 18 - 2);
        let short = TraceRequest {
            output_length: 24,
            ..r.clone()
        };
        assert_eq!(output_blocks(&short, 512), 0);
    }

    fn req(input_length: usize, output_length: usize, first_id: u64) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length,
            output_length,
            hash_ids: (first_id..first_id + input_length.div_ceil(512) as u64).collect(),
        }
    }

    #[test]
    fn a_short_prompt_behind_a_long_one_shares_the_long_ones_last_chunk() {
        // 10,000 tokens then 500 under an 8,192-token budget: step 1 is the long
        // prompt's first chunk; step 2 its last 1,808 tokens and the whole short
        // prompt, so both first tokens come out of step 2 (one prefill at a time
        // would have the short prompt wait for the whole long prefill).
        let m = TimeModel::default();
        let trace = vec![req(10_000, 2, 0), req(500, 2, 100)];
        let mut e = Engine::new(1000, 512);
        e.waiting.extend([0, 1]);
        e.in_flight = 2;
        let s1 = e.begin_step(&trace, &m).unwrap();
        assert_eq!(
            s1.admitted.len(),
            1,
            "the budget is spent on the long prompt"
        );
        assert!((s1.ms - m.step_ms(8192, 0)).abs() < 1e-9);
        assert!(e.end_step(&trace).first_token.is_empty());
        let s2 = e.begin_step(&trace, &m).unwrap();
        assert_eq!(s2.admitted.len(), 1);
        assert!((s2.ms - m.step_ms(1808 + 500, 0)).abs() < 1e-9);
        assert_eq!(e.end_step(&trace).first_token, vec![0, 1]);
        // Then both decode their second (last) token in one step and finish.
        let s3 = e.begin_step(&trace, &m).unwrap();
        assert!((s3.ms - m.step_ms(0, 2)).abs() < 1e-9);
        let end = e.end_step(&trace);
        assert_eq!(end.finished, vec![0, 1]);
        assert_eq!((e.in_flight, e.pool.in_use()), (0, 0));
        assert!(e.begin_step(&trace, &m).is_none(), "idle");
    }

    #[test]
    fn decodes_go_first_and_a_prefill_chunk_slows_their_step() {
        let m = TimeModel {
            max_num_batched_tokens: 1000,
            ..TimeModel::default()
        };
        let trace = vec![req(100, 3, 0), req(5000, 1, 100)];
        let mut e = Engine::new(1000, 512);
        e.waiting.push_back(0);
        e.in_flight = 2;
        e.begin_step(&trace, &m).unwrap();
        assert_eq!(e.end_step(&trace).first_token, vec![0]);
        e.waiting.push_back(1);
        // Request 0 decodes one token; the long prompt gets the other 999.
        let s = e.begin_step(&trace, &m).unwrap();
        assert!((s.ms - m.step_ms(999, 1)).abs() < 1e-9);
        assert!(s.ms > m.step_ms(0, 1) + 80.0, "the chunk stalls the decode");
        e.end_step(&trace);
        assert_eq!(e.running[1].prefill_left, 5000 - 999);
    }

    #[test]
    fn admission_stops_at_max_num_seqs_and_at_a_full_pool_and_counts_hits() {
        let m = TimeModel {
            max_num_seqs: 1,
            ..TimeModel::default()
        };
        let trace = vec![req(1024, 1, 0), req(1024, 1, 0), req(600, 1, 0)];
        let mut e = Engine::new(1000, 512);
        e.waiting.extend([0, 1]);
        e.in_flight = 2;
        assert_eq!(e.begin_step(&trace, &m).unwrap().admitted.len(), 1);
        assert_eq!(e.end_step(&trace).finished, vec![0]);
        let s = e.begin_step(&trace, &m).unwrap();
        assert_eq!(s.admitted[0].stored.hits, 2);
        // A full hit still computes one token.
        assert!((s.ms - m.step_ms(1, 0)).abs() < 1e-9);
        e.end_step(&trace);
        // A pool of 2 blocks: the 2-block request running keeps a 1-block one out.
        let mut small = Engine::new(2, 512);
        let trace = vec![req(1024, 5, 0), req(512, 1, 50)];
        small.waiting.extend([0, 1]);
        small.in_flight = 2;
        assert_eq!(
            small
                .begin_step(&trace, &TimeModel::default())
                .unwrap()
                .admitted
                .len(),
            1
        );
        assert_eq!(small.waiting.len(), 1);
    }

    #[test]
    fn prefill_time_grows_with_uncached_tokens_and_decode_with_the_batch() {
        let m = TimeModel::default();
        assert!(m.prefill_ms(12_000) > m.prefill_ms(0) + 999.0);
        assert!(m.prefill_ms(1024) > m.prefill_ms(512));
        assert!(m.decode_ms(10, 32) > 1.9 * m.decode_ms(10, 0));
    }
}
