//! `kvpick-bench instructions`: instructions an ext_proc server executes per
//! request, counted by valgrind, for changes smaller than timing noise.
//!
//! On a shared two-core machine one binary's throughput and CPU time per request
//! move by ±20 % between runs of `overhead`, so a 3 % difference between two
//! builds cannot be read from them. An instruction count does not depend on what
//! else runs on the machine: each server runs under `valgrind --tool=cachegrind
//! --cache-sim=no` (instruction counting only) and is driven with one request at
//! a time, as `overhead` builds them (the same chat bodies, an Envoy-style
//! FULL_DUPLEX_STREAMED stream each).
//!
//! Each (server binary, server kind, body size, endpoint count) is run twice, with
//! `n` and with `4n` requests; the difference of the two totals over `3n` is the
//! count per request, without start-up (runtime, endpoint table) and shutdown.
//! The no-op server is counted the same way per body size; kvpick's own work is
//! kvpick's count minus the no-op's. `--rounds N` takes every count N times and
//! reports the median. Every binary named with `--against` (an
//! older `kvpick-bench` with the same `overhead-server` interface) runs in the
//! same invocation, so a change reads as a ratio to a baseline from the same run;
//! so does this binary's kvpick under each `--scoring` listed (the predicted
//! mode's count includes the latency models' update on each response).
//! Background work that runs on a timer (none on the request path) would show as
//! a small difference between the two runs' wall times. Valgrind serialises the
//! server's threads anyway, so the server runs one tokio worker
//! (`TOKIO_WORKER_THREADS=1`): with two, how often tasks are stolen and woken
//! across threads moved a 1 KiB cell's count by up to 1.5 % between three runs
//! of the same binary; with one, by up to 0.6 %. Its tie-break is seeded
//! (`KVPICK_BENCH_TIE_BREAK_SEED=1`): with a random one each run spreads the
//! bodies over other endpoints, and the prefix index it grows moved a 32 KiB
//! cell's count by up to 10 %.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::process::Command;

use kvpick::scheduler::ScoringMode;

use super::overhead::{
    chat_body, connect, one_request, variants, ServerKind, ServerProcess, Tracing,
    TIE_BREAK_SEED_ENV,
};
use super::{ratio, table_of};

/// Settings of one `instructions` run.
#[derive(Debug, Clone)]
pub struct InstructionsConfig {
    /// Chat body sizes in bytes.
    pub body_bytes: Vec<usize>,
    /// Endpoint counts.
    pub endpoints: Vec<usize>,
    /// The servers of the cells; the first is the one the ratios are of,
    /// each other one a baseline.
    pub servers: Vec<Server>,
    /// Body bytes the longer run of a cell sends in all (its request count is
    /// this over the body size, within `MIN_REQUESTS..=MAX_REQUESTS`).
    pub bytes_per_run: usize,
    /// Where the counts' cachegrind files go.
    pub work_dir: PathBuf,
    /// Times each count is taken; the report has their median.
    pub rounds: usize,
}

/// One kvpick server counted in every cell.
#[derive(Debug, Clone)]
pub struct Server {
    /// Its name in the report.
    pub name: String,
    /// The `kvpick-bench` binary serving it (and its no-op server).
    pub exe: PathBuf,
    /// kvpick's `--scoring`.
    pub scoring: ScoringMode,
}

/// Fewest requests of the shorter run of a cell.
const MIN_REQUESTS: usize = 2;
/// Most requests of the longer run of a cell.
const MAX_REQUESTS: usize = 400;

/// One server binary's counts in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct BinaryCounts {
    /// The server's name.
    pub server: String,
    /// kvpick's instructions per request.
    pub kvpick: f64,
    /// The no-op server's instructions per request.
    pub noop: f64,
    /// kvpick's own work: `kvpick - noop`.
    pub own: f64,
}

