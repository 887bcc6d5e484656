//! `kvpick-bench overhead`: decision latency and throughput of kvpick's ext_proc
//! server next to a no-op ext_proc server, both driven the way Envoy drives them.
//!
//! Each request is one FULL_DUPLEX_STREAMED stream: request headers carrying the
//! `protocol_config`, the body in 16 KiB chunks sent without waiting (as Envoy
//! forwards them), then the client reads the held headers answer and the body
//! streamed back, sends response headers and a response body with
//! `end_of_stream`, and reads their answers, so the request finishes on the server.
//! Decision latency is the time from sending the last body chunk to receiving the
//! headers answer. Many streams run at once over a few HTTP/2 connections. The
//! Envoy side is `envoy-client`, as in the loopback tests and the test gateway.
//!
//! Each server runs in its own child process. In a cell both are started, then
//! take turns (`--rounds` slices each, the order alternating), so load from
//! other work on the machine that comes and goes during a cell falls on both.
//!
//! Both children run the allocator `kvpick` runs in production
//! ([`kvpick::server::malloc`], installed in `kvpick-bench`). kvpick's child
//! also runs, in a tracing cell, kvpick's OTLP exporter
//! ([`kvpick::telemetry::tracing_export`]) sending to a real OTLP/gRPC receiver
//! in the driving process ([`crate::otlp`]); the no-op child does not: it stands
//! for the proxy without kvpick.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::scheduler::ScoringMode;
use kvpick::server::{serve_ext_proc, App};
use kvpick::telemetry::tracing_export::{Exporter, TraceSettings};
use serde::Serialize;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::process::Command;

pub use super::ext_proc_client::{
    chat_body, connect, one_request, one_request_to, routed_request, routed_request_to, CHUNK,
};
pub use super::server_process::{cpu_seconds, vm_hwm_bytes, ServerProcess};
use super::{micros, quantile, sorted, table_of};
use crate::otlp::OtlpReceiver;

/// Settings of one overhead run.
#[derive(Debug, Clone)]
pub struct OverheadConfig {
    /// Chat body sizes in bytes.
    pub body_bytes: Vec<usize>,
    /// Endpoint counts.
    pub endpoints: Vec<usize>,
    /// kvpick's tracing in each cell.
    pub tracing: Vec<Tracing>,
    /// Measured time per (cell, server).
    pub duration: Duration,
    /// Unmeasured warm-up before each measured slice.
    pub warmup: Duration,
    /// Slices each server's measured time is split into, the two servers taking
    /// turns (order alternating), so load on the shared machine that comes and
    /// goes during a cell falls on both alike.
    pub rounds: usize,
    /// Concurrent streams.
    pub concurrency: usize,
    /// HTTP/2 connections the streams share.
    pub connections: usize,
    /// The `kvpick-bench` executable that serves each (cell, server) in a child
    /// process (`overhead-server`), so peak RSS is per cell.
    pub server_exe: PathBuf,
    /// The peer endpoint picker ([`super::peer_epp`]) run as a third server:
    /// then every cell starts one mock vLLM worker per endpoint, kvpick and the
    /// peer both scrape them, and each one's idle CPU is measured first.
    pub peer: Option<PathBuf>,
}

/// Latency and throughput of one server in one cell.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ServerFigures {
    /// Median decision latency in microseconds.
    pub p50_us: f64,
    /// 99th percentile decision latency in microseconds.
    pub p99_us: f64,
    /// Completed requests per second.
    pub rps: f64,
    /// The server process's peak resident set (VmHWM) in MiB.
    pub peak_rss_mib: f64,
    /// Server CPU time (user + system) per completed request in microseconds,
    /// over the whole drive (warm-up included): what the server spends, apart
    /// from the client sharing the machine.
    pub cpu_us_per_request: f64,
}

/// Idle cost of a picker over mock workers: CPU while no request comes (its
/// metrics scraping and housekeeping), in percent of one core.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct IdleCpu {
    /// kvpick's idle CPU, % of a core.
    pub kvpick_percent: f64,
    /// The peer's idle CPU, % of a core.
    pub peer_percent: f64,
}

/// One (body size, endpoint count, tracing) cell.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadRun {
    /// Request body size in bytes.
    pub body_bytes: usize,
    /// Endpoints in the pool.
    pub endpoints: usize,
    /// kvpick's tracing.
    pub tracing: Tracing,
    /// Spans kvpick's exporter delivered to the receiver in the cell.
    pub spans_exported: u64,
    /// kvpick's figures.
    pub kvpick: ServerFigures,
    /// The no-op server's figures.
    pub noop: ServerFigures,
    /// kvpick p99 / no-op p99.
    pub p99_ratio: f64,
    /// kvpick req/s / no-op req/s.
    pub throughput_ratio: f64,
    /// kvpick CPU per request / no-op CPU per request.
    pub cpu_ratio: f64,
    /// The peer's figures, in cells run with the peer.
    pub peer: Option<ServerFigures>,
    /// Peer CPU per request / kvpick CPU per request.
    pub peer_cpu_ratio: Option<f64>,
    /// Idle CPU of kvpick and the peer over the cell's workers.
    pub idle: Option<IdleCpu>,
}

/// The whole overhead report.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadReport {
    /// One entry per cell.
    pub runs: Vec<OverheadRun>,
}

