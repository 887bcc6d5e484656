//! `kvpick-bench replay --overload X`: the trace replayed X times faster than
//! recorded, with a mix of priorities, through kvpick's scheduler with and without
//! its flow control, against the replay's simulated workers ([`super::sim`]).
//!
//! Each request gets a class from its trace index (deterministic): `high`
//! (priority 10), `normal` (0) or `sheddable` (-1), in the `--mix` proportions.
//! Four runs share the trace and the fleet: 1× and X×, each with flow control off
//! (every request routed on arrival) and on (kvpick's real [`Gate`]: sheddable
//! requests shed at once when the pool is saturated, the others held in priority
//! queues with a TTL). Saturation reads each worker's engine queue as a fresh
//! scrape at simulated time; the in-flight guards of routed requests are held
//! until their simulated completion. TTFT counts the wait in kvpick's queue, the
//! engine queue and the prefill; shed requests have none and count in the shed
//! fraction.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::admission::{
    AdmissionConfig, Gate, NoObserver, RequestClass, SaturationConfig, Ticket, Verdict,
};
use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, ScrapedLoad, Snapshot};
use kvpick::scheduler::{Decision, PickRequest, Scheduler, SchedulerConfig};
use serde::Serialize;

use super::sim::{TimeModel, Worker};
use super::trace::{self, TraceRequest, BLOCK_TOKENS};
use super::{markdown_table, quantile, sorted, SplitMix64};

/// The priority classes, highest first: (name, priority).
pub const CLASSES: [(&str, i32); 3] = [("high", 10), ("normal", 0), ("sheddable", -1)];

/// Settings of an overload run.
#[derive(Debug, Clone)]
pub struct OverloadConfig {
    /// Arrival-rate multiple of the overloaded runs.
    pub factor: f64,
    /// Simulated workers.
    pub workers: usize,
    /// KV pool size of each worker in 512-token blocks.
    pub capacity_blocks: usize,
    /// The time model.
    pub model: TimeModel,
    /// Shares of high, normal and sheddable requests.
    pub mix: [f64; 3],
    /// Flow control's engine-queue threshold (requests waiting per worker).
    pub queue_depth_threshold: f64,
    /// Flow control's queue TTL.
    pub ttl: Duration,
    /// Seed of the class assignment.
    pub seed: u64,
}

/// One class's figures in one run.
#[derive(Debug, Clone, Serialize)]
pub struct ClassFigures {
    /// The class name.
    pub class: String,
    /// Requests of the class.
    pub requests: usize,
    /// Share shed (429), 0..1.
    pub shed: f64,
    /// Median TTFT of the served requests.
    pub ttft_p50_ms: f64,
    /// 99th percentile TTFT of the served requests.
    pub ttft_p99_ms: f64,
}

/// One run: a rate, flow control on or off.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    /// Arrival-rate multiple.
    pub factor: f64,
    /// Whether flow control was on.
    pub flow_control: bool,
    /// Per class, highest priority first.
    pub classes: Vec<ClassFigures>,
    /// Share of all requests shed.
    pub shed: f64,
}

/// The overload report.
#[derive(Debug, Clone, Serialize)]
pub struct OverloadReport {
    /// Requests replayed per run.
    pub requests: usize,
    /// Simulated workers.
    pub workers: usize,
    /// Flow control's engine-queue threshold.
    pub queue_depth_threshold: f64,
    /// Flow control's TTL, seconds.
    pub ttl_s: f64,
    /// The four runs: 1× off, 1× on, X× off, X× on.
    pub runs: Vec<RunFigures>,
}