/// One (body size, endpoint count) cell.
#[derive(Debug, Clone, Serialize)]
pub struct InstructionsCell {
    /// Request body size in bytes.
    pub body_bytes: usize,
    /// Endpoints in the pool.
    pub endpoints: usize,
    /// Requests of the shorter and the longer run.
    pub requests: [usize; 2],
    /// One entry per server, in [`InstructionsConfig::servers`] order.
    pub binaries: Vec<BinaryCounts>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct InstructionsReport {
    /// Times each count was taken (the report has their median).
    pub rounds: usize,
    /// One entry per cell.
    pub cells: Vec<InstructionsCell>,
}

impl InstructionsReport {
    /// One row per (cell, baseline): the measured binary's counts beside the
    /// baseline's and their ratios.
    pub fn markdown(&self) -> String {
        // A cell without a baseline is compared with itself (ratios 1).
        let rows: Vec<(&InstructionsCell, &BinaryCounts)> = self
            .cells
            .iter()
            .flat_map(|c| {
                let skip = usize::from(c.binaries.len() > 1);
                c.binaries.iter().skip(skip).map(move |b| (c, b))
            })
            .collect();
        table_of(
            &[
                "body bytes",
                "endpoints",
                "baseline",
                "kvpick instr/req",
                "baseline kvpick instr/req",
                "ratio",
                "kvpick's own work",
                "baseline's own work",
                "own-work ratio",
                "no-op instr/req",
            ],
            &rows,
            |(c, base)| {
                let head = &c.binaries[0];
                vec![
                    c.body_bytes.to_string(),
                    c.endpoints.to_string(),
                    base.server.clone(),
                    format!("{:.0}", head.kvpick),
                    format!("{:.0}", base.kvpick),
                    format!("{:.4}", ratio(head.kvpick, base.kvpick)),
                    format!("{:.0}", head.own),
                    format!("{:.0}", base.own),
                    format!("{:.4}", ratio(head.own, base.own)),
                    format!("{:.0}", head.noop),
                ]
            },
        )
    }
}

/// Request counts of a cell's two runs for bodies of `bytes`.
pub fn request_counts(bytes: usize, bytes_per_run: usize) -> [usize; 2] {
    let long = (bytes_per_run / bytes.max(1)).clamp(4 * MIN_REQUESTS, MAX_REQUESTS);
    [long / 4, long / 4 * 4]
}

/// The `summary:` total of a cachegrind output file (instructions executed,
/// with `--cache-sim=no`).
pub fn cachegrind_total(text: &str) -> anyhow::Result<u64> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("summary:"))
        .context("no summary line in the cachegrind output")?;
    let first = line.split_whitespace().next().context("empty summary")?;
    Ok(first.parse()?)
}

/// Counts the instructions `exe overhead-server <kind>` executes to serve
/// `requests` of `bodies` (one at a time), start-up and shutdown included.
async fn count(
    exe: &Path,
    kind: ServerKind,
    bodies: &[Vec<u8>],
    requests: usize,
    out: &Path,
) -> anyhow::Result<u64> {
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=cachegrind")
        .arg("--cache-sim=no")
        .arg("--quiet")
        .arg(format!("--cachegrind-out-file={}", out.display()))
        .env("TOKIO_WORKER_THREADS", "1")
        .env(TIE_BREAK_SEED_ENV, "1")
        .arg(exe)
        .arg("overhead-server")
        .args(kind.args());
    let server = ServerProcess::spawn(command).await?;
    let ch = connect(server.port).await?;
    for i in 0..requests {
        one_request(&ch, &bodies[i % bodies.len()]).await?;
    }
    drop(ch);
    server.stop().await?;
    let text =
        std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    cachegrind_total(&text)
}

/// Instructions per request of `exe` serving `kind`: the difference of a short
/// and a long run over their difference in requests.
async fn per_request(
    exe: &Path,
    kind: ServerKind,
    bodies: &[Vec<u8>],
    requests: [usize; 2],
    out: &Path,
) -> anyhow::Result<f64> {
    let short = count(exe, kind, bodies, requests[0], out).await?;
    let long = count(exe, kind, bodies, requests[1], out).await?;
    if long <= short {
        bail!("{requests:?} requests counted {short} then {long} instructions: not increasing");
    }
    Ok((long - short) as f64 / (requests[1] - requests[0]) as f64)
}

