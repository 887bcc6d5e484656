//! `kvpick-bench sync`: replica sync against a real `redis-server`, measured.
//!
//! R replicas run in this process, each a real [`Scheduler`] over its own
//! [`EndpointTable`] of the same `workers` workers, each with the replica-sync
//! tasks the binary runs ([`ReplicaSync::start`]: publisher, reporter,
//! subscriber over one Redis stream). A driver makes decisions at a target
//! total rate, decision `i` on replica `i mod R` (pick, book, prefill done and
//! finish once `in_flight` later decisions were made), and rounds alternate:
//!
//! - **baseline**: the same decisions on replicas without sync;
//! - **sync**: fresh replicas with sync on (a new stream per round, warm start
//!   over before the clock starts).
//!
//! Measured per sync round: publish-to-apply latency at every peer (one
//! sample per batch applied live, from the sender's timestamp in the batch to
//! the peer applying it, both by the wall clock of this one process), wire
//! bytes and deltas per decision (the publishers' counters), and CPU per
//! decision from `getrusage` of this process (the sync work is the sync
//! rounds' CPU minus the baseline rounds') and from `/proc/PID/stat` of the
//! server when this process started it. The latency excludes a delta's wait in
//! the publisher's queue before its batch is encoded.
//!
//! Invariant: a sample only exists when a peer applied a batch it read from the
//! server, so a server that is down yields no samples and zero applied deltas.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::{Endpoint, EndpointTable, InFlightGuard, Snapshot};
use kvpick::replica_sync::{ReplicaSync, SyncConfig, SyncMetrics};
use kvpick::request::InferenceRequest;
use kvpick::scheduler::{Decision, PickRequest, Scheduler, SchedulerConfig};
use kvpick::telemetry::Metrics;
use serde::Serialize;

use super::{completion_of_tokens, markdown_table, quantile, sorted, SplitMix64};
use crate::replicas::RedisServer;

const MODEL: &str = "sync-bench";
/// Tokens of the system prompt every conversation shares.
const SHARED_TOKENS: usize = 512;
/// Distinct prompts the driver cycles through (conversations).
const PROMPTS: usize = 1_024;
/// Most propagation samples kept per replica and round.
const SAMPLES_CAP: usize = 1_000_000;

/// Settings of a sync run.
#[derive(Debug, Clone)]
pub struct SyncBenchConfig {
    /// The server; `None` starts `redis-server` on a free loopback port.
    pub redis: Option<String>,
    /// Replicas.
    pub replicas: usize,
    /// Workers every replica routes over.
    pub workers: usize,
    /// Target decisions per second, all replicas together.
    pub rate: f64,
    /// Length of one round.
    pub round: Duration,
    /// Rounds of each kind (baseline and sync alternate).
    pub rounds: usize,
    /// Tokens of each prompt.
    pub prompt_tokens: usize,
    /// Requests in flight across the replicas (finished oldest first).
    pub in_flight: usize,
    /// Bound of each replica's warm start (the server may be down).
    pub warm_start_timeout: Duration,
}

impl Default for SyncBenchConfig {
    fn default() -> Self {
        SyncBenchConfig {
            redis: None,
            replicas: 3,
            workers: 1_024,
            rate: 5_000.0,
            round: Duration::from_secs(5),
            rounds: 3,
            prompt_tokens: 2_048,
            in_flight: 256,
            warm_start_timeout: Duration::from_secs(2),
        }
    }
}

