//! The built-in policies: round robin, fewest in flight, kvpick's scheduler
//! (with and without KV events) and llm-d's scorers.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, ScrapedLoad, Snapshot, WorkerKey};
use kvpick::kvevents::KvEventSink;
use kvpick::scheduler::{Decision, PickRequest, Plugins, Scheduler, SchedulerConfig, ScoringMode};

use super::feed::{LatencyFeed, PredictionError};
use super::policy::*;
use crate::bench::trace::{self, TraceRequest};
use crate::bench::SplitMix64;

/// Workers in turn.
#[derive(Debug, Default)]
pub struct RoundRobin(usize);

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> String {
        "round-robin".into()
    }

    fn route(&mut self, _: usize, _: &TraceRequest, workers: &[WorkerView], _: u64) -> usize {
        self.0 += 1;
        (self.0 - 1) % workers.len()
    }
}

/// The worker with the fewest requests in flight (its own count; seeded random
/// tie-break).
#[derive(Debug)]
pub struct FewestInFlight {
    rng: SplitMix64,
    in_flight: Vec<usize>,
    routed_to: HashMap<usize, usize>,
}

impl FewestInFlight {
    /// With tie-breaks drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        FewestInFlight {
            rng: SplitMix64::new(seed),
            in_flight: Vec::new(),
            routed_to: HashMap::new(),
        }
    }
}

impl RoutingPolicy for FewestInFlight {
    fn name(&self) -> String {
        "fewest-in-flight".into()
    }

    fn route(&mut self, id: usize, _: &TraceRequest, workers: &[WorkerView], _: u64) -> usize {
        self.in_flight.resize(workers.len(), 0);
        let min = self.in_flight.iter().copied().min().unwrap_or(0);
        let ties: Vec<usize> = (0..workers.len())
            .filter(|&i| self.in_flight[i] == min)
            .collect();
        let w = ties[self.rng.below(ties.len() as u64) as usize];
        self.in_flight[w] += 1;
        self.routed_to.insert(id, w);
        w
    }

    fn finished(&mut self, id: usize, _: u64) {
        if let Some(w) = self.routed_to.remove(&id) {
            self.in_flight[w] -= 1;
        }
    }
}

/// kvpick's real scheduler (see the module doc).
pub struct Kvpick {
    scheduler: Scheduler,
    _table: EndpointTable,
    snapshot: Arc<Snapshot>,
    /// Instance id → simulated worker.
    worker_of: HashMap<u64, usize>,
    keys: Vec<WorkerKey>,
    precise: bool,
    block_tokens: usize,
    base: Instant,
    routed: HashMap<usize, Routed>,
    /// kvpick's hashes of a routed request's full blocks, until its store event.
    hashes: HashMap<usize, Vec<u64>>,
    /// Output tokens of each routed request, until it ends.
    output_tokens: HashMap<usize, usize>,
    /// What the latency models learn from (predicted scoring).
    feed: LatencyFeed<usize>,
}

/// A request kvpick routed: held until its simulated completion.
struct Routed {
    decision: Decision,
    _guard: InFlightGuard,
}

impl Kvpick {
    /// kvpick over `cfg.workers` endpoints, fed by KV events when `precise`.
    pub fn new(cfg: &ReplayConfig, precise: bool) -> Self {
        Self::with_scoring(cfg, precise, ScoringMode::Heuristic)
    }

    /// Precise kvpick scoring by predicted latency, its models fed by each
    /// simulated completion.
    pub fn predicted(cfg: &ReplayConfig) -> Self {
        Self::with_scoring(cfg, true, ScoringMode::Predicted)
    }

    fn with_scoring(cfg: &ReplayConfig, precise: bool, scoring: ScoringMode) -> Self {
        let base = Instant::now();
        let scheduler = Scheduler::new(SchedulerConfig {
            token_block: cfg.block_tokens,
            plugins: Plugins::with_weights(&cfg.kvpick_weights, 0.0),
            tie_break_seed: Some(cfg.seed),
            provisional_ttl: cfg.provisional_ttl,
            pending_prefill_weight: cfg.pending_prefill_weight,
            scoring,
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
                scheduler
                    .index()
                    .set_capacity(*k, cfg.capacity_blocks, base);
            }
        }
        Kvpick {
            scheduler,
            _table: table,
            snapshot,
            worker_of,
            keys,
            precise,
            block_tokens: cfg.block_tokens,
            base,
            routed: HashMap::new(),
            hashes: HashMap::new(),
            output_tokens: HashMap::new(),
            feed: LatencyFeed::default(),
        }
    }

