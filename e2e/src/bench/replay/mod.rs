//! `kvpick-bench replay`: a Mooncake-format trace through routing policies against
//! simulated workers, as a discrete-event simulation in compressed time.
//!
//! Every policy sees the same trace and the same simulated fleet ([`super::sim`]).
//! A policy is a [`RoutingPolicy`]: it routes each arrival given a view of every
//! worker ([`WorkerView`], what an engine's metrics endpoint shows) and hears of
//! prefill completions, finished requests and, after `kv_event_delay`, the KV
//! events of the workers ([`KvEvent`], what vLLM publishes). Crates outside this
//! one (the bench-only `anchors` crate, which may depend on Dynamo) implement the
//! trait for peers and pass them to [`run`] / [`matrix`].
//!
//! Built-in policies ([`builtin`]):
//! - `round-robin`; `fewest-in-flight` (seeded random tie-break);
//! - `kvpick-approx` / `kvpick-precise`: kvpick's real [`Scheduler`] over a real
//!   [`EndpointTable`]. Each request becomes a token-id prompt (see
//!   [`super::trace`]) hashed in the trace's blocks (`--block-tokens`, 512 by default), so kvpick's block hashes line up
//!   with the trace's blocks. Before each pick every endpoint gets a fresh scrape
//!   (engine queue, running requests, KV usage), as kvpick reads from vLLM's
//!   metrics. The in-flight guard from [`Decision::begin`] is held until the
//!   simulated completion, when [`Scheduler::finish_at`] is called; the
//!   scheduler's clock is the simulated clock. Approximate: the index is fed by
//!   kvpick's own decisions, its per-worker bound set to the pool size. Precise:
//!   every worker is marked precise and the delayed KV events reach the index
//!   (engine hash = trace block id, kvpick hash = the scheduler's hash of that block);
//! - `kvpick-predicted`: precise, with `--scoring predicted`; its latency models
//!   learn each completion as the gateway would see it ([`LatencyFeed`]);
//! - `llm-d`: the llm-d Router v0.10.0 default profile, see [`LlmD`].
//!
//! Hit rate is block-level: leading prompt blocks found in the chosen worker's own
//! pool when its prefill starts, over all prompt blocks. Two ceilings: the
//! infinite one counts leading blocks seen before anywhere (an infinite cache
//! shared by all workers); the pooled one is the hit rate of one LRU cache holding
//! all workers' blocks (`workers × capacity`), which perfect placement could
//! approach with the fleet's finite KV. Each policy's "fraction of achievable" is
//! its hit rate over the pooled ceiling. Beside them, the fleet as one engine
//! ([`one_engine`]): the trace on a single engine with every worker's blocks and
//! compute, where running requests pin blocks as on the fleet but no placement
//! can lose a prefix. It is a reference, not a bound: the pooled ceiling ignores
//! pinning, and a fleet that keeps each prefix group on its own worker can
//! outdo one pool's LRU when pinned blocks churn it. Load spread is max/mean
//! in-flight over workers, sampled at every arrival that finds any request in
//! flight, averaged over those arrivals; next to it, the spread floor: the same
//! average for the same totals in flight placed as evenly as whole requests
//! allow (with few requests in flight on many workers even that is far above 1).

mod args;
mod baselines;
mod feed;
mod policies;
mod policy;
mod report;
#[cfg(test)]
mod tests;
mod timeline;

pub use args::*;
pub use baselines::*;
pub use feed::*;
pub use policies::*;
pub use policy::*;
pub use report::*;
pub use timeline::*;

use std::time::Instant;

use crate::bench::trace::TraceRequest;
/// The built-in policies, fresh, in report order.
pub fn builtin(cfg: &ReplayConfig) -> Vec<Box<dyn RoutingPolicy>> {
    vec![
        Box::new(RoundRobin::default()),
        Box::new(FewestInFlight::new(cfg.seed)),
        Box::new(Kvpick::new(cfg, false)),
        Box::new(Kvpick::new(cfg, true)),
        Box::new(Kvpick::predicted(cfg)),
        Box::new(LlmD::new(cfg)),
    ]
}

/// Runs every policy over `trace` and reports them next to the ceilings and the
/// fleet as one engine.
pub fn run(
    trace_name: &str,
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
    policies: Vec<Box<dyn RoutingPolicy>>,
) -> ReplayReport {
    let pooled = pooled_ceiling_hit_rate(trace, cfg.workers * cfg.capacity_blocks);
    let policies = policies
        .into_iter()
        .map(|mut p| {
            let started = Instant::now();
            let mut f = simulate(p.as_mut(), trace, cfg);
            f.of_achievable = if pooled > 0.0 {
                f.hit_rate / pooled
            } else {
                0.0
            };
            eprintln!(
                "replay: {} at {} blocks, {}× done in {:.1} s (hit rate {:.3})",
                f.name,
                cfg.capacity_blocks,
                cfg.speed,
                started.elapsed().as_secs_f64(),
                f.hit_rate
            );
            f
        })
        .collect();
    ReplayReport {
        trace: trace_name.to_string(),
        requests: trace.len(),
        workers: cfg.workers,
        capacity_blocks: cfg.capacity_blocks,
        block_tokens: cfg.block_tokens,
        worker_speeds: cfg.worker_speeds.clone(),
        speed: cfg.speed,
        ceiling_hit_rate: ceiling_hit_rate(trace),
        pooled_ceiling_hit_rate: pooled,
        one_engine: one_engine(trace, cfg),
        policies,
    }
}

/// Every config in turn, each with fresh policies from `policies`.
pub fn matrix(
    trace_name: &str,
    trace: &[TraceRequest],
    configs: &[ReplayConfig],
    policies: &dyn Fn(&ReplayConfig) -> Vec<Box<dyn RoutingPolicy>>,
) -> MatrixReport {
    MatrixReport {
        trace: trace_name.to_string(),
        runs: configs
            .iter()
            .map(|c| run(trace_name, trace, c, policies(c)))
            .collect(),
    }
}

/// Test traces and settings shared by the replay tests here and in `replicas`.
#[cfg(test)]
pub(super) mod fixtures {
    use super::ReplayConfig;
    use crate::bench::trace::{TraceRequest, BLOCK_TOKENS};

    /// `conversations` conversations of `turns` turns, turn after turn, each
    /// request `gap_us` after the previous one. Conversation `c` is a prefix
    /// of `shared` blocks of its own, then its tail: turn `t`'s own block, or
    /// with `growing` every block of turns `0..=t` (each turn extends the last).
    pub fn conversations(
        conversations: u64,
        turns: u64,
        shared: u64,
        growing: bool,
        gap_us: u64,
    ) -> Vec<TraceRequest> {
        let mut out = Vec::new();
        for turn in 0..turns {
            for conv in 0..conversations {
                let mut ids: Vec<u64> = (0..shared).map(|b| conv * 1000 + b).collect();
                let first = if growing { 0 } else { turn };
                ids.extend((first..=turn).map(|t| conv * 1000 + 100 + t));
                out.push(TraceRequest {
                    timestamp: (turn * conversations + conv) * gap_us,
                    input_length: ids.len() * BLOCK_TOKENS,
                    output_length: 4,
                    hash_ids: ids,
                });
            }
        }
        out
    }

    /// The replay's defaults with `workers` workers of `capacity_blocks` blocks.
    pub fn config(workers: usize, capacity_blocks: usize) -> ReplayConfig {
        ReplayConfig {
            workers,
            capacity_blocks,
            ..ReplayConfig::default()
        }
    }
}
