//! `kvpick-bench replay`: a Mooncake-format trace through routing policies against
//! simulated workers, as a discrete-event simulation in compressed time.
//!
//! Every policy sees the same trace and the same simulated fleet ([`super::sim`]).
//! The kvpick policies run kvpick's real [`Scheduler`] over a real
//! [`EndpointTable`]: each request becomes a token-id prompt (see
//! [`super::trace`]) that the scheduler hashes in 512-token blocks, so its block
//! hashes line up with the trace's blocks; the in-flight guard from
//! [`Decision::begin`] is held until the simulated completion, when
//! [`Scheduler::finish_at`] is called. The scheduler's clock is the simulated clock.
//!
//! - `kvpick-approx`: the index is fed only by kvpick's own decisions; its per-worker
//!   bound is set to the simulated pool size (as kvpick learns it from the engine's
//!   `num_gpu_blocks`).
//! - `kvpick-precise`: every worker is marked precise and its pool's stores and
//!   evictions reach the index as KV events (engine hash = trace block id, kvpick
//!   hash = the scheduler's hash of that block) at the simulated time they happen.
//!
//! Hit rate is block-level: leading prompt blocks found in the chosen worker's own
//! pool when its prefill starts, over all prompt blocks. Two ceilings: the
//! infinite one counts leading blocks seen before anywhere (an infinite cache
//! shared by all workers); the pooled one is the hit rate of one LRU cache holding
//! all workers' blocks (`workers × capacity`), which perfect placement could
//! approach with the fleet's finite KV. Each policy's "fraction of achievable" is
//! its hit rate over the pooled ceiling. Load
//! spread is max/mean in-flight over workers, sampled at every arrival that finds
//! any request in flight, averaged over those arrivals.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, Snapshot, WorkerKey};
use kvpick::request::{ApiKind, InferenceRequest, NvExt, Segment};
use kvpick::scheduler::{Decision, PickRequest, Scheduler, SchedulerConfig};
use serde::Serialize;

use super::sim::{BlockPool, TimeModel, Worker};
use super::trace::{prompt_tokens, TraceRequest, BLOCK_TOKENS};
use super::{markdown_table, quantile, sorted, SplitMix64};

/// The model name of replayed requests (seeds kvpick's block hashes).
const MODEL: &str = "mooncake-replay";

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Workers in turn.
    RoundRobin,
    /// The worker with the fewest requests in flight (random tie-break).
    FewestInFlight,
    /// kvpick with its approximate index.
    KvpickApprox,
    /// kvpick fed by the workers' KV events.
    KvpickPrecise,
}

impl Policy {
    /// All policies, in report order.
    pub const ALL: [Policy; 4] = [
        Policy::RoundRobin,
        Policy::FewestInFlight,
        Policy::KvpickApprox,
        Policy::KvpickPrecise,
    ];

    /// The report name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::FewestInFlight => "fewest-in-flight",
            Policy::KvpickApprox => "kvpick-approx",
            Policy::KvpickPrecise => "kvpick-precise",
        }
    }
}

/// Settings of a replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Simulated workers.
    pub workers: usize,
    /// KV pool size of each worker in 512-token blocks.
    pub capacity_blocks: usize,
    /// The time model.
    pub model: TimeModel,
    /// Seed of the tie-breaking generator of the baselines.
    pub seed: u64,
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
    /// Median modeled TTFT.
    pub ttft_p50_ms: f64,
    /// 99th percentile modeled TTFT.
    pub ttft_p99_ms: f64,
    /// Every request's modeled TTFT, sorted (for plots).
    #[serde(skip)]
    pub ttft_ms: Vec<f64>,
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
    /// Hit rate of an infinite cache shared by all workers.
    pub ceiling_hit_rate: f64,
    /// Hit rate of one LRU cache of `workers × capacity_blocks` blocks.
    pub pooled_ceiling_hit_rate: f64,
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
        ]);
        rows.push(vec![
            "ceiling (infinite shared cache)".into(),
            format!("{:.1}%", self.ceiling_hit_rate * 100.0),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
        ]);
        format!(
            "{} requests, {} workers, {} blocks of {} tokens per worker\n\n{}",
            self.requests,
            self.workers,
            self.capacity_blocks,
            BLOCK_TOKENS,
            markdown_table(
                &[
                    "policy",
                    "prefix hit rate",
                    "fraction of achievable",
                    "spread (max/mean in-flight)",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ],
                &rows,
            )
        )
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
    ratio(hits, total)
}