impl OverloadReport {
    /// The run at `factor` with flow control `on`.
    pub fn run(&self, factor: f64, on: bool) -> Option<&RunFigures> {
        self.runs
            .iter()
            .find(|r| r.factor == factor && r.flow_control == on)
    }

    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        let mut rows = Vec::new();
        for r in &self.runs {
            for c in &r.classes {
                rows.push(vec![
                    format!("{}×", r.factor),
                    if r.flow_control { "on" } else { "off" }.to_string(),
                    c.class.clone(),
                    c.requests.to_string(),
                    format!("{:.0}", c.ttft_p50_ms),
                    format!("{:.0}", c.ttft_p99_ms),
                    format!("{:.1}%", c.shed * 100.0),
                ]);
            }
        }
        let mut out = format!(
            "{} requests per run, {} workers, flow control: engine queue threshold {} per worker, TTL {} s\n\n{}",
            self.requests,
            self.workers,
            self.queue_depth_threshold,
            self.ttl_s,
            markdown_table(
                &["rate", "flow control", "class", "requests", "TTFT p50 ms", "TTFT p99 ms", "shed"],
                &rows,
            )
        );
        let factor = self.runs.last().map_or(1.0, |r| r.factor);
        let high_p99 = |f: f64, on: bool| {
            self.run(f, on)
                .and_then(|r| r.classes.first())
                .map(|c| c.ttft_p99_ms)
        };
        if let (Some(base), Some(off), Some(on)) = (
            high_p99(1.0, false),
            high_p99(factor, false),
            high_p99(factor, true),
        ) {
            out.push_str(&format!(
                "\nhigh-priority TTFT p99 at {factor}× against 1× without flow control: {:.2}× with flow control, {:.2}× without\n",
                on / base,
                off / base
            ));
        }
        out
    }
}

/// Runs 1× and `cfg.factor`×, each with flow control off and on.
pub fn run(trace: &[TraceRequest], cfg: &OverloadConfig) -> OverloadReport {
    let classes = assign_classes(trace.len(), cfg.mix, cfg.seed);
    let mut runs = Vec::new();
    for factor in [1.0, cfg.factor] {
        for on in [false, true] {
            let started = Instant::now();
            let r = simulate(trace, &classes, cfg, factor, on);
            eprintln!(
                "overload: {factor}× flow control {} done in {:.1} s (shed {:.1}%)",
                if on { "on" } else { "off" },
                started.elapsed().as_secs_f64(),
                r.shed * 100.0
            );
            runs.push(r);
        }
    }
    OverloadReport {
        requests: trace.len(),
        workers: cfg.workers,
        queue_depth_threshold: cfg.queue_depth_threshold,
        ttl_s: cfg.ttl.as_secs_f64(),
        runs,
    }
}

/// Class index (into [`CLASSES`]) of every request, drawn with `mix`.
pub fn assign_classes(n: usize, mix: [f64; 3], seed: u64) -> Vec<usize> {
    let total: f64 = mix.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut g = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let u = (g.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
            let mut acc = 0.0;
            mix.iter()
                .position(|m| {
                    acc += m;
                    u < acc
                })
                .unwrap_or(CLASSES.len() - 1)
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    PrefillDone(usize),
    Done(usize),
    /// A queued request's TTL may have run out.
    Expire,
}

struct Routed {
    decision: Decision,
    _guard: InFlightGuard,
}

struct Sim<'a> {
    trace: &'a [TraceRequest],
    cfg: &'a OverloadConfig,
    factor: f64,
    workers: Vec<Worker>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    scheduler: Scheduler,
    _table: EndpointTable,
    snapshot: Arc<Snapshot>,
    worker_of: HashMap<u64, usize>,
    base: Instant,
    routed_to: Vec<usize>,
    routed: Vec<Option<Routed>>,
    ttft_ms: Vec<Option<f64>>,
    shed: Vec<bool>,
    waiting: Vec<(usize, Ticket)>,
}