/// One round.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// `baseline` or `sync`.
    pub kind: &'static str,
    /// Decisions made.
    pub decisions: u64,
    /// Decisions per second reached.
    pub rate: f64,
    /// CPU of this process (user + system) during the round, per decision, µs.
    pub cpu_us_per_decision: f64,
    /// CPU of the server during the round, per decision, µs (when measured).
    pub server_cpu_us_per_decision: Option<f64>,
    /// Deltas published by all replicas.
    pub published_deltas: u64,
    /// Bytes of the published batches.
    pub published_bytes: u64,
    /// Deltas applied at peers.
    pub applied_deltas: u64,
    /// Deltas dropped.
    pub dropped_deltas: u64,
    /// Failed commands.
    pub errors: u64,
    /// Propagation samples (batches applied live at peers).
    pub samples: usize,
    /// Propagation p50, ms.
    pub propagation_p50_ms: f64,
    /// Propagation p99, ms.
    pub propagation_p99_ms: f64,
    /// Propagation maximum, ms.
    pub propagation_max_ms: f64,
}

/// The sync report.
#[derive(Debug, Clone, Serialize)]
pub struct SyncReport {
    /// Replicas.
    pub replicas: usize,
    /// Workers.
    pub workers: usize,
    /// Tokens of each prompt.
    pub prompt_tokens: usize,
    /// Target decisions per second.
    pub target_rate: f64,
    /// Whether this process started the server (its CPU is then measured).
    pub own_server: bool,
    /// Every round, in the order run.
    pub rounds: Vec<Round>,
    /// Decisions per second reached in the sync rounds.
    pub sync_rate: f64,
    /// Propagation p50 over all sync rounds' samples, ms.
    pub propagation_p50_ms: f64,
    /// Propagation p99 over all sync rounds' samples, ms.
    pub propagation_p99_ms: f64,
    /// Propagation samples over all sync rounds.
    pub samples: usize,
    /// Deltas applied at peers over all sync rounds.
    pub applied_deltas: u64,
    /// Wire bytes published per decision (batch payloads).
    pub bytes_per_decision: f64,
    /// Deltas published per decision.
    pub deltas_per_decision: f64,
    /// This process's CPU per decision: sync rounds, baseline rounds, µs.
    pub cpu_us_per_decision_sync: f64,
    /// See `cpu_us_per_decision_sync`.
    pub cpu_us_per_decision_baseline: f64,
    /// The server's CPU per decision in the sync rounds, µs.
    pub server_cpu_us_per_decision: Option<f64>,
}

impl SyncReport {
    /// The sync work's CPU per decision in this process: sync minus baseline.
    pub fn sync_cpu_us_per_decision(&self) -> f64 {
        self.cpu_us_per_decision_sync - self.cpu_us_per_decision_baseline
    }

    /// The report as Markdown: a summary and one row per round.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "{} replicas × {} workers, {}-token prompts, target {:.0} decisions/s (reached {:.0}/s with sync)\n\n\
             propagation p50 {:.3} ms, p99 {:.3} ms ({} batches, {} deltas applied at peers); \
             {:.0} B and {:.2} deltas published per decision; CPU per decision {:.1} µs with sync, \
             {:.1} µs without (sync work {:.1} µs){}\n\n",
            self.replicas,
            self.workers,
            self.prompt_tokens,
            self.target_rate,
            self.sync_rate,
            self.propagation_p50_ms,
            self.propagation_p99_ms,
            self.samples,
            self.applied_deltas,
            self.bytes_per_decision,
            self.deltas_per_decision,
            self.cpu_us_per_decision_sync,
            self.cpu_us_per_decision_baseline,
            self.sync_cpu_us_per_decision(),
            match self.server_cpu_us_per_decision {
                Some(s) => format!(", redis-server {s:.1} µs"),
                None => String::new(),
            }
        );
        let rows: Vec<Vec<String>> = self
            .rounds
            .iter()
            .map(|r| {
                vec![
                    r.kind.to_string(),
                    r.decisions.to_string(),
                    format!("{:.0}", r.rate),
                    format!("{:.1}", r.cpu_us_per_decision),
                    r.server_cpu_us_per_decision
                        .map_or("-".into(), |s| format!("{s:.1}")),
                    match r.decisions {
                        0 => "-".into(),
                        n => format!("{:.0}", r.published_bytes as f64 / n as f64),
                    },
                    r.applied_deltas.to_string(),
                    r.samples.to_string(),
                    format!("{:.3}", r.propagation_p50_ms),
                    format!("{:.3}", r.propagation_p99_ms),
                    format!("{:.3}", r.propagation_max_ms),
                ]
            })
            .collect();
        out.push_str(&markdown_table(
            &[
                "round",
                "decisions",
                "rate /s",
                "CPU µs/decision",
                "server CPU µs/decision",
                "bytes/decision",
                "applied deltas",
                "samples",
                "p50 ms",
                "p99 ms",
                "max ms",
            ],
            &rows,
        ));
        out
    }
}

