//! The load-only and llm-d peers of `kvpick-bench replay` (`e2e::bench::replay`'s
//! [`RoutingPolicy`]s) as AISimulate [`PlacementPolicy`]s, so they run on the
//! same engines as kvpick and Dynamo's router.
//!
//! - `fewest-in-flight`: [`FewestInFlight`], its own count of unfinished
//!   requests per worker, ties broken by a seeded generator;
//! - `llm-d`: [`LlmD`], the llm-d Router v0.10.0 default profile (queue 2, KV
//!   usage 2, approximate prefix 3).
//!
//! What a peer reads is what it reads in `kvpick-bench replay`: per worker the
//! engine's gauges (waiting, running, KV usage) from the same periodic scrape
//! kvpick reads ([`Scrapes`]); per request its prompt as 512-token blocks (a
//! chained hash of each full 512-token chunk of the prompt's token ids, so two
//! prompts share leading block ids exactly when they share those tokens); and
//! the runtime's prefill-completed and terminal signals. llm-d's per-pod LRU
//! holds the engine's capacity (`num_gpu_blocks` × block size) in those blocks.
//! Invariant: every placed request is known by one id until it is terminal.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use aisimulate_core::replay::loadgen::ReplayRequestPayload;
use aisimulate_core::replay::{
    NoEngineEvents, NoReplayMetadata, Placement, PlacementDecision, PlacementEffects,
    PlacementPolicy, ReplayComposition, RequestIdentity, WorkerTopology,
};
use anyhow::Context;
use e2e::bench::replay::{FewestInFlight, LlmD, ReplayConfig, RoutingPolicy, WorkerView};
use e2e::bench::trace::{TraceRequest, BLOCK_TOKENS};
use uuid::Uuid;

use super::fixed_pool;
use super::placement::Scrapes;

/// Which peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    FewestInFlight,
    LlmD,
}

impl Peer {
    /// The policy's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::FewestInFlight => "fewest-in-flight",
            Peer::LlmD => "llm-d",
        }
    }
}

/// Settings of one peer run.
#[derive(Debug, Clone)]
pub struct PeerSettings {
    pub peer: Peer,
    /// Engine KV block size in tokens.
    pub block_size: usize,
    /// Engine GPU blocks per worker.
    pub num_gpu_blocks: usize,
    /// Seed of the peer's tie-break.
    pub seed: u64,
}

/// Builds [`PeerPlacement`] for aggregated replays.
pub struct PeerComposition {
    settings: PeerSettings,
    scrapes: Scrapes,
}

impl PeerComposition {
    /// A composition whose placement reads `scrapes`.
    pub fn new(settings: PeerSettings, scrapes: Scrapes) -> Self {
        PeerComposition { settings, scrapes }
    }
}

impl ReplayComposition for PeerComposition {
    type Metadata = NoReplayMetadata;
    type Observation = NoEngineEvents;
    type AggregatedPlacement = PeerPlacement;
    type DisaggregatedPlacement = PeerPlacement;

    fn create_aggregated_placement(
        &mut self,
        dp_size: u32,
        topology: Vec<WorkerTopology>,
    ) -> anyhow::Result<PeerPlacement> {
        fixed_pool::single_rank("peer", dp_size)?;
        let s = &self.settings;
        let capacity_blocks = (s.num_gpu_blocks * s.block_size / BLOCK_TOKENS).max(1);
        let cfg = ReplayConfig {
            workers: topology.len(),
            capacity_blocks,
            seed: s.seed,
            ..ReplayConfig::default()
        };
        let policy: Box<dyn RoutingPolicy + Send> = match s.peer {
            Peer::FewestInFlight => Box::new(FewestInFlight::new(s.seed)),
            Peer::LlmD => Box::new(LlmD::new(&cfg)),
        };
        let mut workers = Vec::with_capacity(topology.len());
        for w in topology {
            let scheduler_id = *w
                .scheduler_ids
                .first()
                .with_context(|| format!("worker {} has no scheduler", w.worker_id))?;
            workers.push((w.worker_id, scheduler_id));
        }
        Ok(PeerPlacement {
            policy,
            workers,
            capacity_blocks,
            scrapes: self.scrapes.clone(),
            ids: HashMap::new(),
            next_id: 0,
        })
    }

    fn create_disaggregated_placements(
        &mut self,
        _: u32,
        _: Vec<WorkerTopology>,
        _: u32,
        _: Vec<WorkerTopology>,
    ) -> anyhow::Result<(PeerPlacement, PeerPlacement)> {
        fixed_pool::aggregated_only("peer")
    }
}