/// Hit rate of one LRU cache of `capacity` blocks that every request uses in
/// arrival order: what placement could reach if the fleet's KV were one pool.
pub fn pooled_ceiling_hit_rate(trace: &[TraceRequest], capacity: usize) -> f64 {
    let mut pool = BlockPool::new(capacity);
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        hits += pool.prefix_hits(&r.hash_ids);
        total += r.hash_ids.len();
        pool.store(&r.hash_ids);
    }
    ratio(hits, total)
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Runs every policy over `trace` and reports them next to the ceiling.
pub fn run(trace_name: &str, trace: &[TraceRequest], cfg: &ReplayConfig) -> ReplayReport {
    let pooled = pooled_ceiling_hit_rate(trace, cfg.workers * cfg.capacity_blocks);
    let policies = Policy::ALL
        .iter()
        .map(|&p| {
            let started = Instant::now();
            let mut f = simulate(p, trace, cfg);
            f.of_achievable = if pooled > 0.0 {
                f.hit_rate / pooled
            } else {
                0.0
            };
            eprintln!(
                "replay: {} done in {:.1} s (hit rate {:.3})",
                p.name(),
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
        ceiling_hit_rate: ceiling_hit_rate(trace),
        pooled_ceiling_hit_rate: pooled,
        policies,
    }
}

/// kvpick's side of a kvpick policy.
struct Kvpick {
    scheduler: Scheduler,
    _table: EndpointTable,
    snapshot: Arc<Snapshot>,
    /// Instance id → simulated worker.
    worker_of: HashMap<u64, usize>,
    keys: Vec<WorkerKey>,
    precise: bool,
    base: Instant,
}

impl Kvpick {
    fn new(cfg: &ReplayConfig, precise: bool) -> Self {
        let base = Instant::now();
        let scheduler = Scheduler::new(SchedulerConfig {
            token_block: BLOCK_TOKENS,
            ..SchedulerConfig::default()
        });
        let table = EndpointTable::new();
        table.replace(
            (0..cfg.workers)
                .map(|i| {
                    let addr = format!("10.1.{}.{}:8000", i / 250, i % 250 + 1);
                    Endpoint::new(addr.parse().expect("a valid socket address"))
                })
                .collect(),
        );
        let snapshot = table.snapshot();
        let keys: Vec<WorkerKey> = snapshot.endpoints.iter().map(|e| e.key(0)).collect();
        let worker_of = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.instance_id, i))
            .collect();
        for k in &keys {
            if precise {
                scheduler.index().set_precise(*k, true);
            } else {
                scheduler.index().set_capacity(*k, cfg.capacity_blocks);
            }
        }
        Kvpick {
            scheduler,
            _table: table,
            snapshot,
            worker_of,
            keys,
            precise,
            base,
        }
    }

    fn at(&self, t_us: u64) -> Instant {
        self.base + Duration::from_micros(t_us)
    }
}

/// A request kvpick routed: held until its simulated completion.
struct Routed {
    decision: Decision,
    _guard: InFlightGuard,
    /// kvpick's hashes of the prompt's full blocks (for KV events).
    hashes: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request arrives (trace index).
    Arrival(usize),
    /// A worker's prefill finishes.
    PrefillDone(usize),
    /// A request's decode finishes (trace index).
    Done(usize),
}

