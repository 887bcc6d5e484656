//! kvpick's real [`Scheduler`] and [`EndpointTable`] as an AISimulate
//! [`PlacementPolicy`], inside a [`ReplayComposition`] of its own.
//!
//! What kvpick reads, and when, is what it reads in a pool:
//! - load: the engines' own gauges (waiting and running requests, KV usage, block
//!   size, GPU blocks), sampled by the replay's telemetry observer every scrape
//!   interval of virtual time ([`Scrapes`]), set on every endpoint before a pick;
//! - bookings: the in-flight guard from [`Decision::begin`] and the decision's
//!   booked blocks, the uncached part released when the engine reports the
//!   prefill done and the rest when the request is terminal;
//! - prefixes: approximate mode feeds the index with kvpick's own decisions
//!   (per-worker bound: the engine's GPU blocks); precise mode marks every worker
//!   precise and hands the engines' KV events, translated into vLLM's
//!   `BlockStored` / `BlockRemoved` with token ids, to kvpick's own ingest
//!   ([`Ingest`]), which hashes the blocks as the request side does;
//! - latency (predicted mode: precise, `--scoring predicted`): the scheduler's
//!   latency models learn each request's TTFT when the runtime reports its
//!   first token and its decode pace when it is terminal, with the features its
//!   decision kept ([`LatencyFeed`]).
//!
//! The scheduler's clock is the virtual clock (`base + now_ms`). Invariant: every
//! placed request has exactly one entry in `routed` until the runtime reports it
//! terminal, so an endpoint's in-flight count is the number of its requests the
//! engine has not finished.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aisimulate_core::engine::{KvEvent, KvEventData, KvEventTier};
use aisimulate_core::replay::loadgen::ReplayRequestPayload;
use aisimulate_core::replay::{
    EngineEventBatch, NoReplayMetadata, Placement, PlacementDecision, PlacementEffects,
    PlacementPolicy, ReplayComposition, ReplayEngineObservation, ReplayTelemetryObserver,
    ReplayTelemetrySnapshot, RequestIdentity, WorkerStage, WorkerTopology,
};
use anyhow::{anyhow, Context};
use clap::Parser;
use e2e::bench::completion_of_tokens;
use e2e::bench::replay::LatencyFeed;
use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, ScrapedLoad, Snapshot, WorkerKey};
use kvpick::kvevents::Ingest;
use kvpick::kvevents::{self, BlockRemoved, BlockStored, EventBatch, StorageTier};
use kvpick::scheduler::{Decision, PickRequest, Scheduler, SchedulerConfig};
use uuid::Uuid;

use super::fixed_pool;

/// The model name requests carry and KV events are seeded with.
const MODEL: &str = "aisim-replay";

/// How kvpick runs: where its prefix index learns what each worker holds, and
/// what its cost is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Index from kvpick's own routing decisions; heuristic cost.
    Approximate,
    /// Index from the engines' KV events; heuristic cost.
    Precise,
    /// Index from the engines' KV events; cost in predicted seconds
    /// (`--scoring predicted`), its latency models fed by the runtime.
    Predicted,
}

impl Mode {
    /// Every mode, in report order.
    pub const ALL: [Mode; 3] = [Mode::Approximate, Mode::Precise, Mode::Predicted];

    /// The policy's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Approximate => "kvpick-approx",
            Mode::Precise => "kvpick-precise",
            Mode::Predicted => "kvpick-predicted",
        }
    }

    /// Whether the engines' KV events feed the index.
    fn precise(self) -> bool {
        self != Mode::Approximate
    }
}

/// Settings of one kvpick run.
#[derive(Debug, Clone)]
pub struct KvpickSettings {
    pub mode: Mode,
    /// Engine KV block size in tokens (kvpick hashes prompts in the same blocks).
    pub block_size: usize,
    /// Engine GPU blocks per worker.
    pub num_gpu_blocks: usize,
    /// Seed of the scheduler's tie-break.
    pub seed: u64,
}

/// One engine's gauges as a `/metrics` scrape shows them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    pub waiting: u64,
    pub running: u64,
    pub kv_usage: f64,
    pub total_blocks: u64,
    pub sampled_at_ms: f64,
}

/// The latest gauges of every worker, by AISimulate worker id: written by the
/// telemetry observer, read by the placement before each pick; and load figures
/// over every sample ([`LoadStats`]), for the report.
#[derive(Debug, Clone, Default)]
pub struct Scrapes(Arc<Mutex<ScrapeState>>);