/// The median of `rounds` counts of [`per_request`].
async fn median_per_request(
    exe: &Path,
    kind: ServerKind,
    bodies: &[Vec<u8>],
    requests: [usize; 2],
    out: &Path,
    rounds: usize,
) -> anyhow::Result<f64> {
    let mut counts = Vec::with_capacity(rounds.max(1));
    for _ in 0..rounds.max(1) {
        counts.push(per_request(exe, kind, bodies, requests, out).await?);
    }
    Ok(median(&mut counts))
}

/// The median of `xs` (the mean of the middle two for an even count).
fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[mid]
    } else {
        (xs[mid - 1] + xs[mid]) / 2.0
    }
}

/// Runs every cell on every binary.
pub async fn run(cfg: &InstructionsConfig) -> anyhow::Result<InstructionsReport> {
    std::fs::create_dir_all(&cfg.work_dir)?;
    let out = cfg.work_dir.join("cachegrind.out");
    let mut cells = Vec::new();
    for &bytes in &cfg.body_bytes {
        let bodies: Vec<Vec<u8>> = (0..variants(bytes)).map(|v| chat_body(bytes, v)).collect();
        let requests = request_counts(bytes, cfg.bytes_per_run);
        // The no-op server once per binary.
        let mut noop: Vec<(&Path, f64)> = Vec::new();
        for server in &cfg.servers {
            if noop.iter().all(|(exe, _)| *exe != server.exe) {
                let kind = ServerKind::Noop;
                let count =
                    median_per_request(&server.exe, kind, &bodies, requests, &out, cfg.rounds)
                        .await?;
                noop.push((&server.exe, count));
            }
        }
        for &n in &cfg.endpoints {
            let mut binaries = Vec::new();
            for server in &cfg.servers {
                let noop = noop
                    .iter()
                    .find_map(|(exe, count)| (*exe == server.exe).then_some(*count))
                    .context("every binary's no-op server is counted")?;
                let kind = ServerKind::Kvpick {
                    endpoints: n,
                    tracing: Tracing::Off,
                    workers_port: None,
                    scoring: server.scoring,
                };
                let kvpick =
                    median_per_request(&server.exe, kind, &bodies, requests, &out, cfg.rounds)
                        .await?;
                binaries.push(BinaryCounts {
                    server: server.name.clone(),
                    kvpick,
                    noop,
                    own: kvpick - noop,
                });
            }
            eprintln!(
                "instructions: {bytes} B, {n} endpoints: {}",
                binaries
                    .iter()
                    .map(|b| format!("{} {:.0}/req", b.server, b.kvpick))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            cells.push(InstructionsCell {
                body_bytes: bodies[0].len(),
                endpoints: n,
                requests,
                binaries,
            });
        }
    }
    Ok(InstructionsReport {
        rounds: cfg.rounds.max(1),
        cells,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_is_the_total() {
        let text = "desc: --cache-sim=no\ncmd: x\nevents: Ir\nfl=a\n1 5\nsummary: 123456789\n";
        assert_eq!(cachegrind_total(text).unwrap(), 123_456_789);
        assert!(cachegrind_total("events: Ir\n").is_err());
    }

    #[test]
    fn the_median_is_the_middle_count() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut [7.0]), 7.0);
    }

    #[test]
    fn the_long_run_is_four_times_the_short_one_within_bounds() {
        assert_eq!(request_counts(1024, 64 << 20), [100, 400]);
        assert_eq!(request_counts(8 << 20, 64 << 20), [2, 8]);
        let [short, long] = request_counts(1 << 20, 64 << 20);
        assert_eq!((short, long), (16, 64));
    }
}
