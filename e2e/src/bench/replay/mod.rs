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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, ScrapedLoad, Snapshot, WorkerKey};
use kvpick::kvevents::KvEventSink;
use kvpick::scheduler::{
    Decision, PickRequest, Plugins, Scheduler, SchedulerConfig, TermWeights,
    DEFAULT_PROVISIONAL_TTL, PENDING_PREFILL_WEIGHT,
};
use serde::Serialize;

use super::sim::{BlockPool, Engine, TimeModel};
use super::trace::{self, TraceRequest, BLOCK_TOKENS};
use super::{markdown_table, quantile, ratio, sorted, SplitMix64};

mod policies;

pub use policies::{FewestInFlight, Kvpick, LlmD, RoundRobin};

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
    /// The time model.
    pub model: TimeModel,
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
            speed: 1.0,
            kv_event_delay: Duration::from_millis(50),
            seed: 1,
            kvpick_weights: TermWeights::default(),
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            pending_prefill_weight: PENDING_PREFILL_WEIGHT,
        }
    }
}

/// Flags of a replay, shared by `kvpick-bench replay` and `kvpick-anchors replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// The trace (JSON lines with timestamp, input_length, output_length,
    /// hash_ids; `.gz` read gunzipped): a path, or `synthetic` (the public
    /// synthetic Mooncake trace, for tuning) or `conversation` (the held-out
    /// Mooncake conversation trace, read from `../shared/data`, never tuned on).
    #[arg(long, default_value = "synthetic")]
    pub trace: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// KV pool size of each worker in blocks (several: one run each).
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    pub capacity_blocks: Vec<usize>,
    /// Tokens per block of the trace's `hash_ids` (512 in Mooncake's traces, 64
    /// in `gen-trace`'s); pools and kvpick hash in blocks of this size.
    #[arg(long, default_value_t = BLOCK_TOKENS)]
    pub block_tokens: usize,
    /// Arrival-rate multiples (several: one run each).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub speed: Vec<f64>,
    /// Delay of the workers' KV events to the router, ms.
    #[arg(long, default_value_t = 50.0)]
    pub kv_event_delay_ms: f64,
    /// Only the first N requests of the trace.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Prefill throughput of a worker on uncached tokens.
    #[arg(long, default_value_t = TimeModel::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of every prefill, ms.
    #[arg(long, default_value_t = TimeModel::default().prefill_fixed_ms)]
    pub prefill_fixed_ms: f64,
    /// Time per output token of a lone request, ms.
    #[arg(long, default_value_t = TimeModel::default().decode_ms_per_token)]
    pub decode_ms_per_token: f64,
    /// Decoding requests at which per-token time has doubled.
    #[arg(long, default_value_t = TimeModel::default().decode_batch_knee)]
    pub decode_batch_knee: f64,
    /// Tokens a worker's engine step may compute (vLLM's `max_num_batched_tokens`).
    #[arg(long, default_value_t = TimeModel::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// Requests a worker may run at once (vLLM's `max_num_seqs`).
    #[arg(long, default_value_t = TimeModel::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Seed of the policies' tie-breaking.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// kvpick's cost weights `prefill,decode,queue,kv_usage` (default: kvpick's
    /// defaults), to compare settings on the same fleet.
    #[arg(long, value_parser = parse_weights)]
    pub kvpick_weights: Option<[f64; 4]>,
    /// kvpick's provisional TTL in precise mode, seconds (default: kvpick's).
    #[arg(long)]
    pub provisional_ttl_secs: Option<f64>,
    /// kvpick's weight of a block of prefill pending on a worker beyond the
    /// prompt's overlap there, 0..1 (default: kvpick's).
    #[arg(long, default_value_t = PENDING_PREFILL_WEIGHT)]
    pub kvpick_pending_weight: f64,
    /// Also write every request's figures, one CSV per policy and run
    /// (`POLICY-BLOCKS-SPEED.csv`, with --replicas `POLICY-BLOCKS-SPEED-sSEED.csv`),
    /// into this directory: where a tail comes from.
    #[arg(long)]
    pub dump_requests: Option<PathBuf>,
}

