//! The event-driven replay of a trace through one policy over simulated engines.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::policy::*;
use super::report::*;
use crate::bench::sim::{Engine, TimeModel};
use crate::bench::trace::TraceRequest;
use crate::bench::{quantile, ratio, sorted};

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
    /// Each worker's time model.
    models: Vec<TimeModel>,
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
        let Some(start) = self.workers[w].begin_step(self.trace, &self.models[w]) else {
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
        models: (0..cfg.workers.max(1)).map(|w| cfg.model_of(w)).collect(),
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
        prediction_error: policy.prediction_error(),
        ttft_ms: ttft,
        requests: sim.requests,
    }
}

/// Max/mean in-flight of `total` requests (at least 1) on `workers` placed as
/// evenly as whole requests allow: `ceil(total / workers) / (total / workers)`.
/// 3 requests on 8 workers score 8/3 however they are placed.
pub fn balanced_spread(total: usize, workers: usize) -> f64 {
    let mean = total as f64 / workers.max(1) as f64;
    total.div_ceil(workers.max(1)) as f64 / mean
}
