//! The `replay` subcommand's flags, read into [`ReplayConfig`]s.

use std::path::PathBuf;
use std::time::Duration;

use kvpick::scheduler::{TermWeights, DEFAULT_PROVISIONAL_TTL, PENDING_PREFILL_WEIGHT};

use super::policy::*;
use crate::bench::sim::TimeModel;
use crate::bench::trace::{self, TraceRequest, BLOCK_TOKENS};

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
    /// Each worker's speed as a multiple of the time model above, one value a
    /// worker (e.g. `1,1,1,1,0.5,0.5,0.5,0.5`: two GPU generations; workers past
    /// the list run at 1): prefill throughput times it, fixed and per-token
    /// times over it.
    #[arg(long, value_delimiter = ',')]
    pub worker_speeds: Vec<f64>,
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
            for (flag, w) in [
                "weight-prefill",
                "weight-decode",
                "weight-queue",
                "weight-kv-usage",
            ]
            .into_iter()
            .zip(given)
            {
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
                    worker_speeds: self.worker_speeds.clone(),
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
pub(super) fn parse_weights(s: &str) -> Result<[f64; 4], String> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    v.try_into()
        .map_err(|v: Vec<f64>| format!("4 weights expected, got {}", v.len()))
}
