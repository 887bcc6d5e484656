//! One KV-event publisher flooding the `kvpick` binary: the event ingest's memory
//! bound, as a rerunnable measurement.
//!
//! Each run starts the binary in standalone mode over two workers whose
//! engines publish vLLM KV events over ZMQ on loopback. One publisher sends
//! valid `BlockStored` batches of `blocks` new blocks (30,000 by default, about
//! 2 MiB each) as fast as ZMQ takes them, for `seconds`; meanwhile the other
//! sends a one-block batch every 200 ms and the time until kvpick's
//! `kvpick_kv_events_ingested` counter of that worker moves is measured (read
//! from `/metrics`, so it includes one scrape). The binary's resident set is
//! sampled from `/proc/<pid>/status` throughout and for `settle` seconds after
//! the flood stops. A run passes when the peak (VmHWM) stays under the ingest
//! queue's byte budget (`--kv-events-max-queued-bytes`) plus 100 MiB, and
//! every probe of the other worker took effect within 1 s.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use crate::kv_events::{encode_batch, now_ts, KvEvent, Medium};

/// RSS allowed above the byte budget.
pub const RSS_SLACK_BYTES: u64 = 100 << 20;
/// Longest a probe of the other worker may take.
pub const PROBE_BOUND: Duration = Duration::from_secs(1);

/// What to run.
#[derive(Debug, Clone)]
pub struct FloodConfig {
    /// The `kvpick` binary.
    pub kvpick: PathBuf,
    /// Runs, each a fresh process.
    pub runs: usize,
    /// Blocks per flooding batch (16 tokens each).
    pub blocks: usize,
    /// Seconds of flood per run.
    pub seconds: f64,
    /// Seconds sampled after the flood stops.
    pub settle: f64,
    /// `--kv-events-max-queued-bytes` given to kvpick.
    pub max_queued_bytes: u64,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct FloodRun {
    /// VmRSS after start-up and the first events, before the flood (MiB).
    pub baseline_rss_mib: f64,
    /// VmHWM at the end (MiB).
    pub peak_rss_mib: f64,
    /// VmRSS at the end of the settle time (MiB).
    pub settled_rss_mib: f64,
    /// Flooding batches handed to the PUB socket (it drops what the
    /// subscriber's queue cannot take, as an engine's PUB does).
    pub batches: u64,
    /// `kvpick_kv_events_ingested` of the flooding worker at the end: what
    /// reached kvpick's ingest (ZMQ delivered and decoded).
    pub flooder_ingested: f64,
    /// Probes of the other worker.
    pub probes: usize,
    /// Slowest probe (ms).
    pub slowest_probe_ms: f64,
    /// Peak under budget + slack and every probe within the bound.
    pub pass: bool,
}

/// Every run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct FloodReport {
    /// One flooding batch (MiB).
    pub batch_mib: f64,
    /// The byte budget (MiB).
    pub budget_mib: f64,
    /// Blocks per flooding batch.
    pub blocks: usize,
    /// Seconds of flood per run.
    pub seconds: f64,
    /// The runs, in order.
    pub runs: Vec<FloodRun>,
}

impl FloodReport {
    /// A Markdown table, one row a run, and a summary line.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "Flood: {} blocks a batch ({:.2} MiB), {:.0} s a run, budget {:.0} MiB (pass: peak < budget + 100 MiB, other worker within 1 s)\n\n\
             | run | baseline RSS MiB | peak RSS MiB | settled RSS MiB | batches sent | flooder events ingested | probes | slowest probe ms | pass |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            self.blocks, self.batch_mib, self.seconds, self.budget_mib
        );
        for (i, r) in self.runs.iter().enumerate() {
            out += &format!(
                "| {} | {:.1} | {:.1} | {:.1} | {} | {:.0} | {} | {:.1} | {} |\n",
                i + 1,
                r.baseline_rss_mib,
                r.peak_rss_mib,
                r.settled_rss_mib,
                r.batches,
                r.flooder_ingested,
                r.probes,
                r.slowest_probe_ms,
                if r.pass { "yes" } else { "NO" }
            );
        }
        let max = |f: fn(&FloodRun) -> f64| self.runs.iter().map(f).fold(0.0, f64::max);
        out += &format!(
            "\n{} of {} runs pass; worst peak {:.1} MiB, worst probe {:.1} ms\n",
            self.runs.iter().filter(|r| r.pass).count(),
            self.runs.len(),
            max(|r| r.peak_rss_mib),
            max(|r| r.slowest_probe_ms),
        );
        out
    }
}

const MODEL: &str = "flood-model";
const FLOODER: u64 = 7001;
const OTHER: u64 = 7002;

/// Runs the flood `cfg.runs` times.
pub async fn run(cfg: &FloodConfig) -> anyhow::Result<FloodReport> {
    let batch = Bytes::from(flood_batch(cfg.blocks));
    let mut runs = Vec::new();
    for i in 0..cfg.runs {
        let r = one_run(cfg, batch.clone())
            .await
            .with_context(|| format!("run {}", i + 1))?;
        eprintln!("run {}: {r:?}", i + 1);
        runs.push(r);
    }
    Ok(FloodReport {
        batch_mib: mib(batch.len() as u64),
        budget_mib: mib(cfg.max_queued_bytes),
        blocks: cfg.blocks,
        seconds: cfg.seconds,
        runs,
    })
}

/// A vLLM batch storing `blocks` new blocks of 16 tokens in one chain.
fn flood_batch(blocks: usize) -> Vec<u8> {
    let event = KvEvent::BlockStored {
        block_hashes: (1..=blocks as u64).collect(),
        parent_block_hash: None,
        token_ids: (0..blocks as u32 * 16).map(|t| t % 32_000).collect(),
        block_size: 16,
        medium: Medium::Gpu,
    };
    encode_batch(now_ts(), &[event], Some(0))
}