impl ReplayArgs {
    /// The trace (cut to `--requests`) and its file name.
    pub fn load(&self) -> anyhow::Result<(String, Vec<TraceRequest>)> {
        let path = trace::resolve(&self.trace);
        let mut requests = trace::load(path)?;
        if let Some(n) = self.requests {
            requests.truncate(n);
        }
        let name = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok((name, requests))
    }

    /// The time model of these flags.
    pub fn model(&self) -> TimeModel {
        TimeModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            prefill_fixed_ms: self.prefill_fixed_ms,
            decode_ms_per_token: self.decode_ms_per_token,
            decode_batch_knee: self.decode_batch_knee,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
        }
    }

    /// kvpick's cost weights of these flags (`--kvpick-weights` sets the
    /// flags of the four weights it names).
    pub fn weights(&self) -> TermWeights {
        let mut weights = TermWeights::default();
        if let Some(given) = self.kvpick_weights {
            let flags = [
                "weight-prefill",
                "weight-decode",
                "weight-queue",
                "weight-kv-usage",
            ];
            for (flag, w) in flags.into_iter().zip(given) {
                let known = weights.set_flag(flag, w);
                debug_assert!(known, "{flag} is a declared weight flag");
            }
        }
        weights
    }

    /// One config per (capacity, speed), capacities outermost.
    pub fn configs(&self) -> Vec<ReplayConfig> {
        let mut out = Vec::new();
        for &capacity_blocks in &self.capacity_blocks {
            for &speed in &self.speed {
                out.push(ReplayConfig {
                    workers: self.workers,
                    capacity_blocks,
                    block_tokens: self.block_tokens.max(1),
                    model: self.model(),
                    speed,
                    kv_event_delay: Duration::from_secs_f64(self.kv_event_delay_ms / 1000.0),
                    seed: self.seed,
                    kvpick_weights: self.weights(),
                    provisional_ttl: self
                        .provisional_ttl_secs
                        .map_or(DEFAULT_PROVISIONAL_TTL, Duration::from_secs_f64),
                    pending_prefill_weight: self.kvpick_pending_weight,
                });
            }
        }
        out
    }
}

/// Parses `prefill,decode,queue,kv_usage`.
fn parse_weights(s: &str) -> Result<[f64; 4], String> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    v.try_into()
        .map_err(|v: Vec<f64>| format!("4 weights expected, got {}", v.len()))
}

/// One policy's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyFigures {
    /// The policy's name.
    pub name: String,
    /// Prefix hit rate (blocks), 0..1.
    pub hit_rate: f64,
    /// `hit_rate` over the pooled finite-capacity ceiling.
    pub of_achievable: f64,
    /// Mean over arrivals of max/mean in-flight.
    pub spread: f64,
    /// What `spread` would be with the same requests in flight at each sample
    /// placed as evenly as whole requests allow ([`balanced_spread`]): no
    /// policy's spread can be lower.
    pub spread_floor: f64,
    /// Median modeled TTFT.
    pub ttft_p50_ms: f64,
    /// 99th percentile modeled TTFT.
    pub ttft_p99_ms: f64,
    /// Every request's modeled TTFT, sorted (for plots).
    #[serde(skip)]
    pub ttft_ms: Vec<f64>,
    /// Every request's figures, in trace order (`--dump-requests`).
    #[serde(skip)]
    pub requests: Vec<RequestFigures>,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestFigures {
    /// The worker it was routed to.
    pub worker: usize,
    /// Its arrival, simulated ms from the start.
    pub arrival_ms: f64,
    /// Requests ahead of it on that worker at arrival (queued or in prefill).
    pub ahead: usize,
    /// Their prompt tokens (cached or not).
    pub ahead_tokens: usize,
    /// Requests routed to that worker and not finished, at arrival.
    pub in_flight: usize,
    /// Mean over the workers of requests routed and not finished, at arrival.
    pub pool_in_flight: f64,
    /// Its prompt tokens.
    pub input_tokens: usize,
    /// Its prompt blocks.
    pub blocks: usize,
    /// Leading prompt blocks found cached when its prefill started.
    pub hit_blocks: usize,
    /// Leading prompt blocks in its worker's pool when it arrived.
    pub arrival_hit_blocks: usize,
    /// The most leading prompt blocks any worker's pool held when it arrived:
    /// above `arrival_hit_blocks`, the placement gave up blocks on hand.
    pub best_arrival_hit_blocks: usize,
    /// Time from arrival to its admission by the engine (its prefill's start).
    pub wait_ms: f64,
    /// Time from admission to its first token (its prefill's steps).
    pub prefill_ms: f64,
}