impl Sim<'_> {
    fn at(&self, t_us: u64) -> Instant {
        self.base + Duration::from_micros(t_us)
    }

    fn arrival_us(&self, r: usize) -> u64 {
        (self.trace[r].timestamp as f64 * 1000.0 / self.factor) as u64
    }

    fn schedule(&mut self, at_us: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at_us, self.seq, e)));
    }

    /// Publishes every worker's engine queue as a scrape taken `now`.
    fn scrape(&self, now: u64) {
        for e in &self.snapshot.endpoints {
            let w = &self.workers[self.worker_of[&e.endpoint.instance_id]];
            e.set_scraped(ScrapedLoad {
                queue: w.queue.len() as f64,
                running: (w.decoding + usize::from(w.prefilling.is_some())) as f64,
                kv_usage: 0.0,
                block_size: Some(BLOCK_TOKENS as u32),
                num_blocks: Some(self.cfg.capacity_blocks as u64),
                at: self.at(now),
            });
        }
    }

    fn route(&mut self, r: usize, now: u64) {
        let body = trace::body(&self.trace[r], BLOCK_TOKENS);
        let req = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        let decision = self
            .scheduler
            .pick_at(&req, &self.snapshot, self.at(now))
            .expect("the simulated pool is never empty");
        let w = self.worker_of[&decision.decode.endpoint().instance_id];
        let guard = decision.begin();
        self.routed[r] = Some(Routed {
            decision,
            _guard: guard,
        });
        self.routed_to[r] = w;
        self.workers[w].in_flight += 1;
        self.workers[w].queue.push_back(r);
        self.start_prefill(w, now);
    }

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
        worker.pool.store(&req.hash_ids);
        let uncached = req.input_length.saturating_sub(hits * BLOCK_TOKENS);
        let dur_us = (self.cfg.model.prefill_ms(uncached) * 1000.0) as u64;
        self.ttft_ms[r] = Some((now + dur_us - self.arrival_us(r)) as f64 / 1000.0);
        self.schedule(now + dur_us, Event::PrefillDone(w));
    }

    /// Lets queued requests go while the pool has room, routing them now.
    fn dispatch(&mut self, gate: &Gate, now: u64) {
        if self.waiting.is_empty() {
            return;
        }
        loop {
            self.scrape(now);
            gate.dispatch_at(&self.snapshot, self.at(now));
            let mut went = Vec::new();
            let mut i = 0;
            while i < self.waiting.len() {
                match self.waiting[i].1.try_verdict() {
                    None => i += 1,
                    Some(verdict) => {
                        let (r, _) = self.waiting.swap_remove(i);
                        match verdict {
                            Ok(permit) => went.push((r, permit)),
                            Err(_) => self.shed[r] = true,
                        }
                    }
                }
            }
            if went.is_empty() {
                return;
            }
            // Route in the order the gate let them go would need its sequence;
            // within one pass they all had room, so arrival order is fine.
            went.sort_by_key(|(r, _)| *r);
            for (r, permit) in went {
                self.route(r, now);
                drop(permit);
            }
        }
    }
}

