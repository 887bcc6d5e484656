//! `kvpick-anchors replay`: kvpick-bench's trace replay with Dynamo's router as one
//! more policy, every policy in the same run (see `e2e::bench::replay`).
//!
//! The `dynamo` policy is Dynamo's own code (`dynamo-kv-router` 1.6.1, the pieces
//! its `LocalScheduler` composes, driven synchronously on the simulated clock):
//! - overlaps from its `RadixTree` indexer, fed by the workers' delayed KV events
//!   (trace block ids as both local and external block hashes: a trace id names
//!   its whole prefix, as a chained hash does);
//! - load from its `ActiveSequencesMultiWorker` tracking (a request is added when
//!   routed, its prefill marked complete, freed when it finishes), projected for
//!   the request's blocks as its queue does before each selection;
//! - the choice by `DefaultWorkerSelector` with Dynamo's default `KvRouterConfig`
//!   (overlap credit 1, prefill-token tracking on, temperature 0), aggregated
//!   workers (its "decode" selector label), seeded tie-break.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{
    LocalBlockHash, PrefillLoadHint, WorkerConfigLike, WorkerId, WorkerWithDpRank,
};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, DefaultWorkerSelector, KvRouterConfig, NoopSequencePublisher,
    RadixTree, SchedulingRequest, SequenceRequest, WorkerSelectionInput, WorkerSelector,
};
use e2e::bench::replay::{self, KvEvent, ReplayArgs, ReplayConfig, RoutingPolicy, WorkerView};
use e2e::bench::trace::{TraceRequest, BLOCK_TOKENS};

use crate::index::{removed_event, stored_event, Store};

/// Options of `kvpick-anchors replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayCmd {
    #[command(flatten)]
    args: ReplayArgs,
    /// Write the report (markdown) here too.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Replays every (capacity, speed) with kvpick-bench's policies and `dynamo`.
pub fn run(cmd: ReplayCmd) -> anyhow::Result<()> {
    let (name, trace) = cmd.args.load()?;
    let policies = |cfg: &ReplayConfig| {
        let mut p = replay::builtin(cfg);
        p.push(Box::new(Dynamo::new(cfg)) as Box<dyn RoutingPolicy>);
        p
    };
    let report = replay::matrix(&name, &trace, &cmd.args.configs(), &policies);
    if let Some(dir) = &cmd.args.dump_requests {
        replay::write_requests(dir, &report.runs)?;
    }
    let md = report.markdown();
    print!("{md}");
    if let Some(path) = &cmd.out {
        std::fs::write(path, md)?;
    }
    Ok(())
}

/// A simulated worker as Dynamo's selector sees its configuration.
struct Worker {
    kv_blocks: u64,
    taints: HashSet<String>,
}

impl WorkerConfigLike for Worker {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        None
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(self.kv_blocks)
    }
    fn taints(&self) -> &HashSet<String> {
        &self.taints
    }
}

/// Dynamo's router (see the module doc).
pub struct Dynamo {
    config: KvRouterConfig,
    selector: DefaultWorkerSelector,
    indexer: RadixTree,
    sequences: ActiveSequencesMultiWorker<NoopSequencePublisher>,
    workers: HashMap<WorkerId, Worker>,
    base: Instant,
    event_id: u64,
}

impl Dynamo {
    /// A fresh router for `cfg`'s fleet.
    pub fn new(cfg: &ReplayConfig) -> Self {
        let config = KvRouterConfig::default();
        let workers: HashMap<WorkerId, Worker> = (0..cfg.workers as WorkerId)
            .map(|w| {
                let worker = Worker {
                    kv_blocks: cfg.capacity_blocks as u64,
                    taints: HashSet::new(),
                };
                (w, worker)
            })
            .collect();
        let dp_range = workers.keys().map(|&w| (w, (0, 1))).collect();
        Dynamo {
            selector: DefaultWorkerSelector::new_seeded(Some(config.clone()), "decode", cfg.seed),
            config,
            indexer: RadixTree::new(),
            sequences: ActiveSequencesMultiWorker::new_without_expiry(
                NoopSequencePublisher,
                BLOCK_TOKENS,
                dp_range,
                false,
                0,
                "decode",
            ),
            workers,
            base: Instant::now(),
            event_id: 0,
        }
    }