impl RequestFigures {
    const CSV_HEADER: &'static str = "request,worker,arrival_ms,ahead,ahead_tokens,in_flight,\
        pool_in_flight,input_tokens,blocks,hit_blocks,arrival_hit_blocks,best_arrival_hit_blocks,\
        wait_ms,prefill_ms,ttft_ms";

    fn csv_row(&self, index: usize) -> String {
        format!(
            "{index},{},{:.3},{},{},{},{:.3},{},{},{},{},{},{:.3},{:.3},{:.3}",
            self.worker,
            self.arrival_ms,
            self.ahead,
            self.ahead_tokens,
            self.in_flight,
            self.pool_in_flight,
            self.input_tokens,
            self.blocks,
            self.hit_blocks,
            self.arrival_hit_blocks,
            self.best_arrival_hit_blocks,
            self.wait_ms,
            self.prefill_ms,
            self.wait_ms + self.prefill_ms
        )
    }
}

/// Writes each run's per-request figures into `dir`, one CSV per policy and run
/// (`POLICY-BLOCKS-SPEED.csv`).
pub fn write_requests(dir: &std::path::Path, runs: &[ReplayReport]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for r in runs {
        for p in &r.policies {
            let file = format!("{}-{}-{}.csv", p.name, r.capacity_blocks, r.speed);
            write_policy_requests(&dir.join(file), p)?;
        }
    }
    Ok(())
}

/// Writes one run's per-request figures to `path` as CSV.
pub fn write_policy_requests(path: &std::path::Path, p: &PolicyFigures) -> std::io::Result<()> {
    let mut csv = String::from(RequestFigures::CSV_HEADER);
    csv.push('\n');
    for (i, q) in p.requests.iter().enumerate() {
        csv.push_str(&q.csv_row(i));
        csv.push('\n');
    }
    std::fs::write(path, csv)
}

/// The replay report.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace replayed.
    pub trace: String,
    /// Requests replayed.
    pub requests: usize,
    /// Simulated workers.
    pub workers: usize,
    /// Pool size per worker in blocks.
    pub capacity_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Arrival-rate multiple.
    pub speed: f64,
    /// Hit rate of an infinite cache shared by all workers.
    pub ceiling_hit_rate: f64,
    /// Hit rate of one LRU cache of `workers × capacity_blocks` blocks.
    pub pooled_ceiling_hit_rate: f64,
    /// The trace on the fleet as one engine.
    pub one_engine: OneEngine,
    /// One entry per policy.
    pub policies: Vec<PolicyFigures>,
}

