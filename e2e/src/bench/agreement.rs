//! `kvpick-bench agreement`: does the `llm-d` policy of `kvpick-bench replay`
//! ([`LlmD`], a re-implementation of the reference picker's default profile)
//! decide as the real peer endpoint picker ([`super::peer_epp`]) does?
//!
//! Both see the same decisions: the same idle mock workers (equal queue and KV
//! usage, so only the prefix term separates them), the same prompts, and the
//! same placement history. Each request goes to the peer over ext_proc first;
//! the re-implementation is then asked for its best workers (its score maximum,
//! among which its picker chooses at random) and told where the peer routed, so
//! both hold the same prefix state at the next request. A decision agrees when
//! the peer's worker is among the re-implementation's best. Decisions where the
//! re-implementation has a single best worker are counted apart: there the
//! prefix term decided, and a random tie-break cannot hide a difference.
//!
//! Prompts are `/v1/completions` prompts built from block ids: each block is
//! 64 characters, the peer's block (the workers' 16-token KV block at its 4
//! characters a token), so both sides see the same blocks. Requests draw a
//! shared prefix of one of a few groups (cut at a random block) and add fresh
//! blocks, with lengths up to [`MAX_BLOCKS`] blocks.

use std::collections::HashMap;
use std::net::SocketAddr;

use anyhow::{bail, Context};
use serde::Serialize;

use super::overhead::{connect, routed_request_to};
use super::peer_epp::{Fleet, PeerEpp, PINNED};
use super::replay::{LlmD, ReplayConfig, WorkerView};
use super::trace::TraceRequest;
use super::{table_of, SplitMix64};

/// Tokens in a mock worker's KV block (its `cache_config_info`).
const BLOCK_TOKENS: usize = 16;
/// Characters of one block in the prompt (4 characters a token).
const BLOCK_CHARS: usize = BLOCK_TOKENS * 4;
/// KV blocks of a mock worker (its `num_gpu_blocks`, the peer's per-pod LRU size).
const WORKER_BLOCKS: usize = 1024;
/// Longest prompt, in blocks.
pub const MAX_BLOCKS: usize = 600;

/// Settings of one agreement run.
#[derive(Debug, Clone)]
pub struct AgreementConfig {
    /// Mock workers in the pool.
    pub workers: usize,
    /// Requests sent.
    pub requests: usize,
    /// Prefix groups the requests share.
    pub groups: usize,
    /// Seed of the prompts and of the re-implementation's tie-break.
    pub seed: u64,
}

/// The agreement figures.
#[derive(Debug, Clone, Serialize)]
pub struct AgreementReport {
    /// The peer measured.
    pub peer: String,
    /// Mock workers in the pool.
    pub workers: usize,
    /// Decisions compared.
    pub decisions: usize,
    /// Decisions where the peer's worker is among the re-implementation's best.
    pub agreed: usize,
    /// Decisions where the re-implementation had one best worker.
    pub determined: usize,
    /// Of those, the ones where the peer chose that worker.
    pub determined_agreed: usize,
    /// Disagreements by prompt length: (blocks up to which, disagreements, decisions).
    pub by_length: Vec<(usize, usize, usize)>,
}

impl AgreementReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        let pct = |a: usize, b: usize| format!("{:.1} %", 100.0 * a as f64 / b.max(1) as f64);
        let mut md = table_of(
            &[
                "peer",
                "workers",
                "decisions",
                "agree",
                "one best worker",
                "agree there",
            ],
            &[self],
            |r| {
                vec![
                    r.peer.clone(),
                    r.workers.to_string(),
                    r.decisions.to_string(),
                    pct(r.agreed, r.decisions),
                    r.determined.to_string(),
                    pct(r.determined_agreed, r.determined),
                ]
            },
        );
        md.push_str("\n\n");
        md.push_str(&table_of(
            &["prompt blocks up to", "decisions", "disagreements"],
            &self.by_length,
            |(upto, bad, all)| vec![upto.to_string(), all.to_string(), bad.to_string()],
        ));
        md
    }
}

/// The 64 characters of block `id`.
fn block_text(id: u64) -> String {
    let mut g = SplitMix64::new(id);
    (0..BLOCK_CHARS / 16)
        .map(|_| format!("{:016x}", g.next_u64()))
        .collect()
}

/// A `/v1/completions` body whose prompt is the blocks of `request`.
fn completions_body(request: &TraceRequest) -> Vec<u8> {
    let prompt: String = request.hash_ids.iter().map(|&b| block_text(b)).collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "llama", "prompt": prompt, "max_tokens": 1, "stream": false
    }))
    .expect("a JSON value serialises")
}

