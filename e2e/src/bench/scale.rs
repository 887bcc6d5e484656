//! `kvpick-bench scale`: the prefix index and scheduler at fleet scale.
//!
//! Builds an endpoint table of `endpoints` workers and fills the index with
//! `blocks_per_endpoint` blocks per worker through the KV-event path
//! ([`PrefixIndex::store_engine_chain`], 32 blocks an event, every worker
//! precise), shaped like a real pool: a 32-block shared system prompt held by
//! every worker, then per-group conversation chains held by pairs of workers.
//! Then measures:
//! - memory: RSS growth while filling, next to the index's own estimate;
//! - event ingest rate (blocks per second while filling);
//! - lookup latency of a 32k-token prompt (2,048 blocks of 16 tokens) over all
//!   workers, and the latency of a full pick (hash, lookup, score) for it;
//! - pod churn: replacing all endpoints with new ones and clearing their index
//!   entries (what discovery does when every pod is rescheduled).

use std::time::Instant;

use kvpick::endpoints::{Endpoint, EndpointTable, WorkerKey};
use kvpick::kv::hash::{model_seed, token_block_hashes};
use kvpick::scheduler::{PickRequest, Scheduler, SchedulerConfig};
use serde::Serialize;

use super::{completion_of_tokens, markdown_table, micros, quantile, sorted, SplitMix64};

const MODEL: &str = "scale";
/// Blocks of the shared system prompt every worker holds.
const SHARED_BLOCKS: usize = 32;
/// Workers holding each conversation chain.
const REPLICAS: usize = 2;
/// Blocks per KV event.
const EVENT_BLOCKS: usize = 32;
/// Tokens of the looked-up prompt.
const PROMPT_TOKENS: usize = 32 * 1024;

/// Settings of a scale run.
#[derive(Debug, Clone, Copy)]
pub struct ScaleConfig {
    /// Workers (one rank each).
    pub endpoints: usize,
    /// Indexed blocks per worker.
    pub blocks_per_endpoint: usize,
    /// Timed lookups and picks.
    pub iterations: usize,
}

/// The scale report.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// Workers.
    pub endpoints: usize,
    /// Indexed (block, worker) entries.
    pub indexed_blocks: usize,
    /// Distinct block hashes.
    pub distinct_blocks: usize,
    /// RSS growth while filling the index, in MiB.
    pub rss_delta_mib: f64,
    /// The index's own estimate, in MiB.
    pub index_estimate_mib: f64,
    /// Blocks ingested per second through KV events.
    pub ingest_blocks_per_s: f64,
    /// Seconds to fill the index.
    pub fill_s: f64,
    /// Blocks of the looked-up prompt.
    pub prompt_blocks: usize,
    /// Lookup latency over all workers, median, µs.
    pub lookup_p50_us: f64,
    /// Lookup latency over all workers, 99th percentile, µs.
    pub lookup_p99_us: f64,
    /// Full pick latency (hash + lookup + score), median, µs.
    pub pick_p50_us: f64,
    /// Full pick latency, 99th percentile, µs.
    pub pick_p99_us: f64,
    /// Milliseconds to replace every endpoint and clear their index entries.
    pub churn_ms: f64,
    /// Index entries left after the churn (should be 0).
    pub entries_after_churn: usize,
}

impl ScaleReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        let rows = vec![
            vec!["endpoints".into(), self.endpoints.to_string()],
            vec![
                "indexed (block, worker) entries".into(),
                self.indexed_blocks.to_string(),
            ],
            vec!["distinct blocks".into(), self.distinct_blocks.to_string()],
            vec![
                "memory: RSS growth / index estimate".into(),
                format!(
                    "{:.0} MiB / {:.0} MiB ({:.0} / {:.0} bytes per entry)",
                    self.rss_delta_mib,
                    self.index_estimate_mib,
                    self.rss_delta_mib * 1_048_576.0 / self.indexed_blocks.max(1) as f64,
                    self.index_estimate_mib * 1_048_576.0 / self.indexed_blocks.max(1) as f64,
                ),
            ],
            vec![
                "event ingest".into(),
                format!(
                    "{:.2} M blocks/s ({:.1} s to fill)",
                    self.ingest_blocks_per_s / 1e6,
                    self.fill_s
                ),
            ],
            vec![
                format!("lookup, {}-block prompt, p50 / p99", self.prompt_blocks),
                format!(
                    "{:.0} µs / {:.0} µs",
                    self.lookup_p50_us, self.lookup_p99_us
                ),
            ],
            vec![
                "full pick (hash + lookup + score), p50 / p99".into(),
                format!("{:.0} µs / {:.0} µs", self.pick_p50_us, self.pick_p99_us),
            ],
            vec![
                "full pod churn (replace all endpoints, clear their entries)".into(),
                format!(
                    "{:.0} ms ({} entries left)",
                    self.churn_ms, self.entries_after_churn
                ),
            ],
        ];
        markdown_table(&["measure", "value"], &rows)
    }
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn endpoints(n: usize, generation: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| {
            let addr = format!(
                "10.{}.{}.{}:8000",
                generation * 64 + i / 65_536,
                (i / 256) % 256,
                i % 256
            );
            Endpoint::new(addr.parse().expect("a valid socket address"))
        })
        .collect()
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut g = SplitMix64::new(seed);
    (0..n).map(|_| g.below(128_000) as u32).collect()
}