struct Sim<'a> {
    trace: &'a [TraceRequest],
    cfg: &'a ReplayConfig,
    workers: Vec<Worker>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    routed_to: Vec<usize>,
    routed: Vec<Option<Routed>>,
    ttft_ms: Vec<f64>,
    hits: usize,
    blocks: usize,
    spread_sum: f64,
    spread_samples: usize,
    kvpick: Option<Kvpick>,
}

impl Sim<'_> {
    fn schedule(&mut self, at_us: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at_us, self.seq, e)));
    }

    fn sample_spread(&mut self) {
        let total: usize = self.workers.iter().map(|w| w.in_flight).sum();
        if total == 0 {
            return;
        }
        let max = self.workers.iter().map(|w| w.in_flight).max().unwrap_or(0);
        let mean = total as f64 / self.workers.len() as f64;
        self.spread_sum += max as f64 / mean;
        self.spread_samples += 1;
    }

    /// Starts the next queued prefill on worker `w` at `now`, if it is idle.
    fn start_prefill(&mut self, w: usize, now: u64) {
        if self.workers[w].prefilling.is_some() {
            return;
        }
        let Some(r) = self.workers[w].queue.pop_front() else {
            return;
        };
        let req = &self.trace[r];
        let worker = &mut self.workers[w];
        worker.prefilling = Some(r);
        let hits = worker.pool.prefix_hits(&req.hash_ids);
        let (stored, evicted) = worker.pool.store(&req.hash_ids);
        self.hits += hits;
        self.blocks += req.hash_ids.len();
        if let Some(k) = self.kvpick.as_ref().filter(|k| k.precise) {
            let key = k.keys[w];
            let hashes = self.routed[r]
                .as_ref()
                .map(|x| &x.hashes[..])
                .unwrap_or(&[]);
            let pairs: Vec<(u64, u64)> = stored
                .iter()
                .filter_map(|id| {
                    let i = req.hash_ids.iter().position(|x| x == id)?;
                    hashes.get(i).map(|h| (*id, *h))
                })
                .collect();
            let index = k.scheduler.index();
            if !evicted.is_empty() {
                index.remove_engine_blocks(key, &evicted);
            }
            if !pairs.is_empty() {
                index.store_engine_blocks(key, &pairs, k.at(now));
            }
        }
        let uncached = req.input_length.saturating_sub(hits * BLOCK_TOKENS);
        let dur_us = (self.cfg.model.prefill_ms(uncached) * 1000.0) as u64;
        let arrival_us = self.trace[r].timestamp * 1000;
        self.ttft_ms
            .push((now + dur_us - arrival_us) as f64 / 1000.0);
        self.schedule(now + dur_us, Event::PrefillDone(w));
    }

    fn route(
        &mut self,
        policy: Policy,
        r: usize,
        rr: &mut usize,
        rng: &mut SplitMix64,
        now: u64,
    ) -> usize {
        match policy {
            Policy::RoundRobin => {
                *rr += 1;
                (*rr - 1) % self.workers.len()
            }
            Policy::FewestInFlight => {
                let min = self.workers.iter().map(|w| w.in_flight).min().unwrap_or(0);
                let ties: Vec<usize> = (0..self.workers.len())
                    .filter(|&i| self.workers[i].in_flight == min)
                    .collect();
                ties[rng.below(ties.len() as u64) as usize]
            }
            Policy::KvpickApprox | Policy::KvpickPrecise => {
                let k = self
                    .kvpick
                    .as_ref()
                    .expect("kvpick policies carry a scheduler");
                let body = InferenceRequest {
                    kind: ApiKind::Completions,
                    model: MODEL.to_string(),
                    segments: vec![Segment::Tokens(prompt_tokens(&self.trace[r]))],
                    stream: true,
                    nvext: NvExt::default(),
                    names_worker: false,
                };
                let req = PickRequest {
                    body: Some(&body),
                    ..Default::default()
                };
                let decision = k
                    .scheduler
                    .pick_at(&req, &k.snapshot, k.at(now))
                    .expect("the simulated pool is never empty");
                let w = k.worker_of[&decision.decode.endpoint.endpoint.instance_id];
                let hashes = if k.precise {
                    k.scheduler.block_hashes(&body)
                } else {
                    Vec::new()
                };
                let guard = decision.begin();
                self.routed[r] = Some(Routed {
                    decision,
                    _guard: guard,
                    hashes,
                });
                w
            }
        }
    }
}