#[derive(Debug, Default)]
struct ScrapeState {
    latest: HashMap<usize, Gauges>,
    stats: LoadStats,
}

/// How evenly a run loaded its workers, over the telemetry samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadStats {
    /// Samples with any request on any worker.
    pub busy_samples: u64,
    /// Sum over busy samples of max / mean (waiting + running) over workers.
    spread_sum: f64,
    /// Sum over busy samples of the waiting requests of all workers.
    waiting_sum: f64,
}

impl LoadStats {
    /// Mean over busy samples of max / mean requests (waiting + running) per worker.
    pub fn spread(&self) -> f64 {
        self.spread_sum / self.busy_samples.max(1) as f64
    }

    /// Mean over busy samples of the requests waiting in all engines.
    pub fn waiting(&self) -> f64 {
        self.waiting_sum / self.busy_samples.max(1) as f64
    }
}

impl Scrapes {
    /// Workers with at least one sample.
    pub fn workers(&self) -> usize {
        self.0.lock().map(|m| m.latest.len()).unwrap_or(0)
    }

    /// The latest gauges of AISimulate worker `worker_id`, if sampled yet.
    pub fn latest(&self, worker_id: usize) -> Option<Gauges> {
        self.0.lock().ok()?.latest.get(&worker_id).copied()
    }

    /// Load figures over the samples so far.
    pub fn stats(&self) -> LoadStats {
        self.0.lock().map(|m| m.stats).unwrap_or_default()
    }
}

impl ReplayTelemetryObserver for Scrapes {
    fn on_sample(&mut self, snapshot: ReplayTelemetrySnapshot) -> anyhow::Result<()> {
        let mut state = self.0.lock().map_err(|_| anyhow!("scrape lock poisoned"))?;
        let rows = &snapshot.decode_scheduler_metrics;
        let loads = rows.iter().map(|m| m.waiting_requests + m.running_requests);
        let (total, max) = loads.fold((0, 0), |(t, m), l| (t + l, m.max(l)));
        if total > 0 {
            let stats = &mut state.stats;
            stats.busy_samples += 1;
            stats.spread_sum += max as f64 * rows.len() as f64 / total as f64;
            stats.waiting_sum += rows.iter().map(|m| m.waiting_requests as f64).sum::<f64>();
        }
        for m in snapshot.decode_scheduler_metrics {
            // One gauge set per worker: dp size is 1 here.
            state.latest.insert(
                m.worker_id,
                Gauges {
                    waiting: m.waiting_requests,
                    running: m.running_requests,
                    kv_usage: m.active_cache_usage,
                    total_blocks: m.total_blocks,
                    sampled_at_ms: snapshot.sampled_at_ms,
                },
            );
        }
        Ok(())
    }
}

/// Engine KV events of one or more workers, as the replay hands them over.
#[derive(Debug, Default)]
pub struct EngineKvEvents(Vec<(usize, Vec<KvEvent>)>);

impl EngineEventBatch for EngineKvEvents {
    fn is_empty(&self) -> bool {
        self.0.iter().all(|(_, e)| e.is_empty())
    }

    fn append(&mut self, mut other: Self) {
        self.0.append(&mut other.0);
    }
}

/// The observation adapter: engines publish KV events (with token ids).
#[derive(Debug, Default)]
pub struct KvEventObservation;

impl ReplayEngineObservation for KvEventObservation {
    type Batch = EngineKvEvents;

    const CAPTURE_ENGINE_KV_EVENTS: bool = true;

    fn observe_engine_events(
        _stage: WorkerStage,
        worker_id: usize,
        _dp_rank: u32,
        events: Vec<KvEvent>,
    ) -> Self::Batch {
        EngineKvEvents(vec![(worker_id, events)])
    }
}

/// Builds [`KvpickPlacement`] for aggregated replays (disaggregated ones are out of scope).
pub struct KvpickComposition {
    settings: KvpickSettings,
    scrapes: Scrapes,
    /// The endpoint table of the placement built, for checks after the run.
    table: Arc<Mutex<Option<Arc<Snapshot>>>>,
    /// Requests placed on each worker (by endpoint index), for checks after the run.
    placed: Placed,
    /// The latency models' feed, for its prediction error after the run.
    feed: Feed,
}

/// The latency feed of a placement, keyed by request id.
pub type Feed = Arc<Mutex<LatencyFeed<Uuid>>>;

/// Requests placed on each worker, by endpoint index.
pub type Placed = Arc<Mutex<Vec<usize>>>;