impl OverheadReport {
    /// The report as a Markdown table, and the peer's table when cells ran it.
    pub fn markdown(&self) -> String {
        let peer_runs: Vec<&OverheadRun> = self.runs.iter().filter(|r| r.peer.is_some()).collect();
        let mut md = self.own_markdown();
        if !peer_runs.is_empty() {
            md.push_str(&format!(
                "\n\nkvpick beside the peer EPP ({}), both scraping the same mock vLLM workers\n\n",
                super::peer_epp::PINNED
            ));
            md.push_str(&peer_markdown(&peer_runs));
        }
        md
    }

    fn own_markdown(&self) -> String {
        table_of(
            &[
                "body bytes",
                "endpoints",
                "tracing",
                "spans",
                "kvpick p50 µs",
                "noop p50 µs",
                "kvpick p99 µs",
                "noop p99 µs",
                "p99 ratio",
                "kvpick req/s",
                "noop req/s",
                "throughput ratio",
                "kvpick peak RSS MiB",
                "noop peak RSS MiB",
                "kvpick CPU µs/req",
                "noop CPU µs/req",
                "CPU ratio",
            ],
            &self.runs,
            |r| {
                vec![
                    r.body_bytes.to_string(),
                    r.endpoints.to_string(),
                    r.tracing.as_str().to_string(),
                    r.spans_exported.to_string(),
                    format!("{:.0}", r.kvpick.p50_us),
                    format!("{:.0}", r.noop.p50_us),
                    format!("{:.0}", r.kvpick.p99_us),
                    format!("{:.0}", r.noop.p99_us),
                    format!("{:.2}", r.p99_ratio),
                    format!("{:.0}", r.kvpick.rps),
                    format!("{:.0}", r.noop.rps),
                    format!("{:.2}", r.throughput_ratio),
                    format!("{:.0}", r.kvpick.peak_rss_mib),
                    format!("{:.0}", r.noop.peak_rss_mib),
                    format!("{:.0}", r.kvpick.cpu_us_per_request),
                    format!("{:.0}", r.noop.cpu_us_per_request),
                    format!("{:.2}", r.cpu_ratio),
                ]
            },
        )
    }
}

/// The kvpick / peer / no-op table of the cells that ran the peer.
fn peer_markdown(runs: &[&OverheadRun]) -> String {
    table_of(
        &[
            "body bytes",
            "endpoints",
            "kvpick CPU µs/req",
            "peer CPU µs/req",
            "noop CPU µs/req",
            "peer/kvpick CPU",
            "kvpick p50 µs",
            "peer p50 µs",
            "kvpick p99 µs",
            "peer p99 µs",
            "kvpick peak RSS MiB",
            "peer peak RSS MiB",
            "kvpick idle CPU %",
            "peer idle CPU %",
        ],
        runs,
        |r| {
            let peer = r.peer.expect("filtered on the peer");
            let idle = r
                .idle
                .map_or((0.0, 0.0), |i| (i.kvpick_percent, i.peer_percent));
            vec![
                r.body_bytes.to_string(),
                r.endpoints.to_string(),
                format!("{:.0}", r.kvpick.cpu_us_per_request),
                format!("{:.0}", peer.cpu_us_per_request),
                format!("{:.0}", r.noop.cpu_us_per_request),
                format!("{:.1}", r.peer_cpu_ratio.unwrap_or(0.0)),
                format!("{:.0}", r.kvpick.p50_us),
                format!("{:.0}", peer.p50_us),
                format!("{:.0}", r.kvpick.p99_us),
                format!("{:.0}", peer.p99_us),
                format!("{:.0}", r.kvpick.peak_rss_mib),
                format!("{:.0}", peer.peak_rss_mib),
                format!("{:.1}", idle.0),
                format!("{:.1}", idle.1),
            ]
        },
    )
}

fn endpoints(n: usize) -> Vec<Endpoint> {
    (0..n)
        .map(|i| {
            let addr = format!("10.{}.{}.{}:8000", i / 65_536, (i / 256) % 256, i % 256);
            Endpoint::new(addr.parse().expect("a valid socket address"))
        })
        .collect()
}

/// kvpick's OpenTelemetry tracing in a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Tracing {
    /// No exporter (kvpick's default).
    Off,
    /// `--tracing` with its default sampling (parent-based, one root trace in
    /// [`kvpick::telemetry::tracing_export::DEFAULT_RATIO`]).
    On,
    /// `--tracing` with `OTEL_TRACES_SAMPLER_ARG=1`: every request exported.
    All,
}

impl Tracing {
    /// Its name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Tracing::Off => "off",
            Tracing::On => "on",
            Tracing::All => "all",
        }
    }

    /// The settings `--tracing` gives in this mode, the `OTEL_*` variables
    /// read by `var` apart from the sampler's, which the mode sets; `None`
    /// when off.
    pub fn settings(
        self,
        var: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Option<TraceSettings>> {
        if self == Tracing::Off {
            return Ok(None);
        }
        let var = |name: &str| match name {
            "OTEL_TRACES_SAMPLER" => None,
            "OTEL_TRACES_SAMPLER_ARG" => (self == Tracing::All).then(|| "1".to_string()),
            _ => var(name),
        };
        Ok(TraceSettings::from_vars(Some(true), var)?)
    }
}