    /// The simulated instant `t_us` on Dynamo's (tokio's) clock type.
    fn at(&self, t_us: u64) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.base + Duration::from_micros(t_us))
    }
}

fn request_id(id: usize) -> String {
    format!("r{id}")
}

impl RoutingPolicy for Dynamo {
    fn name(&self) -> String {
        "dynamo".into()
    }

    fn route(&mut self, id: usize, request: &TraceRequest, _: &[WorkerView], now_us: u64) -> usize {
        let now = self.at(now_us);
        let full = (request.input_length / BLOCK_TOKENS).min(request.hash_ids.len());
        let blocks = &request.hash_ids[..full];
        let scores = self
            .indexer
            .find_matches(blocks.iter().map(|b| LocalBlockHash(*b)).collect(), false);
        let mut overlap = OverlapSignals::default();
        for (w, s) in &scores.scores {
            overlap.effective_overlap_blocks.insert(*w, f64::from(*s));
            overlap
                .effective_cached_tokens
                .insert(*w, *s as usize * BLOCK_TOKENS);
        }
        let token_seq: Vec<u64> = blocks.to_vec();
        let track = self.config.router_track_prefill_tokens;
        let sched = SchedulingRequest {
            mode: ScheduleMode::QueryOnly {
                request_id: Some(request_id(id)),
            },
            token_seq: Some(token_seq.clone()),
            isl_tokens: request.input_length,
            lora_name: None,
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: Default::default(),
            router_config_override: None,
            track_prefill_tokens: track,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
            worker_loads: self.sequences.project_worker_loads(Some(&token_seq), now),
            resp_tx: None,
        };
        let selection = self
            .selector
            .select_worker(WorkerSelectionInput::configured(
                &self.workers,
                &sched,
                sched.eligibility(),
                BLOCK_TOKENS as u32,
            ))
            .expect("every simulated worker is eligible");
        let worker: WorkerWithDpRank = selection.worker;
        let cached = scores.scores.get(&worker).copied().unwrap_or(0) as usize * BLOCK_TOKENS;
        let uncached = request.input_length.saturating_sub(cached);
        self.sequences
            .add_request(
                SequenceRequest {
                    request_id: request_id(id),
                    token_sequence: Some(token_seq),
                    track_prefill_tokens: track,
                    expected_output_tokens: None,
                    prefill_load_hint: (track && uncached > 0).then_some(PrefillLoadHint {
                        initial_effective_prefill_tokens: uncached,
                        expected_prefill_duration: None,
                    }),
                    worker,
                    lora_name: None,
                },
                now,
            )
            .expect("the worker is registered");
        worker.worker_id as usize
    }

    fn prefill_done(&mut self, id: usize, now_us: u64) {
        let now = self.at(now_us);
        self.sequences
            .mark_prefill_completed(&request_id(id), now)
            .expect("a tracked request");
    }

    fn finished(&mut self, id: usize, now_us: u64) {
        let now = self.at(now_us);
        self.sequences
            .free(&request_id(id), now)
            .expect("a tracked request");
    }

    fn kv_event(&mut self, worker: usize, event: KvEvent<'_>, _: u64) {
        self.event_id += 1;
        let event = match event {
            KvEvent::Stored { request, from, .. } => {
                if from >= request.hash_ids.len() {
                    return;
                }
                let store = Store {
                    worker: worker as WorkerId,
                    parent: from.checked_sub(1).map(|p| request.hash_ids[p]),
                    blocks: request.hash_ids[from..].to_vec(),
                };
                stored_event(&store, self.event_id)
            }
            KvEvent::Removed(ids) => removed_event(worker as WorkerId, ids, self.event_id),
        };
        // A removal of blocks the tree never saw (a store still in flight) is
        // reported as an error by the tree and changes nothing, as in Dynamo.
        let _ = self.indexer.apply_event(event);
    }
}