impl KvpickComposition {
    /// A composition whose placement reads `scrapes`.
    pub fn new(settings: KvpickSettings, scrapes: Scrapes) -> Self {
        KvpickComposition {
            settings,
            scrapes,
            table: Arc::default(),
            placed: Arc::default(),
            feed: Arc::default(),
        }
    }

    /// A handle on the latency feed of the placement this composition builds.
    pub fn feed(&self) -> Feed {
        Arc::clone(&self.feed)
    }

    /// A handle on the endpoints of the placement this composition builds.
    pub fn endpoints(&self) -> Arc<Mutex<Option<Arc<Snapshot>>>> {
        Arc::clone(&self.table)
    }

    /// A handle on the per-worker placement counts of the placement this
    /// composition builds.
    pub fn placed(&self) -> Placed {
        Arc::clone(&self.placed)
    }
}

impl ReplayComposition for KvpickComposition {
    type Metadata = NoReplayMetadata;
    type Observation = KvEventObservation;
    type AggregatedPlacement = KvpickPlacement;
    type DisaggregatedPlacement = KvpickPlacement;

    fn create_aggregated_placement(
        &mut self,
        dp_size: u32,
        topology: Vec<WorkerTopology>,
    ) -> anyhow::Result<KvpickPlacement> {
        fixed_pool::single_rank("kvpick", dp_size)?;
        let placement = KvpickPlacement::new(
            &self.settings,
            topology,
            self.scrapes.clone(),
            Arc::clone(&self.placed),
            Arc::clone(&self.feed),
        )?;
        *self
            .table
            .lock()
            .map_err(|_| anyhow!("table lock poisoned"))? = Some(Arc::clone(&placement.snapshot));
        Ok(placement)
    }

    fn create_disaggregated_placements(
        &mut self,
        _: u32,
        _: Vec<WorkerTopology>,
        _: u32,
        _: Vec<WorkerTopology>,
    ) -> anyhow::Result<(KvpickPlacement, KvpickPlacement)> {
        fixed_pool::aggregated_only("kvpick")
    }
}

/// One simulated worker as kvpick's endpoint.
struct SimWorker {
    worker_id: usize,
    scheduler_id: usize,
}

/// A request kvpick placed, held until the runtime reports it terminal.
struct Routed {
    decision: Decision,
    _guard: InFlightGuard,
    /// Its output tokens (one response chunk each).
    output_tokens: usize,
}

/// kvpick as a placement policy (see the module doc).
pub struct KvpickPlacement {
    scheduler: Arc<Scheduler>,
    ingest: Option<Ingest<Scheduler>>,
    _table: EndpointTable,
    snapshot: Arc<Snapshot>,
    /// By endpoint index (the snapshot's order).
    workers: Vec<SimWorker>,
    /// AISimulate worker id → endpoint index.
    endpoint_of: HashMap<usize, usize>,
    keys: Vec<WorkerKey>,
    scrapes: Scrapes,
    block_size: usize,
    routed: HashMap<Uuid, Routed>,
    placed: Placed,
    feed: Feed,
    base: Instant,
    last_upkeep_ms: f64,
}