/// One replica: a scheduler over its own table, with sync when on.
struct Replica {
    scheduler: Arc<Scheduler>,
    snapshot: Arc<Snapshot>,
    table: Arc<EndpointTable>,
    sync: Option<ReplicaSync>,
}

impl Replica {
    fn new(workers: usize, seed: u64) -> Replica {
        let scheduler = Arc::new(Scheduler::new(SchedulerConfig {
            tie_break_seed: Some(seed),
            ..SchedulerConfig::default()
        }));
        let table = Arc::new(EndpointTable::new());
        table.replace(
            (0..workers)
                .map(|i| {
                    let addr = format!("10.2.{}.{}:8000", i / 250, i % 250 + 1);
                    Endpoint::new(addr.parse().expect("a valid socket address"))
                })
                .collect(),
        );
        Replica {
            scheduler,
            snapshot: table.snapshot(),
            table,
            sync: None,
        }
    }
}

/// Prompts sharing a system prompt, one per conversation.
fn prompts(tokens: usize) -> Vec<InferenceRequest> {
    let mut rng = SplitMix64::new(30);
    let shared: Vec<u32> = (0..SHARED_TOKENS.min(tokens))
        .map(|_| rng.below(50_000) as u32)
        .collect();
    (0..PROMPTS)
        .map(|_| {
            let mut t = shared.clone();
            t.extend((t.len()..tokens).map(|_| rng.below(50_000) as u32));
            completion_of_tokens(MODEL, t)
        })
        .collect()
}