/// Which ext_proc server a cell drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKind {
    /// kvpick over this many standalone endpoints.
    Kvpick {
        /// Endpoints in the pool.
        endpoints: usize,
        /// Its tracing.
        tracing: Tracing,
        /// `Some(port)`: the endpoints are mock workers listening on `port` at
        /// [`super::peer_epp::loopback_worker`] addresses, and kvpick scrapes
        /// their metrics as `kvpick` does; `None`: unreachable addresses, no scraping.
        workers_port: Option<u16>,
        /// Its `--scoring`.
        scoring: ScoringMode,
    },
    /// The no-op baseline.
    Noop,
}

impl ServerKind {
    /// kvpick over `endpoints`, tracing off, heuristic scoring.
    pub fn kvpick(endpoints: usize) -> Self {
        ServerKind::Kvpick {
            endpoints,
            tracing: Tracing::Off,
            workers_port: None,
            scoring: ScoringMode::Heuristic,
        }
    }

    /// The arguments of `kvpick-bench overhead-server` that serve this kind.
    pub fn args(self) -> Vec<String> {
        match self {
            ServerKind::Kvpick {
                endpoints,
                tracing,
                workers_port,
                scoring,
            } => {
                let mut args = vec!["--endpoints".into(), endpoints.to_string()];
                if let Some(port) = workers_port {
                    args.extend(["--workers-port".into(), port.to_string()]);
                }
                // Off is the default, so a build older than the flag serves it too
                // (`kvpick-bench instructions --against`).
                if tracing != Tracing::Off {
                    args.extend(["--tracing".into(), tracing.as_str().into()]);
                }
                // Likewise the heuristic.
                if scoring == ScoringMode::Predicted {
                    args.extend(["--scoring".into(), "predicted".into()]);
                }
                args
            }
            ServerKind::Noop => vec!["--noop".into()],
        }
    }
}

/// The environment variable that seeds a kvpick server's tie-break in
/// [`serve`] (unset: random, as `kvpick` runs).
pub const TIE_BREAK_SEED_ENV: &str = "KVPICK_BENCH_TIE_BREAK_SEED";

/// Serves `kind` on `listener` until the future is dropped (tracing, if any,
/// is the process's: see [`serve_until_stdin_closes`]).
pub async fn serve(kind: ServerKind, listener: TcpListener) -> anyhow::Result<()> {
    match kind {
        ServerKind::Kvpick {
            endpoints: n,
            workers_port,
            scoring,
            ..
        } => {
            // `instructions` seeds the tie-break so every run routes (and
            // grows the prefix index) alike.
            let config = kvpick::scheduler::SchedulerConfig {
                tie_break_seed: std::env::var(TIE_BREAK_SEED_ENV)
                    .ok()
                    .and_then(|s| s.parse().ok()),
                scoring,
                ..Default::default()
            };
            let app = App::with_scheduler("bench", config);
            let service = app.ext_proc(ExtProcConfig::default());
            match workers_port {
                None => {
                    app.endpoints.replace(endpoints(n));
                    serve_ext_proc(listener, service, None).await?;
                }
                Some(port) => {
                    let workers = (0..n)
                        .map(|i| {
                            Endpoint::new(SocketAddr::new(
                                super::peer_epp::loopback_worker(i),
                                port,
                            ))
                        })
                        .collect();
                    app.endpoints.replace(workers);
                    let scrape = kvpick::scrape::run(
                        kvpick::scrape::ScrapeConfig::default(),
                        Arc::clone(&app.endpoints),
                        Arc::clone(&app.scrape_errors),
                    );
                    tokio::select! {
                        served = serve_ext_proc(listener, service, None) => served?,
                        () = scrape => {}
                    }
                }
            }
        }
        ServerKind::Noop => super::noop::serve(listener).await?,
    }
    Ok(())
}