/// One probe batch of the other worker: block `n`, a fresh chain.
fn probe_batch(n: u64) -> Vec<u8> {
    let event = KvEvent::BlockStored {
        block_hashes: vec![1_000_000 + n],
        parent_block_hash: None,
        token_ids: (0..16).map(|t| (n as u32 * 16 + t) % 32_000).collect(),
        block_size: 16,
        medium: Medium::Gpu,
    };
    encode_batch(now_ts(), &[event], Some(0))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

async fn bind() -> anyhow::Result<(PubSocket, u16)> {
    let mut s = PubSocket::new();
    match s.bind("tcp://127.0.0.1:0").await? {
        zeromq::Endpoint::Tcp(_, port) => Ok((s, port)),
        other => anyhow::bail!("unexpected endpoint {other}"),
    }
}

fn message(seq: u64, payload: Bytes) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ])
    .expect("three frames")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `(VmRSS, VmHWM)` of `pid` in bytes.
fn rss(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Ok((
        field("VmRSS:").context("no VmRSS")?,
        field("VmHWM:").context("no VmHWM")?,
    ))
}

/// `kvpick_kv_events_ingested` of `instance` on kvpick's `/metrics`.
async fn ingested(metrics_port: u16, instance: u64) -> anyhow::Result<f64> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", metrics_port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut page = String::new();
    s.read_to_string(&mut page).await?;
    let label = format!("instance_id=\"{instance}\"");
    Ok(page
        .lines()
        .filter(|l| l.starts_with("kvpick_kv_events_ingested") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn one_run(cfg: &FloodConfig, batch: Bytes) -> anyhow::Result<FloodRun> {
    let (mut flood, flood_port) = bind().await?;
    let (mut other, other_port) = bind().await?;
    let dir = std::env::temp_dir().join(format!("kvpick-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(
        &endpoints,
        format!(
            "endpoints:\n  - address: 127.0.0.1:18301\n    instance_id: {FLOODER}\n    kv_events_port: {flood_port}\n  \
             - address: 127.0.0.1:18302\n    instance_id: {OTHER}\n    kv_events_port: {other_port}\n"
        ),
    )?;
    let metrics_port = free_port()?;
    let mut child = Command::new(&cfg.kvpick)
        .arg("--endpoints-file")
        .arg(&endpoints)
        .args(["--bind-address", "127.0.0.1"])
        .args(["--grpc-port", &free_port()?.to_string()])
        .args(["--grpc-health-port", &free_port()?.to_string()])
        .args(["--metrics-port", &metrics_port.to_string()])
        .args(["--kv-events-model", MODEL])
        .args([
            "--kv-events-max-queued-bytes",
            &cfg.max_queued_bytes.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", cfg.kvpick.display()))?;
    let pid = child.id().context("kvpick exited")?;

    // Both streams live: the other worker's first batch counted, the flooder's
    // subscription in place (a PUB drops what it sends before that).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seq_other = 0u64;
    loop {
        anyhow::ensure!(Instant::now() < deadline, "kvpick never ingested events");
        other
            .send(message(seq_other, Bytes::from(probe_batch(seq_other))))
            .await?;
        flood
            .send(message(0, Bytes::from(probe_batch(999_999))))
            .await?;
        seq_other += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (a, b) = (
            ingested(metrics_port, OTHER).await.unwrap_or(0.0),
            ingested(metrics_port, FLOODER).await.unwrap_or(0.0),
        );
        if a > 0.0 && b > 0.0 {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (baseline, _) = rss(pid)?;

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooding = {
        let (stop, sent) = (Arc::clone(&stop), Arc::clone(&sent));
        tokio::spawn(async move {
            let mut seq = 1u64;
            while !stop.load(Ordering::Relaxed) {
                if flood.send(message(seq, batch.clone())).await.is_err() {
                    break;
                }
                seq += 1;
                sent.fetch_add(1, Ordering::Relaxed);
                // The PUB writes each message in one poll of the peer's sink
                // and drops it when the socket cannot take it whole: yield so
                // the socket drains between sends (as a busy engine's does).
                tokio::task::yield_now().await;
            }
        })
    };
    let flood_until = Instant::now() + Duration::from_secs_f64(cfg.seconds);
    let (mut probes, mut slowest) = (0usize, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(300)).await;
    while Instant::now() < flood_until {
        let before = ingested(metrics_port, OTHER).await?;
        let at = Instant::now();
        other
            .send(message(seq_other, Bytes::from(probe_batch(seq_other))))
            .await?;
        seq_other += 1;
        loop {
            if ingested(metrics_port, OTHER).await? > before {
                break;
            }
            if at.elapsed() > Duration::from_secs(5) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        slowest = slowest.max(at.elapsed());
        probes += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    flooding.await?;
    // RSS after the sender stopped: it must not keep growing.
    tokio::time::sleep(Duration::from_secs_f64(cfg.settle)).await;
    let (settled, peak) = rss(pid)?;
    let flooder_ingested = ingested(metrics_port, FLOODER).await?;
    child.kill().await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(FloodRun {
        baseline_rss_mib: mib(baseline),
        peak_rss_mib: mib(peak),
        settled_rss_mib: mib(settled),
        batches: sent.load(Ordering::Relaxed),
        flooder_ingested,
        probes,
        slowest_probe_ms: slowest.as_secs_f64() * 1e3,
        pass: peak < cfg.max_queued_bytes + RSS_SLACK_BYTES && slowest <= PROBE_BOUND,
    })
}