impl KvpickPlacement {
    fn new(
        settings: &KvpickSettings,
        topology: Vec<WorkerTopology>,
        scrapes: Scrapes,
        placed: Placed,
        feed: Feed,
    ) -> anyhow::Result<Self> {
        let scheduler = Arc::new(Scheduler::new(scheduler_config(settings)?));
        let table = EndpointTable::new();
        table.replace(
            (0..topology.len())
                .map(|i| {
                    let addr = format!("10.2.{}.{}:8000", i / 250, i % 250 + 1);
                    Endpoint::new(addr.parse().expect("a valid socket address"))
                })
                .collect(),
        );
        let snapshot = table.snapshot();
        // The snapshot orders endpoints its own way: pair them with workers by index.
        let mut workers = Vec::with_capacity(topology.len());
        for w in topology {
            let scheduler_id = *w
                .scheduler_ids
                .first()
                .with_context(|| format!("worker {} has no scheduler", w.worker_id))?;
            workers.push(SimWorker {
                worker_id: w.worker_id,
                scheduler_id,
            });
        }
        let endpoint_of = workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.worker_id, i))
            .collect();
        let base = Instant::now();
        let keys: Vec<WorkerKey> = snapshot.endpoints.iter().map(|e| e.key(0)).collect();
        let ingest = match settings.mode.precise() {
            true => {
                let mut ingest = Ingest::new(Arc::clone(&scheduler), MODEL);
                for k in &keys {
                    ingest.set_live(*k, true);
                }
                Some(ingest)
            }
            false => {
                for k in &keys {
                    scheduler
                        .index()
                        .set_capacity(*k, settings.num_gpu_blocks, base);
                }
                None
            }
        };
        Ok(KvpickPlacement {
            scheduler,
            ingest,
            _table: table,
            snapshot,
            workers,
            endpoint_of,
            keys,
            scrapes,
            block_size: settings.block_size,
            routed: HashMap::new(),
            placed,
            feed,
            base,
            last_upkeep_ms: 0.0,
        })
    }

    fn at(&self, now_ms: f64) -> Instant {
        self.base + Duration::from_secs_f64(now_ms.max(0.0) / 1_000.0)
    }

    /// Sets every endpoint's scraped load from the latest sample, and runs the
    /// scheduler's periodic upkeep once per virtual second, as the server does.
    fn scrape(&mut self, now_ms: f64) -> anyhow::Result<()> {
        let state = self
            .scrapes
            .0
            .lock()
            .map_err(|_| anyhow!("scrape lock poisoned"))?;
        for (i, w) in self.workers.iter().enumerate() {
            let Some(g) = state.latest.get(&w.worker_id) else {
                continue;
            };
            self.snapshot.endpoints[i].set_scraped(ScrapedLoad {
                queue: g.waiting as f64,
                running: g.running as f64,
                kv_usage: g.kv_usage,
                block_size: Some(self.block_size as u32),
                num_blocks: Some(g.total_blocks),
                at: self.at(g.sampled_at_ms),
            });
        }
        drop(state);
        if now_ms - self.last_upkeep_ms >= 1_000.0 {
            self.scheduler.maintain(&self.snapshot, self.at(now_ms));
            self.last_upkeep_ms = now_ms;
        }
        Ok(())
    }

    /// Ends a placed request's bookings; its decode pace is learned.
    fn finish(&mut self, request_id: Uuid, now_ms: f64) -> anyhow::Result<()> {
        let Some(routed) = self.routed.remove(&request_id) else {
            return Ok(());
        };
        let at = self.at(now_ms);
        self.scheduler.finish_at(&routed.decision, Some(200), at);
        if let Some(learner) = self.scheduler.latency() {
            self.feed
                .lock()
                .map_err(|_| anyhow!("feed lock poisoned"))?
                .finished(request_id, at, routed.output_tokens, learner);
        }
        Ok(())
    }
}

/// The scheduler settings of a kvpick started with its default flags,
/// `--prefix-token-block` at the engine's block size and, in predicted mode,
/// `--scoring predicted`, seeded.
fn scheduler_config(settings: &KvpickSettings) -> anyhow::Result<SchedulerConfig> {
    let token_block = format!("--prefix-token-block={}", settings.block_size);
    let mut argv = vec!["kvpick", token_block.as_str()];
    if settings.mode == Mode::Predicted {
        argv.push("--scoring=predicted");
    }
    let flags = kvpick::config::Args::try_parse_from(argv)?;
    Ok(SchedulerConfig {
        tie_break_seed: Some(settings.seed),
        ..flags.scheduler(Vec::new())
    })
}

/// One engine event as vLLM publishes it; host-tier events are not on the GPU
/// and are published with their tier, which kvpick's ingest skips.
fn vllm_event(event: KvEvent, block_size: usize) -> kvevents::KvEvent {
    let tier = match event.tier {
        KvEventTier::Device => StorageTier::Gpu,
        KvEventTier::HostPinned => StorageTier::Cpu,
    };
    match event.data {
        KvEventData::Stored(stored) => {
            let mut token_ids = Vec::with_capacity(stored.blocks.len() * block_size);
            for b in &stored.blocks {
                token_ids.extend(b.token_ids.iter().flatten());
            }
            kvevents::KvEvent::BlockStored(BlockStored {
                block_hashes: stored.blocks.iter().map(|b| b.block_hash).collect(),
                parent_block_hash: stored.parent_hash,
                token_ids,
                block_size,
                lora_id: None,
                tier,
                lora_name: None,
                group_idx: None,
                block_mm_hashes: Vec::new(),
                cache_salt: None,
            })
        }
        KvEventData::Removed { block_hashes } => kvevents::KvEvent::BlockRemoved(BlockRemoved {
            block_hashes,
            tier,
            ..BlockRemoved::default()
        }),
    }
}