/// The server side of a cell, run in its own process (`kvpick-bench
/// overhead-server`) so its peak RSS is its own: prints the port on stdout and
/// serves until stdin closes. A tracing kvpick exports its spans as `kvpick`
/// does (to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, set by [`ServerProcess`]),
/// flushing them before it returns. (The caller pins the allocator as `kvpick`'s
/// `main` does, before the runtime starts.)
pub async fn serve_until_stdin_closes(kind: ServerKind) -> anyhow::Result<()> {
    let exporter = match kind {
        ServerKind::Kvpick { tracing, .. } => tracing
            .settings(|name| std::env::var(name).ok())?
            .map(|s| Exporter::start(&s))
            .transpose()?,
        ServerKind::Noop => None,
    };
    if let Some(e) = &exporter {
        kvpick::telemetry::init_logging(kvpick::telemetry::LogFormat::Text, "warn", Some(e));
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", listener.local_addr()?.port());
    let mut stdin = tokio::io::stdin();
    let mut sink = Vec::new();
    let served = tokio::select! {
        served = serve(kind, listener) => served,
        _ = stdin.read_to_end(&mut sink) => Ok(()),
    };
    // Dropping the exporter sends what is queued.
    drop(exporter);
    served
}

impl ServerProcess {
    /// Starts `exe overhead-server <kind args>` and reads its port; a tracing
    /// kvpick exports to the OTLP/gRPC receiver at `otlp`.
    pub async fn start(
        exe: &Path,
        kind: ServerKind,
        otlp: Option<SocketAddr>,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(exe);
        if let Some(otlp) = otlp {
            command.env(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                format!("http://{otlp}"),
            );
        }
        command.arg("overhead-server").args(kind.args());
        Self::spawn(command).await
    }
}

/// Drives the server on `port` with `cfg.concurrency` streams for `cfg.warmup`
/// plus `duration`; returns the latencies (µs) of the requests that finish in
/// the measured window and how many requests completed in all.
async fn drive(
    port: u16,
    bodies: Arc<Vec<Vec<u8>>>,
    cfg: &OverheadConfig,
    duration: Duration,
    large: Option<&LargeLoad>,
) -> anyhow::Result<(Vec<f64>, u64)> {
    let mut channels = Vec::new();
    for _ in 0..cfg.connections.max(1) {
        channels.push(connect(port).await?);
    }
    let start = Instant::now();
    let measure_from = start + cfg.warmup;
    let end = measure_from + duration;
    // Large requests on their own connection, unmeasured, for the whole run.
    let mut background = Vec::new();
    if let Some(large) = large {
        let ch = connect(port).await?;
        for _ in 0..large.streams {
            let (ch, body) = (ch.clone(), Arc::clone(&large.body));
            background.push(tokio::spawn(async move {
                while Instant::now() < end {
                    one_request(&ch, &body).await?;
                }
                anyhow::Ok(())
            }));
        }
    }
    let mut tasks = Vec::new();
    let completed = Arc::new(AtomicU64::new(0));
    for i in 0..cfg.concurrency.max(1) {
        let ch = channels[i % channels.len()].clone();
        let bodies = Arc::clone(&bodies);
        let completed = Arc::clone(&completed);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut k = i;
            while Instant::now() < end {
                let l = one_request(&ch, &bodies[k % bodies.len()]).await?;
                k += 1;
                completed.fetch_add(1, Ordering::Relaxed);
                // Requests that finish inside the window count (large bodies take
                // longer than a short window).
                let done = Instant::now();
                if done >= measure_from && done <= end {
                    lat.push(micros(l));
                }
            }
            anyhow::Ok(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    for t in background {
        t.await??;
    }
    Ok((all, completed.load(Ordering::Relaxed)))
}

/// What one server did over one or more drives.
#[derive(Debug, Default)]
struct Tally {
    /// Latencies (µs) of the requests measured.
    lat: Vec<f64>,
    /// Measured time in all.
    measured: Duration,
    /// Requests completed, warm-ups included.
    completed: u64,
    /// Server CPU seconds over the drives, warm-ups included.
    cpu_seconds: f64,
}

impl Tally {
    /// Drives `server` once for `duration` (after the warm-up) and adds it up.
    async fn drive(
        &mut self,
        server: &ServerProcess,
        bodies: &Arc<Vec<Vec<u8>>>,
        cfg: &OverheadConfig,
        duration: Duration,
        large: Option<&LargeLoad>,
    ) -> anyhow::Result<()> {
        let cpu_before = server.cpu_seconds()?;
        let (lat, completed) = drive(server.port, Arc::clone(bodies), cfg, duration, large).await?;
        self.cpu_seconds += server.cpu_seconds()? - cpu_before;
        self.lat.extend(lat);
        self.measured += duration;
        self.completed += completed;
        Ok(())
    }

    /// The figures of every drive together, with the server's peak RSS.
    fn figures(self, peak_rss_bytes: u64) -> ServerFigures {
        let lat = sorted(self.lat);
        ServerFigures {
            p50_us: quantile(&lat, 0.5),
            p99_us: quantile(&lat, 0.99),
            rps: lat.len() as f64 / self.measured.as_secs_f64().max(f64::MIN_POSITIVE),
            peak_rss_mib: peak_rss_bytes as f64 / f64::from(1 << 20),
            cpu_us_per_request: self.cpu_seconds * 1e6 / self.completed.max(1) as f64,
        }
    }
}

/// Starts `kind` in a child process and drives it once for `cfg.duration`.
async fn measure(
    kind: ServerKind,
    bodies: &Arc<Vec<Vec<u8>>>,
    cfg: &OverheadConfig,
    large: Option<&LargeLoad>,
) -> anyhow::Result<ServerFigures> {
    let server = ServerProcess::start(&cfg.server_exe, kind, None).await?;
    let mut tally = Tally::default();
    tally
        .drive(&server, bodies, cfg, cfg.duration, large)
        .await?;
    let figures = tally.figures(server.peak_rss_bytes()?);
    server.stop().await?;
    Ok(figures)
}

/// The no-op server and kvpick (`kind`, exporting to `otlp` if it traces) in
/// one cell: both started, then driven in `cfg.rounds` alternating slices of
/// `cfg.duration / rounds` each (no-op first in even rounds, kvpick first in
/// odd ones).
async fn measure_pair(
    kind: ServerKind,
    otlp: Option<SocketAddr>,
    bodies: &Arc<Vec<Vec<u8>>>,
    cfg: &OverheadConfig,
) -> anyhow::Result<(ServerFigures, ServerFigures)> {
    let noop = ServerProcess::start(&cfg.server_exe, ServerKind::Noop, None).await?;
    let kvpick = ServerProcess::start(&cfg.server_exe, kind, otlp).await?;
    let rounds = cfg.rounds.max(1);
    let slice = cfg.duration / rounds as u32;
    let (mut noop_tally, mut kvpick_tally) = (Tally::default(), Tally::default());
    for round in 0..rounds {
        let mut turns = [(&noop, &mut noop_tally), (&kvpick, &mut kvpick_tally)];
        if round % 2 == 1 {
            turns.reverse();
        }
        for (server, tally) in turns {
            tally.drive(server, bodies, cfg, slice, None).await?;
        }
    }
    let figures = (
        noop_tally.figures(noop.peak_rss_bytes()?),
        kvpick_tally.figures(kvpick.peak_rss_bytes()?),
    );
    noop.stop().await?;
    kvpick.stop().await?;
    Ok(figures)
}

/// How long idle CPU is measured for, per server.
const IDLE_WINDOW: Duration = Duration::from_secs(5);

/// CPU of `server` over [`IDLE_WINDOW`] with no request, in % of one core.
async fn idle_cpu_percent(server: &ServerProcess) -> anyhow::Result<f64> {
    let before = server.cpu_seconds()?;
    tokio::time::sleep(IDLE_WINDOW).await;
    Ok((server.cpu_seconds()? - before) * 100.0 / IDLE_WINDOW.as_secs_f64())
}

/// The three servers' figures in a cell with the peer.
struct Trio {
    noop: ServerFigures,
    kvpick: ServerFigures,
    peer: ServerFigures,
    idle: IdleCpu,
}

/// The no-op server, kvpick over `endpoints` mock workers (scraping them) and
/// the peer at `peer_exe` over the same workers, in one cell: all started,
/// each one's idle CPU measured (the two pickers at once, as both scrape the
/// whole time), then driven in `cfg.rounds` slices, the order rotating.
async fn measure_trio(
    endpoints: usize,
    peer_exe: &Path,
    bodies: &Arc<Vec<Vec<u8>>>,
    cfg: &OverheadConfig,
) -> anyhow::Result<Trio> {
    let fleet = super::peer_epp::Fleet::start(endpoints, "llama").await?;
    let kind = ServerKind::Kvpick {
        endpoints,
        tracing: Tracing::Off,
        workers_port: Some(fleet.port()),
        scoring: ScoringMode::Heuristic,
    };
    let noop = ServerProcess::start(&cfg.server_exe, ServerKind::Noop, None).await?;
    let kvpick = ServerProcess::start(&cfg.server_exe, kind, None).await?;
    let peer = super::peer_epp::PeerEpp::start(peer_exe, &fleet.addrs(), fleet.port()).await?;
    let (kvpick_idle, peer_idle) =
        tokio::try_join!(idle_cpu_percent(&kvpick), idle_cpu_percent(&peer.process))?;
    let rounds = cfg.rounds.max(1);
    let slice = cfg.duration / rounds as u32;
    let mut tallies = [Tally::default(), Tally::default(), Tally::default()];
    for round in 0..rounds {
        for k in 0..3 {
            let which = (round + k) % 3;
            let server = [&noop, &kvpick, &peer.process][which];
            tallies[which]
                .drive(server, bodies, cfg, slice, None)
                .await?;
        }
    }
    let [t_noop, t_kvpick, t_peer] = tallies;
    let trio = Trio {
        noop: t_noop.figures(noop.peak_rss_bytes()?),
        kvpick: t_kvpick.figures(kvpick.peak_rss_bytes()?),
        peer: t_peer.figures(peer.process.peak_rss_bytes()?),
        idle: IdleCpu {
            kvpick_percent: kvpick_idle,
            peer_percent: peer_idle,
        },
    };
    noop.stop().await?;
    kvpick.stop().await?;
    peer.process.stop().await?;
    Ok(trio)
}

/// Distinct bodies per cell: 64, fewer for large bodies so the client holds at
/// most about 256 MiB of them.
pub fn variants(bytes: usize) -> u64 {
    ((256 << 20) / bytes.max(1)).clamp(4, 64) as u64
}

/// Runs every (body size, endpoint count, tracing) cell against both servers.
pub async fn run(cfg: &OverheadConfig) -> anyhow::Result<OverheadReport> {
    let receiver = OtlpReceiver::counting();
    let otlp = match cfg.tracing.iter().any(|t| *t != Tracing::Off) {
        true => Some(receiver.start().await?),
        false => None,
    };
    let mut runs = Vec::new();
    for &bytes in &cfg.body_bytes {
        let bodies = Arc::new(
            (0..variants(bytes))
                .map(|v| chat_body(bytes, v))
                .collect::<Vec<_>>(),
        );
        for (&n, &tracing) in cfg
            .endpoints
            .iter()
            .flat_map(|n| cfg.tracing.iter().map(move |t| (n, t)))
        {
            let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
            if let (Some(peer_exe), Tracing::Off) = (&cfg.peer, tracing) {
                let trio = measure_trio(n, peer_exe, &bodies, cfg).await?;
                eprintln!(
                    "overhead: {bytes} B, {n} endpoints, with the peer: CPU µs/req kvpick {:.0}, peer {:.0}, noop {:.0}; idle CPU kvpick {:.1}%, peer {:.1}%",
                    trio.kvpick.cpu_us_per_request,
                    trio.peer.cpu_us_per_request,
                    trio.noop.cpu_us_per_request,
                    trio.idle.kvpick_percent,
                    trio.idle.peer_percent,
                );
                runs.push(OverheadRun {
                    body_bytes: bodies[0].len(),
                    endpoints: n,
                    tracing,
                    spans_exported: 0,
                    p99_ratio: ratio(trio.kvpick.p99_us, trio.noop.p99_us),
                    throughput_ratio: ratio(trio.kvpick.rps, trio.noop.rps),
                    cpu_ratio: ratio(trio.kvpick.cpu_us_per_request, trio.noop.cpu_us_per_request),
                    peer_cpu_ratio: Some(ratio(
                        trio.peer.cpu_us_per_request,
                        trio.kvpick.cpu_us_per_request,
                    )),
                    peer: Some(trio.peer),
                    idle: Some(trio.idle),
                    kvpick: trio.kvpick,
                    noop: trio.noop,
                });
                continue;
            }
            let kind = ServerKind::Kvpick {
                endpoints: n,
                tracing,
                workers_port: None,
                scoring: ScoringMode::Heuristic,
            };
            let spans_before = receiver.received();
            let (noop, kvpick) = measure_pair(kind, otlp, &bodies, cfg).await?;
            // The child flushed its queue as it stopped.
            let spans_exported = receiver.received() - spans_before;
            eprintln!(
                "overhead: {bytes} B, {n} endpoints, tracing {}: kvpick p99 {:.0} µs, noop p99 {:.0} µs, {spans_exported} spans",
                tracing.as_str(),
                kvpick.p99_us,
                noop.p99_us
            );
            runs.push(OverheadRun {
                body_bytes: bodies[0].len(),
                endpoints: n,
                tracing,
                spans_exported,
                p99_ratio: ratio(kvpick.p99_us, noop.p99_us),
                throughput_ratio: ratio(kvpick.rps, noop.rps),
                cpu_ratio: ratio(kvpick.cpu_us_per_request, noop.cpu_us_per_request),
                peer: None,
                peer_cpu_ratio: None,
                idle: None,
                kvpick,
                noop,
            });
        }
    }
    Ok(OverheadReport { runs })
}

/// Large requests running next to the measured ones (the stall measurement).
#[derive(Debug, Clone)]
pub struct LargeLoad {
    /// The large body every background stream sends.
    pub body: Arc<Vec<u8>>,
    /// Background streams, each sending one large request after another.
    pub streams: usize,
}

/// Small-request figures of one server, alone and next to large requests.
#[derive(Debug, Clone, Serialize)]
pub struct StallRun {
    /// `kvpick` or `noop`.
    pub server: String,
    /// Small requests alone.
    pub alone: ServerFigures,
    /// Small requests while the large ones run.
    pub with_large: ServerFigures,
    /// p99 with large requests / p99 alone.
    pub p99_ratio: f64,
}

/// The stall report: does work on large bodies delay small requests?
#[derive(Debug, Clone, Serialize)]
pub struct StallReport {
    /// Small body size in bytes.
    pub small_bytes: usize,
    /// Large body size in bytes.
    pub large_bytes: usize,
    /// Background streams sending large bodies.
    pub large_streams: usize,
    /// Endpoints in kvpick's pool.
    pub endpoints: usize,
    /// One entry per server.
    pub runs: Vec<StallRun>,
}

impl StallReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        format!(
            "small {} B requests, alone and next to {} streams of {} B requests ({} endpoints)\n\n{}",
            self.small_bytes,
            self.large_streams,
            self.large_bytes,
            self.endpoints,
            table_of(&[
                    "server",
                    "alone p50 µs",
                    "alone p99 µs",
                    "with large p50 µs",
                    "with large p99 µs",
                    "p99 ratio",
                ], &self.runs, |r| vec![
                    r.server.clone(),
                    format!("{:.0}", r.alone.p50_us),
                    format!("{:.0}", r.alone.p99_us),
                    format!("{:.0}", r.with_large.p50_us),
                    format!("{:.0}", r.with_large.p99_us),
                    format!("{:.2}", r.p99_ratio),
                ])
        )
    }
}

/// Decision latency of `small_bytes` requests on each server, alone and while
/// `large_streams` streams send `large_bytes` bodies, in one run.
pub async fn stall(
    cfg: &OverheadConfig,
    small_bytes: usize,
    large_bytes: usize,
    large_streams: usize,
    endpoints: usize,
) -> anyhow::Result<StallReport> {
    let bodies = Arc::new((0..64).map(|v| chat_body(small_bytes, v)).collect());
    let large = LargeLoad {
        body: Arc::new(chat_body(large_bytes, 1_000_000)),
        streams: large_streams,
    };
    let mut runs = Vec::new();
    for kind in [ServerKind::Noop, ServerKind::kvpick(endpoints)] {
        let alone = measure(kind, &bodies, cfg, None).await?;
        let with_large = measure(kind, &bodies, cfg, Some(&large)).await?;
        runs.push(StallRun {
            server: match kind {
                ServerKind::Noop => "noop".into(),
                ServerKind::Kvpick { .. } => "kvpick".into(),
            },
            p99_ratio: if alone.p99_us > 0.0 {
                with_large.p99_us / alone.p99_us
            } else {
                0.0
            },
            alone,
            with_large,
        });
    }
    Ok(StallReport {
        small_bytes,
        large_bytes,
        large_streams,
        endpoints,
        runs,
    })
}

/// A `/v1/completions` body whose prompt is `tokens` token ids of one digit
/// each (about 2 bytes a token: 12 M ids ≈ 23 MiB).
pub fn numeric_prompt_body(tokens: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(tokens * 2 + 64);
    body.extend_from_slice(br#"{"model":"llama","max_tokens":1,"prompt":["#);
    for i in 0..tokens {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'0' + (i % 10) as u8);
    }
    body.extend_from_slice(b"]}");
    body
}

/// Peak memory of one server while `concurrent` large requests run at once.
#[derive(Debug, Clone, Serialize)]
pub struct RssRun {
    /// `kvpick` or `noop`.
    pub server: String,
    /// Body size of each request in MiB.
    pub body_mib: f64,
    /// Requests in flight together.
    pub concurrent: usize,
    /// Peak RSS (VmHWM) after one small warm-up request, MiB.
    pub idle_mib: f64,
    /// Peak RSS after the large requests, MiB.
    pub peak_mib: f64,
    /// (peak − idle) / (concurrent × body size).
    pub growth_per_body_byte: f64,
}

/// The peak-RSS report.
#[derive(Debug, Clone, Serialize)]
pub struct RssReport {
    /// One entry per server.
    pub runs: Vec<RssRun>,
}

impl RssReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        table_of(
            &[
                "server",
                "body MiB",
                "concurrent",
                "idle peak RSS MiB",
                "peak RSS MiB",
                "growth / body bytes",
            ],
            &self.runs,
            |r| {
                vec![
                    r.server.clone(),
                    format!("{:.1}", r.body_mib),
                    r.concurrent.to_string(),
                    format!("{:.0}", r.idle_mib),
                    format!("{:.0}", r.peak_mib),
                    format!("{:.2}", r.growth_per_body_byte),
                ]
            },
        )
    }
}

