//! The yardsticks beside the policies: the fleet as one engine, the hit-rate
//! ceilings and the balanced spread.

use std::collections::HashSet;

use super::policies::*;
use super::policy::*;
use super::report::*;
use super::timeline::*;
use crate::bench::ratio;
use crate::bench::sim::BlockPool;
use crate::bench::trace::TraceRequest;

/// `trace` on one engine holding all of `cfg`'s workers' blocks, with their
/// compute ([`TimeModel::pooled`], at the workers' mean speed) and the same
/// arrivals.
pub fn one_engine(trace: &[TraceRequest], cfg: &ReplayConfig) -> OneEngine {
    let pooled = ReplayConfig {
        workers: 1,
        capacity_blocks: cfg.workers.max(1) * cfg.capacity_blocks,
        model: cfg.model.at_speed(cfg.mean_speed()).pooled(cfg.workers),
        worker_speeds: Vec::new(),
        ..cfg.clone()
    };
    let f = simulate(&mut RoundRobin::default(), trace, &pooled);
    OneEngine {
        hit_rate: f.hit_rate,
        ttft_p50_ms: f.ttft_p50_ms,
        ttft_p99_ms: f.ttft_p99_ms,
    }
}

/// Hit rate of an infinite cache shared by all workers: leading blocks seen before.
pub fn ceiling_hit_rate(trace: &[TraceRequest]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        hits += r
            .hash_ids
            .iter()
            .take_while(|id| seen.contains(*id))
            .count();
        total += r.hash_ids.len();
        seen.extend(r.hash_ids.iter().copied());
    }
    ratio(hits as f64, total as f64)
}

/// Hit rate of one LRU cache of `capacity` blocks that every request uses in
/// arrival order: what placement could reach if the fleet's KV were one pool.
pub fn pooled_ceiling_hit_rate(trace: &[TraceRequest], capacity: usize) -> f64 {
    let mut pool = BlockPool::new(capacity);
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        hits += pool.store(&r.hash_ids).hits;
        total += r.hash_ids.len();
    }
    ratio(hits as f64, total as f64)
}
