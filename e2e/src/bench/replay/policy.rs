//! What a routing policy sees and does: the worker view, the KV events it may
//! follow, the [`RoutingPolicy`] trait, and the replay's settings.

use std::time::Duration;

use kvpick::scheduler::{TermWeights, DEFAULT_PROVISIONAL_TTL, PENDING_PREFILL_WEIGHT};

use super::feed::PredictionError;
use crate::bench::sim::TimeModel;
use crate::bench::trace::{TraceRequest, BLOCK_TOKENS};

/// What a router can read of one worker when it routes: the engine's metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerView {
    /// Requests waiting for prefill (vLLM's `num_requests_waiting`).
    pub waiting: usize,
    /// Requests in prefill or decode (`num_requests_running`).
    pub running: usize,
    /// Share of KV blocks held by running requests, 0..1 (`kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// KV pool size in blocks of the trace's block size (`num_gpu_blocks`).
    pub capacity_blocks: usize,
}

/// A worker's KV event as it reaches the router.
#[derive(Debug, Clone, Copy)]
pub enum KvEvent<'a> {
    /// `request`'s prompt blocks `request.hash_ids[from..]` were stored (their
    /// parent is `hash_ids[from - 1]`); sent once per request when its prefill
    /// completes, possibly empty.
    Stored {
        /// Trace index of the request.
        id: usize,
        /// The request.
        request: &'a TraceRequest,
        /// First newly stored block.
        from: usize,
    },
    /// Blocks (trace block ids) were evicted.
    Removed(&'a [u64]),
}

/// A routing policy under test. Times are simulated microseconds from the start.
pub trait RoutingPolicy {
    /// The report name.
    fn name(&self) -> String;
    /// Picks the worker (index into `workers`) for request `id`.
    fn route(
        &mut self,
        id: usize,
        request: &TraceRequest,
        workers: &[WorkerView],
        now_us: u64,
    ) -> usize;
    /// Request `id`'s prefill completed.
    fn prefill_done(&mut self, _id: usize, _now_us: u64) {}
    /// Request `id` finished.
    fn finished(&mut self, _id: usize, _now_us: u64) {}
    /// A KV event of `worker` reached the router.
    fn kv_event(&mut self, _worker: usize, _event: KvEvent<'_>, _now_us: u64) {}
    /// How well the policy's latency model predicted TTFT (policies that
    /// learn latency only).
    fn prediction_error(&self) -> Option<PredictionError> {
        None
    }
}

/// Settings of a replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Simulated workers.
    pub workers: usize,
    /// KV pool size of each worker in blocks.
    pub capacity_blocks: usize,
    /// Tokens per block of the trace (its `hash_ids`), of the pools and of kvpick.
    pub block_tokens: usize,
    /// The time model of a worker at speed 1.
    pub model: TimeModel,
    /// Each worker's speed, a multiple of `model`'s ([`TimeModel::at_speed`]);
    /// workers past the list run at 1 (empty: every worker at 1).
    pub worker_speeds: Vec<f64>,
    /// Arrival-rate multiple: request `i` arrives at `timestamp / speed`.
    pub speed: f64,
    /// Delay between a worker's KV event and its arrival at the router.
    pub kv_event_delay: Duration,
    /// Seed of the policies' tie-breaking generators.
    pub seed: u64,
    /// Cost weights of the kvpick policies.
    pub kvpick_weights: TermWeights,
    /// kvpick's provisional TTL (precise mode).
    pub provisional_ttl: Duration,
    /// kvpick's weight of a pending prefill block.
    pub pending_prefill_weight: f64,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            workers: 8,
            capacity_blocks: 1000,
            block_tokens: BLOCK_TOKENS,
            model: TimeModel::default(),
            worker_speeds: Vec::new(),
            speed: 1.0,
            kv_event_delay: Duration::from_millis(50),
            seed: 1,
            kvpick_weights: TermWeights::default(),
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            pending_prefill_weight: PENDING_PREFILL_WEIGHT,
        }
    }
}

impl ReplayConfig {
    /// Worker `w`'s time model.
    pub fn model_of(&self, w: usize) -> TimeModel {
        self.model
            .at_speed(self.worker_speeds.get(w).copied().unwrap_or(1.0))
    }

    /// The workers' mean speed.
    pub fn mean_speed(&self) -> f64 {
        let n = self.workers.max(1);
        (0..n)
            .map(|w| self.worker_speeds.get(w).copied().unwrap_or(1.0))
            .sum::<f64>()
            / n as f64
    }
}