    /// The scheduler's instant of simulated time `t_us`.
    pub(in crate::bench) fn at(&self, t_us: u64) -> Instant {
        self.base + Duration::from_micros(t_us)
    }

    /// The scheduler.
    pub(in crate::bench) fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Simulated worker `w`'s key in the scheduler.
    #[cfg(test)]
    pub(in crate::bench) fn key_of(&self, w: usize) -> WorkerKey {
        self.keys[w]
    }

    /// The endpoint set it routes over.
    pub(in crate::bench) fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }
}

impl RoutingPolicy for Kvpick {
    fn name(&self) -> String {
        match (self.scheduler.latency().is_some(), self.precise) {
            (true, _) => "kvpick-predicted".into(),
            (false, true) => "kvpick-precise".into(),
            (false, false) => "kvpick-approx".into(),
        }
    }

    fn route(
        &mut self,
        id: usize,
        request: &TraceRequest,
        workers: &[WorkerView],
        now_us: u64,
    ) -> usize {
        let now = self.at(now_us);
        for e in &self.snapshot.endpoints {
            let v = &workers[self.worker_of[&e.endpoint.instance_id]];
            e.set_scraped(ScrapedLoad {
                queue: v.waiting as f64,
                running: v.running as f64,
                kv_usage: v.kv_usage,
                block_size: None,
                num_blocks: None,
                at: now,
            });
        }
        let body = trace::body(request, self.block_tokens);
        let req = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        let decision = self
            .scheduler
            .pick_at(&req, &self.snapshot, now)
            .expect("the simulated pool is never empty");
        let w = self.worker_of[&decision.decode.endpoint().instance_id];
        if self.precise {
            self.hashes.insert(id, self.scheduler.block_hashes(&body));
        }
        let guard = decision.begin();
        let learner = self.scheduler.latency().map(|l| &**l);
        self.feed.routed(id, &decision, learner, now);
        if learner.is_some() {
            self.output_tokens.insert(id, request.output_length);
        }
        self.routed.insert(
            id,
            Routed {
                decision,
                _guard: guard,
            },
        );
        w
    }

    /// In-band like Envoy's first response body chunk: no KV-event delay.
    fn prefill_done(&mut self, id: usize, now_us: u64) {
        if let Some(routed) = self.routed.get(&id) {
            self.scheduler.prefill_done(&routed.decision);
            if let Some(learner) = self.scheduler.latency() {
                self.feed.first_token(id, self.at(now_us), learner);
            }
        }
    }

    fn finished(&mut self, id: usize, now_us: u64) {
        if let Some(routed) = self.routed.remove(&id) {
            let at = self.at(now_us);
            self.scheduler.finish_at(&routed.decision, Some(200), at);
            if let (Some(learner), Some(n)) =
                (self.scheduler.latency(), self.output_tokens.remove(&id))
            {
                self.feed.finished(id, at, n, learner);
            }
        }
    }

    fn prediction_error(&self) -> Option<PredictionError> {
        self.feed.error()
    }

    fn kv_event(&mut self, worker: usize, event: KvEvent<'_>, now_us: u64) {
        if !self.precise {
            return;
        }
        let key = self.keys[worker];
        match event {
            KvEvent::Stored { id, request, from } => {
                let Some(hashes) = self.hashes.remove(&id) else {
                    return;
                };
                let pairs: Vec<(u64, u64)> = request.hash_ids[from..]
                    .iter()
                    .zip(hashes.iter().skip(from))
                    .map(|(e, h)| (*e, *h))
                    .collect();
                if !pairs.is_empty() {
                    let parent = from.checked_sub(1).map(|p| request.hash_ids[p]);
                    self.scheduler
                        .store_engine_chain(key, parent, &pairs, self.at(now_us));
                }
            }
            KvEvent::Removed(ids) => self.scheduler.remove_engine_blocks(key, ids),
        }
    }
}

/// The llm-d Router v0.10.0 default scheduling profile (`loadDefaultConfig` in
/// `pkg/epp/config/loader/defaults.go`): `queue-scorer` (weight 2),
/// `kv-cache-utilization-scorer` (2) and `prefix-cache-scorer` (3), summed, and
/// the `max-score-picker` (highest total, random tie-break).
///
/// - queue: `(max − waiting) / (max − min)` over the candidates, 1 when all equal;
/// - KV utilization: `1 − kv_usage`;
/// - prefix: matched blocks / prompt blocks from the `approx-prefix-cache-producer`
///   with `autoTune` (block size and per-pod LRU capacity from the engine's
///   metrics: the trace's block size, `capacity_blocks` entries): prompts hashed in
///   full blocks (at most 131,072 tokens), a pod's match counts the leading blocks
///   it holds while any pod holds them, and the chosen pod's LRU gets the prompt's
///   blocks at routing time (the producer's `PreRequest`).
///
/// Metrics are read fresh at every pick (llm-d scrapes every 50 ms).
pub struct LlmD {
    rng: SplitMix64,
    capacity: usize,
    block_tokens: usize,
    /// Per pod: block → last use; and use → block (its LRU).
    lru: Vec<(HashMap<u64, u64>, std::collections::BTreeMap<u64, u64>)>,
    clock: u64,
    /// Block → pods holding it in their LRU.
    pods_of: HashMap<u64, HashSet<usize>>,
}