impl ReplayReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        let mut rows: Vec<Vec<String>> = self
            .policies
            .iter()
            .map(|p| {
                vec![
                    p.name.clone(),
                    format!("{:.1}%", p.hit_rate * 100.0),
                    format!("{:.2}", p.of_achievable),
                    format!("{:.2}", p.spread),
                    format!("{:.2}", p.spread_floor),
                    format!("{:.0}", p.ttft_p50_ms),
                    format!("{:.0}", p.ttft_p99_ms),
                ]
            })
            .collect();
        rows.push(vec![
            format!(
                "ceiling (one pooled LRU cache of {} blocks)",
                self.workers * self.capacity_blocks
            ),
            format!("{:.1}%", self.pooled_ceiling_hit_rate * 100.0),
            "1.00".into(),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
        ]);
        let mut one = vec![format!(
            "one engine with the fleet's KV and compute ({} blocks)",
            self.workers * self.capacity_blocks
        )];
        one.extend(self.one_engine.cells(self));
        rows.push(one);
        rows.push(vec![
            "ceiling (infinite shared cache)".into(),
            format!("{:.1}%", self.ceiling_hit_rate * 100.0),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
        ]);
        format!(
            "{} requests at {}× speed, {} workers, {} blocks of {} tokens per worker\n\n{}",
            self.requests,
            self.speed,
            self.workers,
            self.capacity_blocks,
            self.block_tokens,
            markdown_table(
                &[
                    "policy",
                    "prefix hit rate",
                    "fraction of achievable",
                    "spread (max/mean in-flight)",
                    "spread floor (even placement)",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ],
                &rows,
            )
        )
    }
}

/// The trace on the fleet as one engine: its hit rate and TTFT.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OneEngine {
    /// Prefix hit rate (blocks), 0..1.
    pub hit_rate: f64,
    /// Median modeled TTFT.
    pub ttft_p50_ms: f64,
    /// 99th percentile modeled TTFT.
    pub ttft_p99_ms: f64,
}

impl OneEngine {
    /// Its hit rate over `report`'s pooled ceiling (0 when that is 0).
    pub fn of_pooled_ceiling(&self, report: &ReplayReport) -> f64 {
        ratio(self.hit_rate, report.pooled_ceiling_hit_rate)
    }

    /// Its cells in a table of policies: hit rate, fraction of the pooled
    /// ceiling, no spreads, TTFT p50 and p99.
    fn cells(&self, report: &ReplayReport) -> [String; 6] {
        [
            format!("{:.1}%", self.hit_rate * 100.0),
            format!("{:.2}", self.of_pooled_ceiling(report)),
            "–".into(),
            "–".into(),
            format!("{:.0}", self.ttft_p50_ms),
            format!("{:.0}", self.ttft_p99_ms),
        ]
    }
}