fn simulate(
    trace: &[TraceRequest],
    classes: &[usize],
    cfg: &OverloadConfig,
    factor: f64,
    flow_control: bool,
) -> RunFigures {
    let base = Instant::now();
    let scheduler = Scheduler::new(SchedulerConfig {
        token_block: BLOCK_TOKENS,
        ..SchedulerConfig::default()
    });
    let table = EndpointTable::new();
    table.replace(
        (0..cfg.workers.max(1))
            .map(|i| {
                let addr = format!("10.1.{}.{}:8000", i / 250, i % 250 + 1);
                Endpoint::new(addr.parse().expect("a valid socket address"))
            })
            .collect(),
    );
    let snapshot = table.snapshot();
    let worker_of: HashMap<u64, usize> = snapshot
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| (e.endpoint.instance_id, i))
        .collect();
    for e in &snapshot.endpoints {
        scheduler
            .index()
            .set_capacity(e.key(0), cfg.capacity_blocks, base);
    }
    let gate = Gate::new(
        AdmissionConfig {
            enabled: flow_control,
            ttl: cfg.ttl,
            saturation: SaturationConfig {
                queue_depth_threshold: cfg.queue_depth_threshold,
                kv_cache_util_threshold: 1.0,
                max_in_flight_per_rank: 0,
                metrics_staleness: Duration::from_secs(1),
            },
            ..AdmissionConfig::default()
        },
        Arc::default(),
        Arc::new(NoObserver),
    );
    let mut sim = Sim {
        trace,
        cfg,
        factor,
        workers: (0..cfg.workers.max(1))
            .map(|_| Worker::new(cfg.capacity_blocks))
            .collect(),
        events: BinaryHeap::new(),
        seq: 0,
        scheduler,
        _table: table,
        snapshot,
        worker_of,
        base,
        routed_to: vec![0; trace.len()],
        routed: (0..trace.len()).map(|_| None).collect(),
        ttft_ms: vec![None; trace.len()],
        shed: vec![false; trace.len()],
        waiting: Vec::new(),
    };
    for r in 0..trace.len() {
        let at = sim.arrival_us(r);
        sim.schedule(at, Event::Arrival(r));
    }
    let ttl_us = cfg.ttl.as_micros() as u64;
    while let Some(Reverse((now, _, event))) = sim.events.pop() {
        match event {
            Event::Arrival(r) => {
                let (_, priority) = CLASSES[classes[r]];
                let class = RequestClass {
                    priority,
                    flow: trace::MODEL.into(),
                    objective: "".into(),
                    model: trace::MODEL.into(),
                    bytes: trace[r].input_length * 4,
                };
                sim.scrape(now);
                match gate.admit_at(class, &sim.snapshot, sim.at(now)) {
                    Verdict::Go(permit) => {
                        sim.route(r, now);
                        drop(permit);
                    }
                    Verdict::Wait(ticket) => {
                        sim.waiting.push((r, ticket));
                        sim.schedule(now + ttl_us, Event::Expire);
                        sim.dispatch(&gate, now);
                    }
                    Verdict::Reject(_) => sim.shed[r] = true,
                }
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
                sim.dispatch(&gate, now);
            }
            Event::Done(r) => {
                let w = sim.routed_to[r];
                sim.workers[w].decoding -= 1;
                sim.workers[w].in_flight -= 1;
                if let Some(routed) = sim.routed[r].take() {
                    sim.scheduler
                        .finish_at(&routed.decision, Some(200), sim.at(now));
                }
                sim.dispatch(&gate, now);
            }
            Event::Expire => sim.dispatch(&gate, now),
        }
    }
    let figures = CLASSES
        .iter()
        .enumerate()
        .map(|(c, (name, _))| {
            let members: Vec<usize> = (0..trace.len()).filter(|&r| classes[r] == c).collect();
            let shed = members.iter().filter(|&&r| sim.shed[r]).count();
            let ttft = sorted(members.iter().filter_map(|&r| sim.ttft_ms[r]).collect());
            ClassFigures {
                class: name.to_string(),
                requests: members.len(),
                shed: shed as f64 / members.len().max(1) as f64,
                ttft_p50_ms: quantile(&ttft, 0.5),
                ttft_p99_ms: quantile(&ttft, 0.99),
            }
        })
        .collect();
    RunFigures {
        factor,
        flow_control,
        classes: figures,
        shed: sim.shed.iter().filter(|s| **s).count() as f64 / trace.len().max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forty long prompts arriving together on two workers: without flow control
    /// every class queues in the engines; with it, high-priority requests jump the
    /// line and sheddable ones are shed.
    #[test]
    fn flow_control_protects_high_priority_under_a_burst() {
        let trace: Vec<TraceRequest> = (0..40u64)
            .map(|i| TraceRequest {
                timestamp: i * 10,
                input_length: 4096,
                output_length: 4,
                hash_ids: (0..8).map(|b| i * 100 + b).collect(),
            })
            .collect();
        let cfg = OverloadConfig {
            factor: 2.0,
            workers: 2,
            capacity_blocks: 1000,
            model: TimeModel::default(),
            mix: [0.25, 0.5, 0.25],
            queue_depth_threshold: 1.0,
            ttl: Duration::from_secs(60),
            seed: 3,
        };
        let report = run(&trace, &cfg);
        let off = report.run(2.0, false).unwrap();
        let on = report.run(2.0, true).unwrap();
        assert_eq!(off.shed, 0.0);
        assert!(on.classes[2].shed > 0.0, "{on:?}");
        assert!(
            on.classes[0].ttft_p99_ms < off.classes[0].ttft_p99_ms,
            "{report:?}"
        );
        assert!(report.markdown().contains("| 2× | on | high |"));
    }

    #[test]
    fn classes_follow_the_mix() {
        let c = assign_classes(10_000, [0.2, 0.5, 0.3], 1);
        let share = |k| c.iter().filter(|&&x| x == k).count() as f64 / 1e4;
        assert!((share(0) - 0.2).abs() < 0.02);
        assert!((share(2) - 0.3).abs() < 0.02);
    }
}