/// Runs the scale benchmark.
pub fn run(cfg: &ScaleConfig) -> ScaleReport {
    let sched = Scheduler::new(SchedulerConfig::default());
    let token_block = sched.config().token_block;
    let table = EndpointTable::new();
    table.replace(endpoints(cfg.endpoints, 0));
    let snapshot = table.snapshot();
    let keys: Vec<WorkerKey> = snapshot.endpoints.iter().map(|e| e.key(0)).collect();
    let index = sched.index();
    for k in &keys {
        index.set_precise(*k, true);
    }

    // The looked-up prompt: shared system prompt, then group 0's conversation, then new text.
    let seed = model_seed(MODEL, None);
    let prompt = tokens(1, PROMPT_TOKENS);
    let prompt_hashes = token_block_hashes(seed, None, &prompt, token_block);
    let shared = &prompt_hashes[..SHARED_BLOCKS.min(prompt_hashes.len())];
    let chain_len = cfg.blocks_per_endpoint.saturating_sub(shared.len());
    let group0: Vec<u64> = prompt_hashes
        .iter()
        .skip(shared.len())
        .take(chain_len.min(prompt_hashes.len() / 2))
        .copied()
        .collect();

    let rss_before = rss_bytes();
    let now = Instant::now();
    let mut g = SplitMix64::new(2);
    let mut ingested = 0usize;
    let fill_started = Instant::now();
    let groups = keys.len().div_ceil(REPLICAS);
    for group in 0..groups {
        let chain: Vec<u64> = if group == 0 {
            // Group 0 holds the prompt's conversation, padded with other blocks.
            let mut c = group0.clone();
            c.extend((c.len()..chain_len).map(|_| g.next_u64()));
            c
        } else {
            (0..chain_len).map(|_| g.next_u64()).collect()
        };
        let blocks: Vec<u64> = shared.iter().chain(chain.iter()).copied().collect();
        for k in keys.iter().skip(group * REPLICAS).take(REPLICAS) {
            let mut parent = None;
            for event in blocks.chunks(EVENT_BLOCKS) {
                // Engine hashes differ per worker, as in a real fleet.
                let pairs: Vec<(u64, u64)> = event
                    .iter()
                    .map(|h| (h ^ k.instance_id.rotate_left(17), *h))
                    .collect();
                index.store_engine_chain(*k, parent, &pairs, now);
                parent = pairs.last().map(|(e, _)| *e);
                ingested += pairs.len();
            }
        }
    }
    let fill = fill_started.elapsed();
    let rss_after = rss_bytes();
    let entries = index.len();
    eprintln!(
        "scale: {entries} entries in {:.1} s, estimating memory...",
        fill.as_secs_f64()
    );
    let estimate = index.memory_bytes();
    let distinct = groups * chain_len + shared.len();

    let mut lookups = Vec::with_capacity(cfg.iterations);
    for _ in 0..cfg.iterations {
        let t = Instant::now();
        let counts = index.lookup(&prompt_hashes, &keys, Instant::now());
        lookups.push(micros(t.elapsed()));
        assert!(
            counts.iter().copied().max().unwrap_or(0) >= shared.len(),
            "the shared prefix is indexed"
        );
    }
    let body = completion_of_tokens(MODEL, prompt.clone());
    let mut picks = Vec::with_capacity(cfg.iterations);
    for _ in 0..cfg.iterations {
        let req = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        let t = Instant::now();
        let d = sched.pick(&req, &snapshot).expect("endpoints exist");
        picks.push(micros(t.elapsed()));
        sched.finish(&d, Some(200));
    }
    drop(snapshot);

    let churn_started = Instant::now();
    let removed = table.replace(endpoints(cfg.endpoints, 1));
    for e in &removed {
        for rank in 0..e.dp_size.max(1) {
            index.clear_worker(WorkerKey {
                instance_id: e.instance_id,
                dp_rank: rank,
            });
        }
    }
    let churn = churn_started.elapsed();

    let lookups = sorted(lookups);
    let picks = sorted(picks);
    let mib = |b: f64| b / 1_048_576.0;
    ScaleReport {
        endpoints: keys.len(),
        indexed_blocks: entries,
        distinct_blocks: distinct,
        rss_delta_mib: mib(rss_after.saturating_sub(rss_before) as f64),
        index_estimate_mib: mib(estimate as f64),
        ingest_blocks_per_s: ingested as f64 / fill.as_secs_f64().max(1e-9),
        fill_s: fill.as_secs_f64(),
        prompt_blocks: prompt_hashes.len(),
        lookup_p50_us: quantile(&lookups, 0.5),
        lookup_p99_us: quantile(&lookups, 0.99),
        pick_p50_us: quantile(&picks, 0.5),
        pick_p99_us: quantile(&picks, 0.99),
        churn_ms: churn.as_secs_f64() * 1e3,
        entries_after_churn: index.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_fleet_fills_looks_up_and_churns_clean() {
        let r = run(&ScaleConfig {
            endpoints: 6,
            blocks_per_endpoint: 100,
            iterations: 3,
        });
        assert_eq!(r.endpoints, 6);
        assert_eq!(r.indexed_blocks, 600);
        // 3 groups of 68-block chains plus the 32 shared blocks.
        assert_eq!(r.distinct_blocks, 3 * 68 + 32);
        assert_eq!(r.prompt_blocks, PROMPT_TOKENS / 16);
        assert_eq!(r.entries_after_churn, 0);
        assert!(r.index_estimate_mib > 0.0);
    }
}