impl LlmD {
    /// Weight of the queue scorer.
    const QUEUE: f64 = 2.0;
    /// Weight of the KV-cache utilization scorer.
    const KV: f64 = 2.0;
    /// Weight of the prefix-cache scorer.
    const PREFIX: f64 = 3.0;
    /// `maxPrefixTokensToMatch`.
    const MAX_PREFIX_TOKENS: usize = 131_072;

    /// A fresh router for `cfg`'s fleet.
    pub fn new(cfg: &ReplayConfig) -> Self {
        LlmD {
            rng: SplitMix64::new(cfg.seed),
            capacity: cfg.capacity_blocks.max(1),
            block_tokens: cfg.block_tokens,
            lru: (0..cfg.workers).map(|_| Default::default()).collect(),
            clock: 0,
            pods_of: HashMap::new(),
        }
    }

    /// The blocks the producer hashes: full blocks, capped.
    fn blocks<'r>(&self, request: &'r TraceRequest) -> &'r [u64] {
        let full = (request.input_length / self.block_tokens)
            .min(Self::MAX_PREFIX_TOKENS / self.block_tokens)
            .min(request.hash_ids.len());
        &request.hash_ids[..full]
    }

    /// The producer's `Add`: every block into the pod's LRU, in order.
    fn add(&mut self, pod: usize, blocks: &[u64]) {
        for &b in blocks {
            self.clock += 1;
            let (last_use, by_age) = &mut self.lru[pod];
            if let Some(old) = last_use.insert(b, self.clock) {
                by_age.remove(&old);
            }
            by_age.insert(self.clock, b);
            if last_use.len() > self.capacity {
                let (_, gone) = by_age.pop_first().expect("ages mirror entries");
                last_use.remove(&gone);
                if let Some(pods) = self.pods_of.get_mut(&gone) {
                    pods.remove(&pod);
                    if pods.is_empty() {
                        self.pods_of.remove(&gone);
                    }
                }
            }
            self.pods_of.entry(b).or_default().insert(pod);
        }
    }
}

impl RoutingPolicy for LlmD {
    fn name(&self) -> String {
        "llm-d".into()
    }

    fn route(&mut self, _: usize, request: &TraceRequest, workers: &[WorkerView], _: u64) -> usize {
        let ties = self.best(request, workers);
        let pod = ties[self.rng.below(ties.len() as u64) as usize];
        self.place(pod, request);
        pod
    }
}

impl LlmD {
    /// The workers with the highest total score for `request` (the picker
    /// chooses among them at random).
    pub fn best(&self, request: &TraceRequest, workers: &[WorkerView]) -> Vec<usize> {
        let blocks = self.blocks(request);
        let mut matched = vec![0usize; workers.len()];
        for b in blocks {
            let Some(pods) = self.pods_of.get(b) else {
                break;
            };
            for &p in pods {
                matched[p] += 1;
            }
        }
        let min_q = workers.iter().map(|w| w.waiting).min().unwrap_or(0);
        let max_q = workers.iter().map(|w| w.waiting).max().unwrap_or(0);
        let scores: Vec<f64> = workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let queue = match max_q == min_q {
                    true => 1.0,
                    false => (max_q - w.waiting) as f64 / (max_q - min_q) as f64,
                };
                let kv = 1.0 - w.kv_usage;
                let prefix = match blocks.is_empty() {
                    true => 0.0,
                    false => matched[i] as f64 / blocks.len() as f64,
                };
                Self::QUEUE * queue + Self::KV * kv + Self::PREFIX * prefix
            })
            .collect();
        let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (0..scores.len()).filter(|&i| scores[i] == best).collect()
    }

    /// Records that `request` went to `pod` (the producer's `PreRequest`).
    pub fn place(&mut self, pod: usize, request: &TraceRequest) {
        let blocks = self.blocks(request);
        self.add(pod, blocks);
    }
}