/// `trace` on one engine holding all of `cfg`'s workers' blocks, with their
/// compute ([`TimeModel::pooled`]) and the same arrivals.
pub fn one_engine(trace: &[TraceRequest], cfg: &ReplayConfig) -> OneEngine {
    let pooled = ReplayConfig {
        workers: 1,
        capacity_blocks: cfg.workers.max(1) * cfg.capacity_blocks,
        model: cfg.model.pooled(cfg.workers),
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

/// Max/mean in-flight of `total` requests (at least 1) on `workers` placed as
/// evenly as whole requests allow: `ceil(total / workers) / (total / workers)`.
/// 3 requests on 8 workers score 8/3 however they are placed.
pub fn balanced_spread(total: usize, workers: usize) -> f64 {
    let mean = total as f64 / workers.max(1) as f64;
    total.div_ceil(workers.max(1)) as f64 / mean
}

/// The built-in policies, fresh, in report order.
pub fn builtin(cfg: &ReplayConfig) -> Vec<Box<dyn RoutingPolicy>> {
    vec![
        Box::new(RoundRobin::default()),
        Box::new(FewestInFlight::new(cfg.seed)),
        Box::new(Kvpick::new(cfg, false)),
        Box::new(Kvpick::new(cfg, true)),
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
        speed: cfg.speed,
        ceiling_hit_rate: ceiling_hit_rate(trace),
        pooled_ceiling_hit_rate: pooled,
        one_engine: one_engine(trace, cfg),
        policies,
    }
}

/// The replays of several (capacity, speed) pairs, all policies in each.
#[derive(Debug, Clone, Serialize)]
pub struct MatrixReport {
    /// The trace replayed.
    pub trace: String,
    /// One report per (capacity, speed).
    pub runs: Vec<ReplayReport>,
}

/// Policies kvpick is held against in the criteria (when present in a run).
const PEERS: [&str; 2] = ["dynamo", "llm-d"];

impl MatrixReport {
    /// All runs in one table, then the criteria for each kvpick policy.
    pub fn markdown(&self) -> String {
        let mut rows = Vec::new();
        for r in &self.runs {
            for p in &r.policies {
                rows.push(vec![
                    r.capacity_blocks.to_string(),
                    format!("{}×", r.speed),
                    p.name.clone(),
                    format!("{:.1}%", p.hit_rate * 100.0),
                    format!("{:.2}", p.of_achievable),
                    format!("{:.2}", p.spread),
                    format!("{:.2}", p.spread_floor),
                    format!("{:.0}", p.ttft_p50_ms),
                    format!("{:.0}", p.ttft_p99_ms),
                ]);
            }
            rows.push(vec![
                r.capacity_blocks.to_string(),
                format!("{}×", r.speed),
                "ceiling: pooled LRU / infinite".into(),
                format!(
                    "{:.1}% / {:.1}%",
                    r.pooled_ceiling_hit_rate * 100.0,
                    r.ceiling_hit_rate * 100.0
                ),
                "1.00".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
            ]);
            let mut one = vec![
                r.capacity_blocks.to_string(),
                format!("{}×", r.speed),
                "one engine with the fleet's KV and compute".into(),
            ];
            one.extend(r.one_engine.cells(r));
            rows.push(one);
        }
        let head = self.runs.first().map_or(String::new(), |r| {
            format!(
                "{}: {} requests, {} workers, blocks of {} tokens\n\n",
                self.trace, r.requests, r.workers, r.block_tokens
            )
        });
        let mut out = head
            + &markdown_table(
                &[
                    "blocks per worker",
                    "speed",
                    "policy",
                    "prefix hit rate",
                    "fraction of achievable",
                    "spread",
                    "spread floor",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ],
                &rows,
            );
        let mut crit = Vec::new();
        for r in &self.runs {
            for k in r.policies.iter().filter(|p| p.name.starts_with("kvpick")) {
                let others: Vec<&PolicyFigures> = r
                    .policies
                    .iter()
                    .filter(|p| !p.name.starts_with("kvpick"))
                    .collect();
                let peers: Vec<&&PolicyFigures> = others
                    .iter()
                    .filter(|p| PEERS.contains(&p.name.as_str()))
                    .collect();
                let mark = |ok: bool| if ok { "yes" } else { "**no**" }.to_string();
                crit.push(vec![
                    r.capacity_blocks.to_string(),
                    format!("{}×", r.speed),
                    k.name.clone(),
                    mark(k.of_achievable >= 0.85),
                    mark(peers.iter().all(|p| k.hit_rate > p.hit_rate)),
                    mark(
                        others
                            .iter()
                            .filter(|p| p.name == "round-robin" || PEERS.contains(&p.name.as_str()))
                            .all(|p| {
                                k.ttft_p50_ms <= p.ttft_p50_ms && k.ttft_p99_ms <= p.ttft_p99_ms
                            }),
                    ),
                    mark(k.spread <= 1.3),
                    match k.spread_floor <= 1.3 {
                        true => format!("yes ({:.2})", k.spread_floor),
                        false => format!("no ({:.2})", k.spread_floor),
                    },
                    match r.one_engine.of_pooled_ceiling(r) {
                        f if f >= 0.85 => format!("yes ({f:.2})"),
                        f => format!("no ({f:.2})"),
                    },
                ]);
            }
        }
        out.push_str("\nCriteria of issue 17 (peers: ");
        out.push_str(&PEERS.join(", "));
        out.push_str(", where present)\n\n");
        out.push_str(&markdown_table(
            &[
                "blocks per worker",
                "speed",
                "policy",
                "hit ≥ 0.85 of pooled ceiling",
                "hit above peers",
                "TTFT p50 and p99 ≤ round robin and peers",
                "spread ≤ 1.3",
                "1.3 reachable (spread floor)",
                "0.85 reached by one engine",
            ],
            &crit,
        ));
        out
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

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request arrives (trace index).
    Arrival(usize),
    /// A worker's engine step ends.
    StepEnd(usize),
    /// A stored event (worker, request, first new block) reaches the router.
    Stored(usize, usize, usize),
    /// An eviction event (worker, blocks) reaches the router.
    Removed(usize, Vec<u64>),
}

struct Sim<'a> {
    trace: &'a [TraceRequest],
    cfg: &'a ReplayConfig,
    workers: Vec<Engine>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    /// First newly stored block of each request (its stored event).
    stored_from: Vec<usize>,
    /// When each request was admitted (µs).
    admitted_us: Vec<u64>,
    ttft_ms: Vec<f64>,
    hits: usize,
    blocks: usize,
    spread_sum: f64,
    spread_floor_sum: f64,
    spread_samples: usize,
    delay_us: u64,
    requests: Vec<RequestFigures>,
}

impl Sim<'_> {
    fn schedule(&mut self, at_us: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at_us, self.seq, e)));
    }

    fn arrival_us(&self, r: usize) -> u64 {
        (self.trace[r].timestamp as f64 * 1000.0 / self.cfg.speed) as u64
    }

    fn sample_spread(&mut self) {
        let total: usize = self.workers.iter().map(|w| w.in_flight).sum();
        if total == 0 {
            return;
        }
        let max = self.workers.iter().map(|w| w.in_flight).max().unwrap_or(0);
        let mean = total as f64 / self.workers.len() as f64;
        self.spread_sum += max as f64 / mean;
        self.spread_floor_sum += balanced_spread(total, self.workers.len());
        self.spread_samples += 1;
    }

    fn views(&self) -> Vec<WorkerView> {
        self.workers
            .iter()
            .map(|w| WorkerView {
                waiting: w.waiting.len(),
                running: w.running.len(),
                kv_usage: w.pool.usage(),
                capacity_blocks: self.cfg.capacity_blocks,
            })
            .collect()
    }

    /// Starts worker `w`'s next engine step at `now` if it is idle and has work.
    fn step(&mut self, w: usize, now: u64) {
        if self.workers[w].stepping {
            return;
        }
        let Some(start) = self.workers[w].begin_step(self.trace, &self.cfg.model) else {
            return;
        };
        for a in start.admitted {
            let r = a.request;
            self.hits += a.stored.hits;
            self.blocks += self.trace[r].hash_ids.len();
            self.stored_from[r] = a.stored.hits;
            self.admitted_us[r] = now;
            let wait_ms = (now - self.arrival_us(r)) as f64 / 1000.0;
            let figures = &mut self.requests[r];
            figures.hit_blocks = a.stored.hits;
            figures.wait_ms = wait_ms;
            if !a.stored.evicted.is_empty() {
                self.schedule(now + self.delay_us, Event::Removed(w, a.stored.evicted));
            }
        }
        let dur_us = ((start.ms * 1000.0) as u64).max(1);
        self.schedule(now + dur_us, Event::StepEnd(w));
    }
}