/// Replays `trace` under `policy`.
pub fn simulate(policy: Policy, trace: &[TraceRequest], cfg: &ReplayConfig) -> PolicyFigures {
    let kvpick = match policy {
        Policy::KvpickApprox => Some(Kvpick::new(cfg, false)),
        Policy::KvpickPrecise => Some(Kvpick::new(cfg, true)),
        _ => None,
    };
    let mut sim = Sim {
        trace,
        cfg,
        workers: (0..cfg.workers.max(1))
            .map(|_| Worker::new(cfg.capacity_blocks))
            .collect(),
        events: BinaryHeap::new(),
        seq: 0,
        routed_to: vec![0; trace.len()],
        routed: (0..trace.len()).map(|_| None).collect(),
        ttft_ms: Vec::with_capacity(trace.len()),
        hits: 0,
        blocks: 0,
        spread_sum: 0.0,
        spread_samples: 0,
        kvpick,
    };
    for (i, r) in trace.iter().enumerate() {
        sim.schedule(r.timestamp * 1000, Event::Arrival(i));
    }
    let mut rr = 0usize;
    let mut rng = SplitMix64::new(cfg.seed);
    while let Some(Reverse((now, _, event))) = sim.events.pop() {
        match event {
            Event::Arrival(r) => {
                sim.sample_spread();
                let w = sim.route(policy, r, &mut rr, &mut rng, now);
                sim.routed_to[r] = w;
                sim.workers[w].in_flight += 1;
                sim.workers[w].queue.push_back(r);
                sim.start_prefill(w, now);
            }
            Event::PrefillDone(w) => {
                let r = sim.workers[w]
                    .prefilling
                    .take()
                    .expect("a prefill was running");
                let decoding = sim.workers[w].decoding;
                sim.workers[w].decoding += 1;
                let dur = cfg.model.decode_ms(trace[r].output_length, decoding);
                sim.schedule(now + (dur * 1000.0) as u64, Event::Done(r));
                sim.start_prefill(w, now);
            }
            Event::Done(r) => {
                let w = sim.routed_to[r];
                sim.workers[w].decoding -= 1;
                sim.workers[w].in_flight -= 1;
                if let (Some(routed), Some(k)) = (sim.routed[r].take(), sim.kvpick.as_ref()) {
                    k.scheduler
                        .finish_at(&routed.decision, Some(200), k.at(now));
                }
            }
        }
    }
    debug_assert!(sim
        .workers
        .iter()
        .all(|w| w.in_flight == 0 && w.queue.is_empty() && w.prefilling.is_none()));
    let ttft = sorted(std::mem::take(&mut sim.ttft_ms));
    PolicyFigures {
        name: policy.name().to_string(),
        hit_rate: ratio(sim.hits, sim.blocks),
        of_achievable: 0.0,
        spread: if sim.spread_samples == 0 {
            0.0
        } else {
            sim.spread_sum / sim.spread_samples as f64
        },
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p99_ms: quantile(&ttft, 0.99),
        ttft_ms: ttft,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four conversations, each re-sent ten times with a new tail, interleaved, on
    /// three workers whose pools fit about two conversations: round robin sends each
    /// conversation around all workers and keeps missing; prefix-aware routing keeps
    /// each conversation on one worker.
    fn conversations() -> Vec<TraceRequest> {
        let mut out = Vec::new();
        for turn in 0..10u64 {
            for conv in 0..4u64 {
                let mut ids: Vec<u64> = (0..4).map(|b| conv * 1000 + b).collect();
                ids.push(conv * 1000 + 100 + turn);
                out.push(TraceRequest {
                    timestamp: (turn * 4 + conv) * 2_000,
                    input_length: ids.len() * BLOCK_TOKENS,
                    output_length: 4,
                    hash_ids: ids,
                });
            }
        }
        out
    }

    fn cfg() -> ReplayConfig {
        ReplayConfig {
            workers: 3,
            capacity_blocks: 12,
            model: TimeModel::default(),
            seed: 1,
        }
    }

    #[test]
    fn ceiling_counts_leading_blocks_seen_anywhere() {
        let t = conversations();
        // Per conversation: first turn misses 5, later turns hit the 4 shared blocks.
        let expected = (4.0 * 9.0 * 4.0) / (40.0 * 5.0);
        assert!((ceiling_hit_rate(&t) - expected).abs() < 1e-9);
    }

    #[test]
    fn pooled_ceiling_is_an_lru_of_the_fleet_size() {
        let t = conversations();
        // 4 conversations × 4 shared blocks + 1 tail each turn: a pool of 20 holds
        // every shared prefix (tails churn through LRU), a pool of 4 thrashes.
        let infinite = ceiling_hit_rate(&t);
        assert!((pooled_ceiling_hit_rate(&t, 1000) - infinite).abs() < 1e-9);
        assert!((pooled_ceiling_hit_rate(&t, 20) - infinite).abs() < 1e-9);
        assert_eq!(pooled_ceiling_hit_rate(&t, 4), 0.0);
        let report = run("t", &t, &cfg());
        assert!(report.pooled_ceiling_hit_rate <= report.ceiling_hit_rate);
        for p in &report.policies {
            assert!(p.hit_rate <= report.pooled_ceiling_hit_rate + 1e-9, "{p:?}");
            assert!((p.of_achievable * report.pooled_ceiling_hit_rate - p.hit_rate).abs() < 1e-9);
        }
        assert!(report
            .markdown()
            .contains("one pooled LRU cache of 36 blocks"));
    }

    #[test]
    fn prefix_aware_policies_beat_round_robin_and_stay_under_the_ceiling() {
        let t = conversations();
        let rr = simulate(Policy::RoundRobin, &t, &cfg());
        let approx = simulate(Policy::KvpickApprox, &t, &cfg());
        let precise = simulate(Policy::KvpickPrecise, &t, &cfg());
        let ceiling = ceiling_hit_rate(&t);
        assert!(
            approx.hit_rate > rr.hit_rate + 0.1,
            "{} vs {}",
            approx.hit_rate,
            rr.hit_rate
        );
        assert!(
            precise.hit_rate > rr.hit_rate + 0.1,
            "{} vs {}",
            precise.hit_rate,
            rr.hit_rate
        );
        for p in [&rr, &approx, &precise] {
            assert!(p.hit_rate <= ceiling + 1e-9);
            assert_eq!(p.ttft_ms.len(), t.len());
        }
        // Cached prefixes shorten prefill.
        assert!(precise.ttft_p50_ms < rr.ttft_p50_ms);
    }

    #[test]
    fn spread_is_sampled_at_arrivals_with_load() {
        // Three long requests at once on three workers: arrival 1 finds nothing in
        // flight (no sample), arrival 2 finds [1, 0, 0] (3.0), arrival 3 [1, 1, 0] (1.5).
        let t: Vec<TraceRequest> = (0..3)
            .map(|i| TraceRequest {
                timestamp: 0,
                input_length: BLOCK_TOKENS,
                output_length: 100,
                hash_ids: vec![i],
            })
            .collect();
        let f = simulate(Policy::FewestInFlight, &t, &cfg());
        assert_eq!(f.ttft_ms.len(), 3);
        assert!((f.spread - 2.25).abs() < 1e-9, "{}", f.spread);
    }
}