/// The requests: a prefix of one of `cfg.groups` shared prompts, then fresh blocks.
pub fn requests(cfg: &AgreementConfig) -> Vec<TraceRequest> {
    let mut g = SplitMix64::new(cfg.seed);
    let mut next_id = 1u64;
    let mut fresh = |n: usize| -> Vec<u64> {
        let ids = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        ids
    };
    let groups: Vec<Vec<u64>> = (0..cfg.groups.max(1))
        .map(|_| fresh(8 + g.below((MAX_BLOCKS - 40) as u64) as usize))
        .collect();
    (0..cfg.requests)
        .map(|_| {
            let base = &groups[g.below(groups.len() as u64) as usize];
            let keep = g.below(base.len() as u64 + 1) as usize;
            let mut hash_ids = base[..keep].to_vec();
            hash_ids.extend(fresh(1 + g.below(32) as usize));
            TraceRequest {
                timestamp: 0,
                input_length: hash_ids.len() * BLOCK_TOKENS,
                output_length: 1,
                hash_ids,
            }
        })
        .collect()
}

/// Runs the requests through the peer at `exe` and the re-implementation.
pub async fn run(exe: &std::path::Path, cfg: &AgreementConfig) -> anyhow::Result<AgreementReport> {
    let fleet = Fleet::start(cfg.workers, "llama").await?;
    let addrs = fleet.addrs();
    let index: HashMap<SocketAddr, usize> =
        addrs.iter().enumerate().map(|(i, a)| (*a, i)).collect();
    let peer = PeerEpp::start(exe, &addrs, fleet.port()).await?;
    let ch = connect(peer.process.port).await?;
    let replay_cfg = ReplayConfig {
        workers: cfg.workers,
        capacity_blocks: WORKER_BLOCKS,
        block_tokens: BLOCK_TOKENS,
        seed: cfg.seed,
        ..ReplayConfig::default()
    };
    let mut reimpl = LlmD::new(&replay_cfg);
    let idle = vec![
        WorkerView {
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            capacity_blocks: WORKER_BLOCKS,
        };
        cfg.workers
    ];
    let bands = [64, 128, 256, 400, MAX_BLOCKS];
    let mut by_length: Vec<(usize, usize, usize)> = bands.iter().map(|&b| (b, 0, 0)).collect();
    let (mut agreed, mut determined, mut determined_agreed) = (0, 0, 0);
    let reqs = requests(cfg);
    for request in &reqs {
        let (_, destination) =
            routed_request_to(&ch, "/v1/completions", &completions_body(request)).await?;
        let destination: SocketAddr = destination
            .context("the peer named no destination")?
            .parse()
            .context("the peer's destination is not ip:port")?;
        let Some(&chosen) = index.get(&destination) else {
            bail!("the peer routed to {destination}, not a pool worker");
        };
        let best = reimpl.best(request, &idle);
        let agrees = best.contains(&chosen);
        agreed += usize::from(agrees);
        if best.len() == 1 {
            determined += 1;
            determined_agreed += usize::from(agrees);
        }
        let band = by_length
            .iter_mut()
            .find(|(upto, _, _)| request.hash_ids.len() <= *upto)
            .expect("prompts are at most MAX_BLOCKS blocks");
        band.1 += usize::from(!agrees);
        band.2 += 1;
        reimpl.place(chosen, request);
    }
    peer.process.stop().await?;
    Ok(AgreementReport {
        peer: PINNED.into(),
        workers: cfg.workers,
        decisions: reqs.len(),
        agreed,
        determined,
        determined_agreed,
        by_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_the_peers_block_size_and_distinct() {
        assert_eq!(block_text(7).len(), BLOCK_CHARS);
        assert_ne!(block_text(7), block_text(8));
    }

    #[test]
    fn requests_share_group_prefixes_and_stay_in_bounds() {
        let cfg = AgreementConfig {
            workers: 4,
            requests: 200,
            groups: 3,
            seed: 1,
        };
        let reqs = requests(&cfg);
        assert_eq!(reqs.len(), 200);
        assert!(reqs
            .iter()
            .all(|r| !r.hash_ids.is_empty() && r.hash_ids.len() <= MAX_BLOCKS));
        let shared = reqs
            .iter()
            .filter(|r| {
                reqs.iter()
                    .any(|o| !std::ptr::eq(o, *r) && o.hash_ids[0] == r.hash_ids[0])
            })
            .count();
        assert!(shared > 100, "{shared}");
        let body = completions_body(&reqs[0]);
        let parsed =
            kvpick::request::parse(&body, Some(kvpick::request::ApiKind::Completions)).unwrap();
        assert_eq!(parsed.model, "llama");
    }
}