/// Replays `trace` under `policy`.
pub fn simulate(
    policy: &mut dyn RoutingPolicy,
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
) -> PolicyFigures {
    let mut sim = Sim {
        trace,
        cfg,
        workers: (0..cfg.workers.max(1))
            .map(|_| Engine::new(cfg.capacity_blocks, cfg.block_tokens))
            .collect(),
        events: BinaryHeap::new(),
        seq: 0,
        stored_from: vec![0; trace.len()],
        admitted_us: vec![0; trace.len()],
        ttft_ms: Vec::with_capacity(trace.len()),
        hits: 0,
        blocks: 0,
        spread_sum: 0.0,
        spread_floor_sum: 0.0,
        spread_samples: 0,
        delay_us: cfg.kv_event_delay.as_micros() as u64,
        requests: vec![RequestFigures::default(); trace.len()],
    };
    for r in 0..trace.len() {
        let at = sim.arrival_us(r);
        sim.schedule(at, Event::Arrival(r));
    }
    while let Some(Reverse((now, _, event))) = sim.events.pop() {
        match event {
            Event::Arrival(r) => {
                sim.sample_spread();
                let views = sim.views();
                let w = policy.route(r, &trace[r], &views, now);
                let ids = &trace[r].hash_ids;
                let held = |x: &Engine| x.pool.prefix_hits(ids);
                let pool_in_flight = sim.workers.iter().map(|w| w.in_flight).sum::<usize>() as f64
                    / sim.workers.len() as f64;
                let worker = &sim.workers[w];
                sim.requests[r] = RequestFigures {
                    worker: w,
                    arrival_ms: now as f64 / 1000.0,
                    ahead: worker.ahead().count(),
                    ahead_tokens: worker.ahead().map(|q| trace[q].input_length).sum(),
                    in_flight: worker.in_flight,
                    pool_in_flight,
                    input_tokens: trace[r].input_length,
                    blocks: trace[r].hash_ids.len(),
                    arrival_hit_blocks: held(worker),
                    best_arrival_hit_blocks: sim.workers.iter().map(held).max().unwrap_or(0),
                    ..RequestFigures::default()
                };
                sim.workers[w].in_flight += 1;
                sim.workers[w].waiting.push_back(r);
                sim.step(w, now);
            }
            Event::StepEnd(w) => {
                let end = sim.workers[w].end_step(trace);
                for r in end.first_token {
                    let arrival_us = sim.arrival_us(r);
                    sim.ttft_ms.push((now - arrival_us) as f64 / 1000.0);
                    sim.requests[r].prefill_ms = (now - sim.admitted_us[r]) as f64 / 1000.0;
                    policy.prefill_done(r, now);
                    sim.schedule(now + sim.delay_us, Event::Stored(w, r, sim.stored_from[r]));
                }
                for &r in &end.finished {
                    policy.finished(r, now);
                }
                if !end.evicted.is_empty() {
                    sim.schedule(now + sim.delay_us, Event::Removed(w, end.evicted));
                }
                sim.step(w, now);
            }
            Event::Stored(w, r, from) => {
                let event = KvEvent::Stored {
                    id: r,
                    request: &trace[r],
                    from,
                };
                policy.kv_event(w, event, now);
            }
            Event::Removed(w, ids) => policy.kv_event(w, KvEvent::Removed(&ids), now),
        }
    }
    debug_assert!(sim
        .workers
        .iter()
        .all(|w| w.in_flight == 0 && w.waiting.is_empty() && w.running.is_empty()));
    let ttft = sorted(std::mem::take(&mut sim.ttft_ms));
    PolicyFigures {
        name: policy.name(),
        hit_rate: ratio(sim.hits as f64, sim.blocks as f64),
        of_achievable: 0.0,
        spread: ratio(sim.spread_sum, sim.spread_samples as f64),
        spread_floor: ratio(sim.spread_floor_sum, sim.spread_samples as f64),
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p99_ms: quantile(&ttft, 0.99),
        ttft_ms: ttft,
        requests: sim.requests,
    }
}

/// Test traces and settings shared by the replay tests here and in `replicas`.
#[cfg(test)]
pub(super) mod fixtures {
    use super::{ReplayConfig, TraceRequest, BLOCK_TOKENS};

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

#[cfg(test)]
mod tests;