/// Sends `concurrent` copies of `body` to `path` at once, to the no-op server
/// and to kvpick (each in its own process), and reads each one's peak RSS.
pub async fn peak_rss(
    exe: &Path,
    path: &str,
    body: Vec<u8>,
    concurrent: usize,
    endpoints: usize,
) -> anyhow::Result<RssReport> {
    let body = Arc::new(body);
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let mut runs = Vec::new();
    for kind in [ServerKind::Noop, ServerKind::kvpick(endpoints)] {
        let server = ServerProcess::start(exe, kind, None).await?;
        let ch = connect(server.port).await?;
        one_request(&ch, &chat_body(1024, 0)).await?;
        let idle = server.peak_rss_bytes()?;
        let mut tasks = Vec::new();
        for _ in 0..concurrent {
            let (ch, body, path) = (ch.clone(), Arc::clone(&body), path.to_string());
            tasks.push(tokio::spawn(async move {
                one_request_to(&ch, &path, &body).await
            }));
        }
        for t in tasks {
            t.await??;
        }
        let peak = server.peak_rss_bytes()?;
        server.stop().await?;
        runs.push(RssRun {
            server: match kind {
                ServerKind::Noop => "noop".into(),
                ServerKind::Kvpick { .. } => "kvpick".into(),
            },
            body_mib: mib(body.len() as u64),
            concurrent,
            idle_mib: mib(idle),
            peak_mib: mib(peak),
            growth_per_body_byte: peak.saturating_sub(idle) as f64
                / (concurrent * body.len()).max(1) as f64,
        });
    }
    Ok(RssReport { runs })
}