/// A peer routing policy as a placement policy (see the module doc).
pub struct PeerPlacement {
    policy: Box<dyn RoutingPolicy + Send>,
    /// (AISimulate worker id, scheduler id), by the policy's worker index.
    workers: Vec<(usize, usize)>,
    capacity_blocks: usize,
    scrapes: Scrapes,
    /// Placed and not yet terminal: request → the policy's request id.
    ids: HashMap<Uuid, usize>,
    next_id: usize,
}

/// The prompt as `kvpick-bench replay` hands it to a policy: chained hashes of
/// its full 512-token chunks.
fn trace_request(tokens: &[u32], now_ms: f64) -> TraceRequest {
    let mut parent = 0u64;
    let hash_ids = tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|chunk| {
            let mut h = DefaultHasher::new();
            (parent, chunk).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect();
    TraceRequest {
        timestamp: now_ms as u64,
        input_length: tokens.len(),
        output_length: 0,
        hash_ids,
    }
}

fn micros(now_ms: f64) -> u64 {
    Duration::from_secs_f64(now_ms.max(0.0) / 1_000.0).as_micros() as u64
}

impl PlacementPolicy<ReplayRequestPayload> for PeerPlacement {
    type Metadata = NoReplayMetadata;
    type Observation = ();

    fn place(
        &mut self,
        request: &ReplayRequestPayload,
        _: NoReplayMetadata,
        _: Option<String>,
        now_ms: f64,
    ) -> anyhow::Result<PlacementEffects> {
        let request_id = request
            .request_id()
            .context("peer placement needs a request id")?;
        let tokens = match request.materialized_tokens() {
            Some(t) => trace_request(t, now_ms),
            None => trace_request(&request.prompt_tokens(), now_ms),
        };
        let views: Vec<WorkerView> = self
            .workers
            .iter()
            .map(|&(worker_id, _)| {
                let g = self.scrapes.latest(worker_id).unwrap_or_default();
                WorkerView {
                    waiting: g.waiting as usize,
                    running: g.running as usize,
                    kv_usage: g.kv_usage,
                    capacity_blocks: self.capacity_blocks,
                }
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        let w = self.policy.route(id, &tokens, &views, micros(now_ms));
        let &(_, scheduler_id) = self
            .workers
            .get(w)
            .context("the peer picked a worker outside the pool")?;
        self.ids.insert(request_id, id);
        Ok(PlacementEffects {
            decision: PlacementDecision::Immediate(Placement {
                request_id,
                scheduler_id,
                reported_overlap_tokens: 0,
                cache_sample: None,
                placement_replica_id: None,
            }),
            released: Vec::new(),
        })
    }

    fn observe(&mut self, _: (), _: f64) -> anyhow::Result<Vec<Placement>> {
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
        if let Some(id) = self.ids.remove(&request_id) {
            self.policy.finished(id, micros(now_ms));
        }
        Ok(Vec::new())
    }

    fn prefill_completed(
        &mut self,
        request_id: Uuid,
        now_ms: f64,
    ) -> anyhow::Result<Vec<Placement>> {
        if let Some(&id) = self.ids.get(&request_id) {
            self.policy.prefill_done(id, micros(now_ms));
        }
        Ok(Vec::new())
    }

    fn pending_count(&self) -> usize {
        0
    }

    fn worker_ready(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::ready(
            "peer",
            self.workers.iter().any(|&(id, _)| id == w.worker_id),
            &w,
        )
    }

    fn worker_draining(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::changed("peer", &w, "drains")
    }

    fn worker_removed(&mut self, w: WorkerTopology, _: f64) -> anyhow::Result<Vec<Placement>> {
        fixed_pool::changed("peer", &w, "left")
    }

    fn topology_settled(&mut self, _: f64) -> anyhow::Result<Vec<Placement>> {
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prompts sharing their first 512 tokens share their first block id and
    /// no other; a partial chunk is no block.
    #[test]
    fn shared_tokens_share_leading_block_ids() {
        let a: Vec<u32> = (0..1_500).collect();
        let mut b = a.clone();
        b[600] = 9_999;
        let (ra, rb) = (trace_request(&a, 0.0), trace_request(&b, 0.0));
        assert_eq!(ra.hash_ids.len(), 2);
        assert_eq!(ra.hash_ids[0], rb.hash_ids[0]);
        assert_ne!(ra.hash_ids[1], rb.hash_ids[1]);
    }
}