impl PlacementPolicy<ReplayRequestPayload> for KvpickPlacement {
    type Metadata = NoReplayMetadata;
    type Observation = EngineKvEvents;

    fn place(
        &mut self,
        request: &ReplayRequestPayload,
        _: NoReplayMetadata,
        _: Option<String>,
        now_ms: f64,
    ) -> anyhow::Result<PlacementEffects> {
        let request_id = request
            .request_id()
            .context("kvpick placement needs a request id")?;
        self.scrape(now_ms)?;
        let tokens = match request.materialized_tokens() {
            Some(t) => t.to_vec(),
            None => request.prompt_tokens(),
        };
        let body = completion_of_tokens(MODEL, tokens);
        let pick = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        let decision = self
            .scheduler
            .pick_at(&pick, &self.snapshot, self.at(now_ms))
            .map_err(|e| anyhow!("kvpick found no endpoint: {e}"))?;
        let key = decision.decode.state.key(decision.decode.rank);
        let endpoint = self
            .keys
            .iter()
            .position(|k| *k == key)
            .context("kvpick picked an endpoint outside the pool")?;
        let placement = Placement {
            request_id,
            scheduler_id: self.workers[endpoint].scheduler_id,
            reported_overlap_tokens: decision.overlap_blocks * self.block_size,
            cache_sample: None,
            placement_replica_id: None,
        };
        {
            let mut placed = self
                .placed
                .lock()
                .map_err(|_| anyhow!("placed lock poisoned"))?;
            placed.resize(self.workers.len(), 0);
            placed[endpoint] += 1;
        }
        let guard = decision.begin();
        let at = self.at(now_ms);
        self.feed
            .lock()
            .map_err(|_| anyhow!("feed lock poisoned"))?
            .routed(request_id, &decision, self.scheduler.latency().map(|l| &**l), at);
        self.routed.insert(
            request_id,
            Routed {
                decision,
                _guard: guard,
                output_tokens: request.metadata().max_output_tokens,
            },
        );
        Ok(PlacementEffects {
            decision: PlacementDecision::Immediate(placement),
            released: Vec::new(),
        })
    }

    fn observe(&mut self, events: EngineKvEvents, now_ms: f64) -> anyhow::Result<Vec<Placement>> {
        let Some(ingest) = self.ingest.as_mut() else {
            return Ok(Vec::new());
        };
        let now = self.base + Duration::from_secs_f64(now_ms.max(0.0) / 1_000.0);
        for (worker_id, events) in events.0 {
            let endpoint = *self
                .endpoint_of
                .get(&worker_id)
                .with_context(|| format!("KV events from unknown worker {worker_id}"))?;
            let batch = EventBatch {
                ts: now_ms / 1_000.0,
                events: events
                    .into_iter()
                    .map(|e| vllm_event(e, self.block_size))
                    .collect(),
                dp_rank: None,
            };
            ingest.apply(self.keys[endpoint], None, &batch, now);
        }
        Ok(Vec::new())
    }

    fn cancel_pending(&mut self, _: Uuid) -> bool {
        false
    }

    fn request_terminal(
        &mut self,
        request_id: Uuid,
        now_ms: f64,
    ) -> anyhow::Result<Vec<Placement>> {
        self.finish(request_id, now_ms)?;
        Ok(Vec::new())
    }

    /// The runtime reports a request's first output token here: its prefill
    /// is over, and its TTFT is learned.
    fn prefill_completed(
        &mut self,
        request_id: Uuid,
        now_ms: f64,
    ) -> anyhow::Result<Vec<Placement>> {
        let Some(routed) = self.routed.get(&request_id) else {
            return Ok(Vec::new());
        };
        self.scheduler.prefill_done(&routed.decision);
        if let Some(learner) = self.scheduler.latency() {
            self.feed
                .lock()
                .map_err(|_| anyhow!("feed lock poisoned"))?
                .first_token(request_id, self.at(now_ms), learner);
        }
        Ok(Vec::new())
    }

    fn pending_count(&self) -> usize {
        0
    }

    fn worker_ready(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::ready("kvpick", self.endpoint_of.contains_key(&w.worker_id), &w)
    }

    fn worker_draining(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::changed("kvpick", &w, "drains")
    }

    fn worker_removed(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::changed("kvpick", &w, "left")
    }

    fn topology_settled(&mut self, _: f64) -> anyhow::Result<Vec<Placement>> {
        Ok(Vec::new())
    }
}