/// User plus system CPU of this process so far.
fn process_cpu() -> Duration {
    // SAFETY: getrusage only writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1_000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// User plus system CPU of process `pid` (from `/proc`), if readable.
fn pid_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

/// Drives decisions over `replicas` at `cfg.rate` for `cfg.round`; returns
/// the decisions made and the time taken.
async fn drive(
    replicas: &[Replica],
    bodies: &[InferenceRequest],
    cfg: &SyncBenchConfig,
) -> (u64, Duration) {
    let mut open: VecDeque<(usize, Decision, InFlightGuard)> = VecDeque::new();
    let started = Instant::now();
    let mut made: u64 = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while started.elapsed() < cfg.round {
        tick.tick().await;
        let due = (started.elapsed().as_secs_f64() * cfg.rate) as u64;
        while made < due {
            let r = (made % replicas.len() as u64) as usize;
            let replica = &replicas[r];
            let body = &bodies[(made % bodies.len() as u64) as usize];
            let req = PickRequest {
                body: Some(body),
                ..Default::default()
            };
            let now = Instant::now();
            let d = replica
                .scheduler
                .pick_at(&req, &replica.snapshot, now)
                .expect("the pool is never empty");
            let guard = d.begin();
            open.push_back((r, d, guard));
            if open.len() > cfg.in_flight {
                let (r, d, guard) = open.pop_front().expect("not empty");
                replicas[r].scheduler.prefill_done_at(&d, now);
                replicas[r].scheduler.finish_at(&d, Some(200), now);
                drop(guard);
            }
            made += 1;
        }
    }
    let took = started.elapsed();
    let now = Instant::now();
    for (r, d, guard) in open {
        replicas[r].scheduler.prefill_done_at(&d, now);
        replicas[r].scheduler.finish_at(&d, Some(200), now);
        drop(guard);
    }
    (made, took)
}

/// Runs the benchmark (on the current Tokio runtime).
pub async fn run(cfg: &SyncBenchConfig) -> anyhow::Result<SyncReport> {
    let server = match &cfg.redis {
        Some(_) => None,
        None => Some(RedisServer::start().await.ok_or_else(|| {
            anyhow::anyhow!("redis-server is not installed: install it or pass --redis URL")
        })?),
    };
    let url = match (&cfg.redis, &server) {
        (Some(u), _) => u.clone(),
        (None, Some(s)) => s.url(),
        (None, None) => unreachable!("a server was started"),
    };
    let server_pid = server.as_ref().and_then(RedisServer::pid);
    let bodies = prompts(cfg.prompt_tokens);
    let mut rounds = Vec::new();
    let mut pooled = Vec::new();
    for i in 0..cfg.rounds * 2 {
        let sync = i % 2 == 1;
        let mut replicas: Vec<Replica> = (0..cfg.replicas)
            .map(|r| Replica::new(cfg.workers, r as u64 + 1))
            .collect();
        let mut metrics = Vec::new();
        if sync {
            for r in &mut replicas {
                let mut config =
                    SyncConfig::new(&url, &format!("bench-{}-{i}", std::process::id()))?;
                config.warm_start_timeout = cfg.warm_start_timeout;
                let m = SyncMetrics::recording(&Metrics::new("bench"), SAMPLES_CAP);
                metrics.push(Arc::clone(&m));
                r.sync = Some(ReplicaSync::start(
                    config,
                    Arc::clone(&r.scheduler),
                    Arc::clone(&r.table),
                    m,
                ));
            }
            for r in &replicas {
                if let Some(s) = &r.sync {
                    s.wait_ready().await;
                }
            }
        }
        let settle = Duration::from_millis(200);
        let cpu0 = process_cpu();
        let server0 = server_pid.and_then(pid_cpu);
        let (decisions, took) = drive(&replicas, &bodies, cfg).await;
        // Both kinds settle alike: the last batches reach the peers.
        tokio::time::sleep(settle).await;
        let cpu = process_cpu().saturating_sub(cpu0);
        let server_cpu = match (server0, server_pid.and_then(pid_cpu)) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        let per = |d: Duration| d.as_secs_f64() * 1e6 / decisions.max(1) as f64;
        let samples = sorted(
            metrics
                .iter()
                .flat_map(|m| m.take_propagation_samples())
                .map(|s| s * 1e3)
                .collect(),
        );
        let sum = |f: fn(&SyncMetrics) -> u64| metrics.iter().map(|m| f(m)).sum::<u64>();
        rounds.push(Round {
            kind: if sync { "sync" } else { "baseline" },
            decisions,
            rate: decisions as f64 / took.as_secs_f64(),
            cpu_us_per_decision: per(cpu),
            server_cpu_us_per_decision: server_cpu.map(per),
            published_deltas: sum(SyncMetrics::published_deltas),
            published_bytes: sum(SyncMetrics::published_bytes),
            applied_deltas: sum(SyncMetrics::applied_deltas),
            dropped_deltas: sum(SyncMetrics::dropped_deltas),
            errors: sum(SyncMetrics::errors),
            samples: samples.len(),
            propagation_p50_ms: quantile(&samples, 0.5),
            propagation_p99_ms: quantile(&samples, 0.99),
            propagation_max_ms: samples.last().copied().unwrap_or(0.0),
        });
        pooled.extend_from_slice(&samples);
        drop(replicas);
    }
    Ok(summarise(cfg, server.is_some(), rounds, &sorted(pooled)))
}

/// Pools the rounds into the report; `samples` are every sync round's
/// propagation samples (ms), sorted.
fn summarise(
    cfg: &SyncBenchConfig,
    own_server: bool,
    rounds: Vec<Round>,
    samples: &[f64],
) -> SyncReport {
    let of = |kind: &'static str| rounds.iter().filter(move |r| r.kind == kind);
    let decisions = |kind: &'static str| of(kind).map(|r| r.decisions).sum::<u64>().max(1) as f64;
    let cpu = |kind: &'static str| {
        of(kind)
            .map(|r| r.cpu_us_per_decision * r.decisions as f64)
            .sum::<f64>()
            / decisions(kind)
    };
    let server: Vec<f64> = of("sync")
        .filter_map(|r| r.server_cpu_us_per_decision.map(|s| s * r.decisions as f64))
        .collect();
    let sync_secs: f64 = of("sync")
        .map(|r| r.decisions as f64 / r.rate.max(1e-9))
        .sum();
    SyncReport {
        replicas: cfg.replicas,
        workers: cfg.workers,
        prompt_tokens: cfg.prompt_tokens,
        target_rate: cfg.rate,
        own_server,
        sync_rate: decisions("sync") / sync_secs.max(1e-9),
        propagation_p50_ms: quantile(samples, 0.5),
        propagation_p99_ms: quantile(samples, 0.99),
        samples: samples.len(),
        applied_deltas: of("sync").map(|r| r.applied_deltas).sum(),
        bytes_per_decision: of("sync").map(|r| r.published_bytes).sum::<u64>() as f64
            / decisions("sync"),
        deltas_per_decision: of("sync").map(|r| r.published_deltas).sum::<u64>() as f64
            / decisions("sync"),
        cpu_us_per_decision_sync: cpu("sync"),
        cpu_us_per_decision_baseline: cpu("baseline"),
        server_cpu_us_per_decision: (!server.is_empty())
            .then(|| server.iter().sum::<f64>() / decisions("sync")),
        rounds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn short(redis: Option<String>) -> SyncBenchConfig {
        SyncBenchConfig {
            redis,
            workers: 16,
            rate: 300.0,
            round: Duration::from_millis(600),
            rounds: 1,
            prompt_tokens: 256,
            in_flight: 16,
            warm_start_timeout: Duration::from_millis(300),
            ..SyncBenchConfig::default()
        }
    }

    /// Nothing listens: decisions are made, nothing reaches a peer, so no
    /// latency sample and no applied delta exist, and failures are counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_is_down_yields_no_samples() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let r = run(&short(Some(format!("redis://127.0.0.1:{port}"))))
            .await
            .expect("runs without a server");
        let sync = &r.rounds[1];
        assert_eq!(sync.kind, "sync");
        assert!(sync.decisions > 0, "{sync:?}");
        assert_eq!((sync.applied_deltas, sync.samples), (0, 0), "{sync:?}");
        assert_eq!(sync.published_bytes, 0, "{sync:?}");
        assert!(sync.errors > 0, "{sync:?}");
        assert_eq!(r.propagation_p99_ms, 0.0);
        assert!(!r.own_server);
    }

    /// With a real server every peer applies the others' batches, each
    /// sample a positive age from the sender's timestamp.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peers_apply_batches_and_their_age_is_measured() {
        let Some(server) = RedisServer::start().await else {
            return;
        };
        let r = run(&short(Some(server.url()))).await.expect("runs");
        let sync = &r.rounds[1];
        assert!(sync.decisions > 0 && sync.published_bytes > 0, "{sync:?}");
        // Two peers apply each replica's deltas.
        assert!(sync.applied_deltas >= sync.published_deltas, "{sync:?}");
        assert!(sync.samples > 0 && r.propagation_p50_ms > 0.0, "{r:?}");
        assert!(r.propagation_p50_ms <= r.propagation_p99_ms);
        assert!(
            r.bytes_per_decision > 0.0 && r.deltas_per_decision >= 2.0,
            "{r:?}"
        );
        assert_eq!(r.rounds[0].published_deltas, 0);
    }
}