#[cfg(test)]
mod tests {
    use tonic::transport::Channel;

    use super::*;

    #[test]
    fn chat_bodies_have_the_asked_size_and_parse() {
        for bytes in [1024, 32 * 1024] {
            let b = chat_body(bytes, 3);
            assert!(
                b.len() >= bytes * 9 / 10 && b.len() <= bytes + 64,
                "{}",
                b.len()
            );
            let parsed = kvpick::request::parse(&b, None).unwrap();
            assert_eq!(parsed.model, "llama");
        }
        assert_ne!(chat_body(1024, 1), chat_body(1024, 2));
    }

    #[tokio::test]
    async fn one_request_completes_against_both_servers() {
        let body = chat_body(100_000, 0);
        let predicted = ServerKind::Kvpick {
            endpoints: 8,
            tracing: Tracing::Off,
            workers_port: None,
            scoring: ScoringMode::Predicted,
        };
        for kind in [ServerKind::Noop, ServerKind::kvpick(8), predicted] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let server = tokio::spawn(serve(kind, listener));
            let ch = Channel::from_shared(format!("http://127.0.0.1:{port}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            one_request(&ch, &body).await.unwrap();
            server.abort();
        }
    }

    #[test]
    fn tracing_cells_sample_as_the_flag_does_or_every_request() {
        // The caller's sampler variables do not change a cell's sampling.
        let env = |name: &str| match name {
            "OTEL_TRACES_SAMPLER" => Some("always_off".to_string()),
            "OTEL_TRACES_SAMPLER_ARG" => Some("0.5".to_string()),
            _ => None,
        };
        let sampler = |t: Tracing| t.settings(env).unwrap().map(|s| format!("{:?}", s.sampler));
        assert_eq!(sampler(Tracing::Off), None);
        let default = TraceSettings::from_vars(Some(true), |_| None)
            .unwrap()
            .unwrap();
        assert_eq!(sampler(Tracing::On), Some(format!("{:?}", default.sampler)));
        assert!(sampler(Tracing::On).unwrap().contains("0.1"));
        assert!(sampler(Tracing::All)
            .unwrap()
            .contains("TraceIdRatioBased(1.0)"));
        assert_eq!(
            ServerKind::Kvpick {
                endpoints: 8,
                tracing: Tracing::All,
                workers_port: None,
                scoring: ScoringMode::Predicted,
            }
            .args(),
            [
                "--endpoints",
                "8",
                "--tracing",
                "all",
                "--scoring",
                "predicted"
            ]
        );
    }

    #[test]
    fn a_kvpick_over_mock_workers_names_their_port_and_the_peer_gets_its_table() {
        let kind = ServerKind::Kvpick {
            endpoints: 100,
            tracing: Tracing::Off,
            workers_port: Some(18_000),
            scoring: ScoringMode::Heuristic,
        };
        assert_eq!(
            kind.args(),
            ["--endpoints", "100", "--workers-port", "18000"]
        );
        let fig = |cpu: f64| ServerFigures {
            p50_us: 10.0,
            p99_us: 20.0,
            rps: 1000.0,
            peak_rss_mib: 30.0,
            cpu_us_per_request: cpu,
        };
        let run = |peer: Option<ServerFigures>| OverheadRun {
            body_bytes: 4096,
            endpoints: 100,
            tracing: Tracing::Off,
            spans_exported: 0,
            kvpick: fig(100.0),
            noop: fig(80.0),
            p99_ratio: 1.0,
            throughput_ratio: 1.0,
            cpu_ratio: 1.25,
            peer_cpu_ratio: peer.map(|p| p.cpu_us_per_request / 100.0),
            idle: peer.map(|_| IdleCpu {
                kvpick_percent: 12.5,
                peer_percent: 40.0,
            }),
            peer,
        };
        let without = OverheadReport {
            runs: vec![run(None)],
        };
        assert!(!without.markdown().contains("peer EPP"));
        let with = OverheadReport {
            runs: vec![run(None), run(Some(fig(900.0)))],
        };
        let md = with.markdown();
        assert!(md.contains(super::super::peer_epp::PINNED), "{md}");
        assert!(
            md.contains(
                "| 4096 | 100 | 100 | 900 | 80 | 9.0 | 10 | 10 | 20 | 20 | 30 | 30 | 12.5 | 40.0 |"
            ),
            "{md}"
        );
    }

    #[test]
    fn slices_add_up_to_one_server_figure() {
        let mut t = Tally::default();
        // Two slices: 3 requests measured in 1 s, then 1 in 1 s; 6 completed in
        // all with warm-ups, 0.0006 CPU seconds.
        for (lat, secs, completed, cpu) in [
            (vec![30.0, 10.0, 20.0], 1, 4, 0.0004),
            (vec![40.0], 1, 2, 0.0002),
        ] {
            t.lat.extend(lat);
            t.measured += Duration::from_secs(secs);
            t.completed += completed;
            t.cpu_seconds += cpu;
        }
        let f = t.figures(3 << 20);
        assert_eq!(f.rps, 2.0, "4 measured requests over 2 measured seconds");
        assert_eq!((f.p50_us, f.p99_us), (20.0, 40.0));
        assert!((f.cpu_us_per_request - 100.0).abs() < 1e-9);
        assert_eq!(f.peak_rss_mib, 3.0);
    }

    #[test]
    fn cpu_time_is_utime_plus_stime_in_user_hz() {
        // A command name with spaces and parentheses, then 40 fields.
        let stat = "1234 (kvpick (bench) x) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 9 0 100";
        assert_eq!(cpu_seconds(stat), Some(3.0));
        assert_eq!(cpu_seconds("1234 (short) S 1 2"), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(cpu_seconds(&own).is_some());
    }

    #[test]
    fn peak_rss_comes_from_vm_hwm() {
        let status = "Name:\tkvpick\nVmPeak:\t  900 kB\nVmHWM:\t   12345 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(vm_hwm_bytes(status), Some(12345 * 1024));
        assert_eq!(vm_hwm_bytes("VmRSS: 1 kB\n"), None);
        let own = std::fs::read_to_string("/proc/self/status").unwrap();
        assert!(vm_hwm_bytes(&own).unwrap() > 0);
    }

    #[test]
    fn numeric_prompts_are_two_bytes_a_token_and_parse() {
        let b = numeric_prompt_body(1000);
        assert!(b.len() > 2000 && b.len() < 2100, "{}", b.len());
        let parsed =
            kvpick::request::parse(&b, Some(kvpick::request::ApiKind::Completions)).unwrap();
        assert_eq!(parsed.model, "llama");
    }

    #[test]
    fn large_bodies_get_fewer_variants() {
        assert_eq!(variants(1024), 64);
        assert_eq!(variants(8 << 20), 32);
        assert_eq!(variants(64 << 20), 4);
    }
}
