//! `kvpick-anchors aisim`: routing quality in NVIDIA's AISimulate (`aisimulate-core`
//! 0.13.0), kvpick beside Dynamo's KV router and round robin, one engine
//! configuration, one trace, one run.
//!
//! Every point of the matrix (trace × KV capacity × load) replays the same Mooncake
//! trace once per policy (`--policy` picks some) through the same engine
//! configuration:
//! - `round-robin` and `dynamo`: `dynamo-mocker` 1.6.1's own entry point,
//!   `simulate_trace_file_with_router_mode(.., RoundRobin | KvRouter)` (Dynamo's
//!   KV router with its default `KvRouterConfig`);
//! - `kvpick-approx` and `kvpick-precise`: the same trace loaded as `dynamo-mocker`
//!   loads it (`Trace::from_mooncake`, session starts normalised, arrivals sped up,
//!   one request per row with the same synthetic output plan), the engine
//!   configuration that `dynamo-mocker` builds from the same `MockerConfig`
//!   (polynomial perf model: no external timing provider), run by
//!   `aisimulate_core::replay::Replayer::with_composition` with kvpick's
//!   composition ([`placement`]);
//! - `fewest-in-flight` and `llm-d`: `kvpick-bench replay`'s policies on the same
//!   trait, engines and scrape ([`peer`]).
//!
//! Figures are AISimulate's own report: TTFT p50/p99, end-to-end p50, and the
//! engines' prefix-cache reuse (`prefix_cache_reused_ratio`: prompt tokens served
//! from cache over all prompt tokens), which is the hit rate of each policy.
//! `--dump-requests` writes each run's per-request records beside them, to read
//! which requests make a tail.

mod fixed_pool;
pub mod peer;
pub mod placement;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use aisimulate_core::engine::{Backend, EngineConfig, EngineLaunchConfig};
use aisimulate_core::replay::loadgen::Trace;
use aisimulate_core::replay::loadgen::TraceFileFormat;
use aisimulate_core::replay::{
    ProviderSpec, ReplayAdapters, ReplayComposition, ReplayEngineConfig, ReplayEngineFactory,
    ReplayReport, ReplayRuntimeInput, ReplaySpec, ReplayTopology, Replayer, WorkerPoolSpec,
    CURRENT_REPLAY_SPEC_VERSION,
};
use anyhow::Context;
use dynamo_mocker::common::protocols::MockerConfig;
use dynamo_mocker::replay::{
    simulate_trace_file_with_router_mode_and_format_and_runtime_observers, ReplayRouterMode,
    ReplayRuntimeObservers, ReplayTelemetryOptions, SlaThresholds,
};
use e2e::bench::replay::{PredictionError, WARM_UP_COMPLETIONS};
use kvpick::endpoints::Snapshot;

use aisimulate_core::replay::DirectRequest;
use peer::{Peer, PeerComposition, PeerSettings};
use placement::{KvpickComposition, KvpickSettings, LoadStats, Mode, Scrapes};

/// Options of `kvpick-anchors aisim`.
#[derive(clap::Args, Debug, Clone)]
pub struct AisimArgs {
    /// Mooncake-format traces (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long = "trace", required = true)]
    traces: Vec<PathBuf>,
    /// Tokens per trace hash id: one value for every trace, or one per `--trace`
    /// in order (Mooncake's traces: 512).
    #[arg(long = "trace-block-size", value_delimiter = ',', default_values_t = [512])]
    trace_block_sizes: Vec<usize>,
    /// Simulated workers: one value for every trace, or one per `--trace` in order.
    #[arg(long = "workers", value_delimiter = ',', default_values_t = [8])]
    workers: Vec<usize>,
    /// Engine GPU KV blocks per worker, one matrix column group per value.
    #[arg(long = "num-gpu-blocks", value_delimiter = ',', default_values_t = [4096, 16384])]
    num_gpu_blocks: Vec<usize>,
    /// Arrival speed-ups (load levels): the trace's arrival times are divided by each.
    #[arg(long = "speedup", value_delimiter = ',', default_values_t = [1.0, 2.0, 4.0])]
    speedups: Vec<f64>,
    /// Engine KV block size in tokens.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Engine `max_num_seqs`, one matrix pass per value.
    #[arg(long = "max-num-seqs", value_delimiter = ',', default_values_t = [256])]
    max_num_seqs: Vec<usize>,
    /// Engine `max_num_batched_tokens` (per-step token budget; chunked prefill on).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// How often kvpick's scrape of the engines' gauges refreshes, in virtual ms.
    #[arg(long, default_value_t = 50.0)]
    scrape_interval_ms: f64,
    /// Seed of kvpick's tie-break.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the report (markdown) here too.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run only these policies (default: all six).
    #[arg(long = "policy", value_delimiter = ',')]
    policies: Vec<String>,
    /// Write each run's per-request records (AISimulate's `PerRequestRecord`,
    /// JSON lines) to `DIR/{trace}-{blocks}-{speedup}-{policy}.jsonl`.
    #[arg(long = "dump-requests", value_name = "DIR")]
    dump_requests: Option<PathBuf>,
}

/// A trace file, the tokens per hash id it was written with, and the workers
/// it runs on.
#[derive(Debug, Clone, Copy)]
pub struct TraceFile<'a> {
    pub path: &'a Path,
    pub block_size: usize,
    pub workers: usize,
}

impl AisimArgs {
    /// The traces with their block sizes and workers.
    fn trace_files(&self) -> anyhow::Result<Vec<TraceFile<'_>>> {
        let (sizes, workers) = (&self.trace_block_sizes, &self.workers);
        for (flag, n) in [("--trace-block-size", sizes.len()), ("--workers", workers.len())] {
            anyhow::ensure!(
                n == 1 || n == self.traces.len(),
                "{flag} takes one value or one per --trace ({} traces, {n} values)",
                self.traces.len(),
            );
        }
        Ok(self
            .traces
            .iter()
            .enumerate()
            .map(|(i, path)| TraceFile {
                path,
                block_size: sizes[i.min(sizes.len() - 1)],
                workers: workers[i.min(workers.len() - 1)],
            })
            .collect())
    }

    /// Whether `policy` is among those `--policy` selected.
    fn runs(&self, policy: &str) -> bool {
        self.policies.is_empty() || self.policies.iter().any(|p| p == policy)
    }

    /// Writes `report`'s per-request records if `--dump-requests` asked for them.
    fn dump(&self, report: &ReplayReport, point: &str, policy: &str) -> anyhow::Result<()> {
        let Some(dir) = &self.dump_requests else {
            return Ok(());
        };
        let path = dir.join(format!("{point}-{policy}.jsonl"));
        let write = || -> anyhow::Result<()> {
            std::fs::create_dir_all(dir)?;
            let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
            for record in &report.per_request {
                serde_json::to_writer(&mut out, record)?;
                out.write_all(b"\n")?;
            }
            Ok(out.flush()?)
        };
        write().with_context(|| format!("writing {}", path.display()))
    }

    /// The engine configuration every policy of a point runs on.
    fn mocker_config(
        &self,
        num_gpu_blocks: usize,
        max_num_seqs: usize,
    ) -> anyhow::Result<MockerConfig> {
        let engine = EngineConfig {
            backend: Backend::Vllm,
            num_gpu_blocks,
            block_size: self.block_size,
            max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            ..EngineConfig::default()
        };
        MockerConfig {
            engine: EngineLaunchConfig {
                engine,
                num_gpu_blocks_is_explicit: true,
                ..EngineLaunchConfig::default()
            },
            ..MockerConfig::default()
        }
        .normalized()
    }
}

/// One policy's figures at one point.
#[derive(Debug, Clone)]
pub struct Figures {
    pub policy: String,
    pub completed: usize,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub hit_rate: f64,
    /// Mean max/mean requests per worker over the busy telemetry samples.
    pub spread: f64,
    /// Mean requests waiting in all engines over the busy samples.
    pub waiting: f64,
    pub wall_s: f64,
    /// How well kvpick's latency models predicted TTFT (predicted mode).
    pub prediction_error: Option<PredictionError>,
}

impl Figures {
    fn of(policy: &str, report: &ReplayReport, load: LoadStats, wall_s: f64) -> Self {
        Figures {
            policy: policy.to_string(),
            completed: report.request_counts.completed_requests,
            requests: report.request_counts.num_requests,
            ttft_p50_ms: report.latency.ttft.median_ms,
            ttft_p99_ms: report.latency.ttft.p99_ms,
            e2e_p50_ms: report.latency.e2e.median_ms,
            hit_rate: report.prefix_cache_reused_ratio,
            spread: load.spread(),
            waiting: load.waiting(),
            wall_s,
            prediction_error: None,
        }
    }
}

/// The replay spec of a point with placement `provider`, and the trace's requests
/// as `dynamo-mocker` loads them: `Trace::from_mooncake`, session starts
/// normalised, arrivals divided by `speedup`, one request per row, sorted and
/// shifted so the first arrives at 0. The engine is the one `dynamo-mocker`
/// builds from `args` (its `aggregated_replay_setup`); `kv_token_ids` makes the
/// engines publish token ids with their KV events, as vLLM does.
fn replay_input(
    opts: &AisimArgs,
    args: &MockerConfig,
    trace: TraceFile<'_>,
    speedup: f64,
    provider: &str,
    kv_token_ids: bool,
) -> anyhow::Result<(ReplaySpec, Vec<DirectRequest>)> {
    let mut rank = args.engine.engine.clone();
    rank.emit_kv_token_ids = kv_token_ids;
    // The runtime sets `emit_kv_events` from the composition's observation.
    rank.emit_kv_events = kv_token_ids;
    let engine = ReplayEngineConfig {
        kv_eviction_policy: Default::default(),
        dp_size: args.dp_size,
        tensor_parallel_size: u32::try_from(args.tensor_parallel_size)?,
        prefill_context_parallel_size: 1,
        num_gpu_blocks_is_explicit: Some(true),
        rank,
        prefill: None,
        decode: None,
    };
    let spec = ReplaySpec {
        version: CURRENT_REPLAY_SPEC_VERSION,
        topology: ReplayTopology::Aggregated {
            workers: WorkerPoolSpec {
                initial_workers: trace.workers,
                startup_delay_ms: 0.0,
            },
        },
        engine: serde_json::to_value(engine)?,
        adapters: ReplayAdapters {
            placement: ProviderSpec {
                provider: provider.into(),
                config: serde_json::Value::Null,
            },
            scaling: ProviderSpec::no_scaling(),
        },
        max_sim_time_ms: None,
        max_in_flight: None,
        record_per_request: opts.dump_requests.is_some(),
        sla: Default::default(),
        requests: Vec::new(),
    };
    let mut requests = Trace::from_mooncake(trace.path, trace.block_size)?
        .normalize_session_starts()?
        .speed_up_timing(speedup)?
        .to_single_turn_requests()?;
    requests.sort_by(|a, b| {
        let (a, b) = (a.arrival_timestamp_ms, b.arrival_timestamp_ms);
        a.unwrap_or(0.0).total_cmp(&b.unwrap_or(0.0))
    });
    let first = requests
        .first()
        .and_then(|r| r.arrival_timestamp_ms)
        .context("the trace has no request")?;
    for r in &mut requests {
        r.arrival_timestamp_ms = r.arrival_timestamp_ms.map(|t| t - first);
    }
    Ok((spec, requests))
}

/// Runs `requests` on `spec`'s engines through `composition`, `scrapes`
/// sampling the engines' gauges every `opts.scrape_interval_ms`.
fn replay<C: ReplayComposition>(
    opts: &AisimArgs,
    spec: ReplaySpec,
    requests: Vec<DirectRequest>,
    composition: C,
    scrapes: &Scrapes,
) -> anyhow::Result<ReplayReport> {
    Ok(
        Replayer::with_composition(spec, ReplayEngineFactory::new(), composition)?
            .with_runtime_input(ReplayRuntimeInput::Requests(requests.into()))
            .with_telemetry_observer(opts.scrape_interval_ms, Box::new(scrapes.clone()))?
            .run()?,
    )
}

/// Replays `trace`, arrivals sped up `speedup` times, through kvpick in `mode`
/// on `args`' engine, with `opts`' fleet, scrape interval and seed.
pub fn run_kvpick(
    opts: &AisimArgs,
    args: &MockerConfig,
    trace: TraceFile<'_>,
    speedup: f64,
    mode: Mode,
) -> anyhow::Result<KvpickRun> {
    // vLLM publishes token ids with its BlockStored events; kvpick keys blocks by them.
    let (spec, requests) = replay_input(opts, args, trace, speedup, "kvpick", true)?;
    let scrapes = Scrapes::default();
    let settings = KvpickSettings {
        mode,
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        seed: opts.seed,
    };
    let composition = KvpickComposition::new(settings, scrapes.clone());
    let endpoints = composition.endpoints();
    let placed = composition.placed();
    let feed = composition.feed();
    let report = replay(opts, spec, requests, composition, &scrapes)?;
    let endpoints = endpoints
        .lock()
        .map_err(|_| anyhow::anyhow!("endpoint handle poisoned"))?
        .take()
        .context("the replay built no placement")?;
    let placed = placed
        .lock()
        .map_err(|_| anyhow::anyhow!("placed handle poisoned"))?
        .clone();
    let prediction_error = feed
        .lock()
        .map_err(|_| anyhow::anyhow!("feed handle poisoned"))?
        .error();
    Ok(KvpickRun {
        report,
        endpoints,
        scrapes,
        placed,
        prediction_error,
    })
}

/// Replays `trace` through Dynamo's KV router or round robin with
/// `dynamo-mocker`'s own entry point (default `KvRouterConfig`), the load
/// figures sampled as kvpick's scrape samples them.
pub fn run_dynamo(
    opts: &AisimArgs,
    args: &MockerConfig,
    trace: TraceFile<'_>,
    speedup: f64,
    mode: ReplayRouterMode,
) -> anyhow::Result<(ReplayReport, LoadStats)> {
    let scrapes = Scrapes::default();
    let observers = ReplayRuntimeObservers {
        scaling_policy: None,
        telemetry: Some(ReplayTelemetryOptions {
            sample_interval_ms: opts.scrape_interval_ms,
            observer: Box::new(scrapes.clone()),
        }),
    };
    let report = simulate_trace_file_with_router_mode_and_format_and_runtime_observers(
        args.clone(),
        None,
        None,
        trace.path,
        trace.block_size,
        trace.workers,
        speedup,
        mode,
        TraceFileFormat::Mooncake,
        0.0,
        0,
        opts.dump_requests.is_some(),
        None,
        None,
        SlaThresholds::default(),
        observers,
    )?;
    Ok((report, scrapes.stats()))
}

/// Replays `trace` through `peer` on the same engine, reading the same scrape.
pub fn run_peer(
    opts: &AisimArgs,
    args: &MockerConfig,
    trace: TraceFile<'_>,
    speedup: f64,
    peer: Peer,
) -> anyhow::Result<(ReplayReport, LoadStats)> {
    let (spec, requests) = replay_input(opts, args, trace, speedup, peer.name(), false)?;
    let scrapes = Scrapes::default();
    let settings = PeerSettings {
        peer,
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        seed: opts.seed,
    };
    let composition = PeerComposition::new(settings, scrapes.clone());
    let report = replay(opts, spec, requests, composition, &scrapes)?;
    anyhow::ensure!(
        scrapes.workers() == trace.workers,
        "{} read gauges of {} of {} workers",
        peer.name(),
        scrapes.workers(),
        trace.workers
    );
    Ok((report, scrapes.stats()))
}

/// What a kvpick replay leaves: AISimulate's report, kvpick's endpoints and
/// scrapes as the run left them, how many requests it placed on each worker,
/// and how well its latency models predicted TTFT (predicted mode).
pub struct KvpickRun {
    pub report: ReplayReport,
    pub endpoints: Arc<Snapshot>,
    pub scrapes: Scrapes,
    pub placed: Vec<usize>,
    pub prediction_error: Option<PredictionError>,
}

impl KvpickRun {
    /// The run's figures count only if every request completed, kvpick read
    /// every engine's gauges and every booking ended with its request.
    fn check(&self, workers: usize) -> anyhow::Result<()> {
        let counts = &self.report.request_counts;
        anyhow::ensure!(
            counts.completed_requests == counts.num_requests,
            "{} of {} requests completed",
            counts.completed_requests,
            counts.num_requests
        );
        // Not an error: at light load with little reuse, kvpick may need fewer
        // workers than the fleet has; the report shows it beside the figures.
        let idle = self.placed.iter().filter(|&&n| n == 0).count() + workers - self.placed.len();
        if idle > 0 {
            eprintln!("aisim: kvpick placed nothing on {idle} of {workers} workers");
        }
        let scraped = self.scrapes.workers();
        anyhow::ensure!(
            scraped == workers,
            "kvpick read gauges of {scraped} of {workers} workers"
        );
        let left: u32 = self
            .endpoints
            .endpoints
            .iter()
            .map(|e| e.in_flight_total())
            .sum();
        anyhow::ensure!(left == 0, "{left} bookings outlived their requests");
        Ok(())
    }
}

/// Runs the matrix and prints it (and writes it to `--out`).
pub fn run(args: AisimArgs) -> anyhow::Result<()> {
    let mut md = String::new();
    writeln!(md, "# kvpick in AISimulate\n")?;
    writeln!(
        md,
        "Engine (every policy, every point): AISimulate vLLM backend, block size {} tokens, \
         `max_num_batched_tokens` {} (chunked prefill on, prefix caching on), polynomial perf \
         model (`dynamo-mocker`'s default `PerfModel`, no external timing provider), dp 1, tp 1; \
         workers, `num_gpu_blocks` and `max_num_seqs` per table. kvpick reads the engines' \
         gauges every {} ms of virtual time.\n",
        args.block_size, args.max_num_batched_tokens, args.scrape_interval_ms,
    )?;
    writeln!(
        md,
        "`speedup` divides the trace's arrival times. TTFT and e2e in ms; hit rate = \
         AISimulate's `prefix_cache_reused_ratio`; pred. error = median |predicted − actual| / \
         actual TTFT of `kvpick-predicted`'s decisions after its first {WARM_UP_COMPLETIONS} \
         first tokens. Verdicts: each kvpick mode's TTFT over the better of `dynamo` and \
         `round-robin` and over `fewest-in-flight`, its hit rate over `dynamo`'s (≤ 1 on TTFT \
         and ≥ 1 on hit rate is a lead). `fewest-in-flight` and `llm-d` are `kvpick-bench \
         replay`'s policies on the same engines and the same scrape.\n"
    )?;
    let mut points = Vec::new();
    for trace in args.trace_files()? {
        let name = trace
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for &seqs in &args.max_num_seqs {
            for &blocks in &args.num_gpu_blocks {
                let config = args.mocker_config(blocks, seqs)?;
                writeln!(
                    md,
                    "## {name} ({} tokens a hash id), {} workers, num_gpu_blocks {blocks}, \
                     max_num_seqs {seqs}\n",
                    trace.block_size, trace.workers
                )?;
                writeln!(
                    md,
                    "| speedup | policy | completed | TTFT p50 | TTFT p99 | e2e p50 | hit rate | spread | waiting | pred. error | wall s |"
                )?;
                writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|")?;
                let mut verdicts = Vec::new();
                for &speedup in &args.speedups {
                    let point = match seqs {
                        256 => format!("{name}-{blocks}-{speedup}"),
                        _ => format!("{name}-{blocks}-{seqs}seqs-{speedup}"),
                    };
                    let rows = run_point(&args, &config, trace, speedup, &name, &point)?;
                    for f in &rows {
                        writeln!(
                            md,
                            "| {speedup} | {} | {}/{} | {:.0} | {:.0} | {:.0} | {:.3} | {:.2} | {:.1} | {} | {:.1} |",
                            f.policy,
                            f.completed,
                            f.requests,
                            f.ttft_p50_ms,
                            f.ttft_p99_ms,
                            f.e2e_p50_ms,
                            f.hit_rate,
                            f.spread,
                            f.waiting,
                            f.prediction_error
                                .map_or("–".into(), |e| format!("{:.3}", e.median)),
                            f.wall_s
                        )?;
                    }
                    verdicts.push((speedup, verdict(&rows)));
                    eprintln!("{point}: done");
                    points.push(Point {
                        label: format!(
                            "{name}, {} w, {blocks} blocks, {seqs} seqs, {speedup}×",
                            trace.workers
                        ),
                        rows,
                    });
                }
                writeln!(md)?;
                for (speedup, v) in verdicts {
                    writeln!(md, "- speedup {speedup}: {v}")?;
                }
                writeln!(md)?;
            }
        }
    }
    md.push_str(&ratio_table(&points));
    print!("{md}");
    if let Some(path) = &args.out {
        std::fs::write(path, &md)?;
    }
    Ok(())
}

/// Every policy `args` selects at one point, in report order, each run checked.
fn run_point(
    args: &AisimArgs,
    config: &MockerConfig,
    trace: TraceFile<'_>,
    speedup: f64,
    name: &str,
    point: &str,
) -> anyhow::Result<Vec<Figures>> {
    let mut rows = Vec::new();
    for (policy, mode) in [
        ("round-robin", ReplayRouterMode::RoundRobin),
        ("dynamo", ReplayRouterMode::KvRouter),
    ] {
        if !args.runs(policy) {
            continue;
        }
        let t = Instant::now();
        let (report, load) = run_dynamo(args, config, trace, speedup, mode)
            .with_context(|| format!("{policy} on {name}"))?;
        let wall = t.elapsed().as_secs_f64();
        args.dump(&report, point, policy)?;
        rows.push(Figures::of(policy, &report, load, wall));
    }
    for peer in [Peer::FewestInFlight, Peer::LlmD] {
        if !args.runs(peer.name()) {
            continue;
        }
        let t = Instant::now();
        let (report, load) = run_peer(args, config, trace, speedup, peer)
            .with_context(|| format!("{} on {name}", peer.name()))?;
        let wall = t.elapsed().as_secs_f64();
        args.dump(&report, point, peer.name())?;
        rows.push(Figures::of(peer.name(), &report, load, wall));
    }
    for mode in Mode::ALL {
        if !args.runs(mode.name()) {
            continue;
        }
        let t = Instant::now();
        let run = run_kvpick(args, config, trace, speedup, mode)
            .with_context(|| format!("{} on {name}", mode.name()))?;
        run.check(trace.workers)?;
        eprintln!("{} placed per worker: {:?}", mode.name(), run.placed);
        let wall = t.elapsed().as_secs_f64();
        args.dump(&run.report, point, mode.name())?;
        rows.push(Figures {
            prediction_error: run.prediction_error,
            ..Figures::of(mode.name(), &run.report, run.scrapes.stats(), wall)
        });
    }
    for f in &rows {
        anyhow::ensure!(
            f.completed == f.requests,
            "{} completed {} of {} requests on {name}",
            f.policy,
            f.completed,
            f.requests
        );
    }
    Ok(rows)
}

/// One point of the matrix: its label and every policy's figures.
struct Point {
    label: String,
    rows: Vec<Figures>,
}

/// A figure a kvpick mode is held to: its name and how to read it.
type Held = (&'static str, fn(&Figures) -> f64);

/// The figures a kvpick mode is held to: TTFT p50, TTFT p99, e2e p50.
const HELD: [Held; 3] = [
    ("TTFT p50", |f| f.ttft_p50_ms),
    ("TTFT p99", |f| f.ttft_p99_ms),
    ("e2e p50", |f| f.e2e_p50_ms),
];

/// Each kvpick mode's [`HELD`] figures over the best other policy's at each
/// point (the least of that figure among the policies not named `kvpick*`),
/// their geometric means over the points, and the points where a ratio is
/// above 1.05.
fn ratio_table(points: &[Point]) -> String {
    let modes: Vec<&str> = Mode::ALL
        .iter()
        .map(|m| m.name())
        .filter(|m| points.iter().any(|p| p.rows.iter().any(|f| f.policy == *m)))
        .collect();
    if modes.is_empty() || points.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "## Ratios to the best other policy\n\nEach kvpick mode's TTFT p50, TTFT p99 and e2e \
         p50 over the least of that figure among the other policies at the same point (below 1: \
         kvpick is ahead); geometric mean over the points; pred. error as above.\n\n| point |",
    );
    let mut rule = String::from("|---|");
    for m in &modes {
        for (held, _) in HELD {
            write!(md, " {m} {held} |").ok();
            rule.push_str("---|");
        }
    }
    md.push_str(" pred. error |\n");
    rule.push_str("---|\n");
    md.push_str(&rule);
    let mut logs = vec![[0.0f64; 3]; modes.len()];
    let mut over = vec![[0usize; 3]; modes.len()];
    let mut counted = vec![0usize; modes.len()];
    for p in points {
        write!(md, "| {} |", p.label).ok();
        let others: Vec<&Figures> = p
            .rows
            .iter()
            .filter(|f| !f.policy.starts_with("kvpick"))
            .collect();
        for (i, m) in modes.iter().enumerate() {
            let k = p.rows.iter().find(|f| f.policy == *m);
            for (j, (_, get)) in HELD.iter().enumerate() {
                let best = others.iter().map(|f| get(f)).fold(f64::INFINITY, f64::min);
                match k.map(|k| get(k) / best).filter(|r| r.is_finite() && *r > 0.0) {
                    Some(r) => {
                        logs[i][j] += r.ln();
                        over[i][j] += usize::from(r > 1.05);
                        if j == 0 {
                            counted[i] += 1;
                        }
                        write!(md, " {r:.2} |").ok();
                    }
                    None => md.push_str(" – |"),
                }
            }
        }
        let error = p
            .rows
            .iter()
            .find_map(|f| f.prediction_error)
            .map_or("–".into(), |e| format!("{:.3}", e.median));
        writeln!(md, " {error} |").ok();
    }
    md.push_str("| **geometric mean** |");
    for (i, _) in modes.iter().enumerate() {
        for l in logs[i] {
            write!(md, " **{:.3}** |", (l / counted[i].max(1) as f64).exp()).ok();
        }
    }
    md.push_str(" |\n| points above 1.05× |");
    for (i, _) in modes.iter().enumerate() {
        for n in over[i] {
            write!(md, " {n} of {} |", counted[i]).ok();
        }
    }
    md.push_str(" |\n\n");
    md
}

/// Each kvpick mode against the peers at one point, as ratios: TTFT over the
/// better of `dynamo` and `round-robin`, hit rate over `dynamo`'s, TTFT over
/// `fewest-in-flight`'s.
fn verdict(rows: &[Figures]) -> String {
    let get = |p: &str| rows.iter().find(|f| f.policy == p);
    let (Some(d), Some(r), Some(f)) = (get("dynamo"), get("round-robin"), get("fewest-in-flight"))
    else {
        return "incomplete".into();
    };
    let best_p50 = d.ttft_p50_ms.min(r.ttft_p50_ms);
    let best_p99 = d.ttft_p99_ms.min(r.ttft_p99_ms);
    let mut out = Vec::new();
    for mode in Mode::ALL {
        let Some(k) = get(mode.name()) else {
            continue;
        };
        out.push(format!(
            "{}: TTFT p50 {:.2}×, p99 {:.2}× the better of dynamo and round-robin, \
             hit rate {:.2}× dynamo's; TTFT p50 {:.2}×, p99 {:.2}× fewest-in-flight's",
            mode.name(),
            k.ttft_p50_ms / best_p50,
            k.ttft_p99_ms / best_p99,
            k.hit_rate / d.hit_rate,
            k.ttft_p50_ms / f.ttft_p50_ms,
            k.ttft_p99_ms / f.ttft_p99_ms,
        ));
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use dynamo_mocker::replay::simulate_trace_file_with_router_mode;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: AisimArgs,
    }

    /// A Mooncake trace of `groups` six-block shared prefixes, each request one of
    /// them plus a block of its own, one arrival every 200 ms.
    fn grouped_trace(groups: u32, requests: u32) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "kvpick-aisim-{}-{groups}-{requests}.jsonl",
            std::process::id()
        ));
        let mut text = String::new();
        for i in 0..requests {
            // Scrambled, so no fixed rotation of workers sees only a few groups.
            let g = ((u64::from(i) * 2_654_435_761) >> 7) as u32 % groups;
            let mut ids: Vec<u32> = (0..6).map(|b| g * 100 + b).collect();
            ids.push(100_000 + i);
            writeln!(
                text,
                r#"{{"timestamp": {}, "input_length": {}, "output_length": 8, "hash_ids": {:?}}}"#,
                i * 200,
                7 * 512,
                ids
            )
            .unwrap();
        }
        std::fs::write(&path, text).unwrap();
        path
    }

    /// `--policy` runs only the policies named, and `--dump-requests` writes one
    /// record per request of each run it makes, with the request's TTFT.
    #[test]
    fn dump_requests_writes_every_request_of_the_policies_run() {
        let path = grouped_trace(4, 40);
        let dir = std::env::temp_dir().join(format!("kvpick-aisim-dump-{}", std::process::id()));
        let trace = path.to_str().unwrap();
        let cli = Cli::parse_from([
            "aisim",
            "--trace",
            trace,
            "--workers",
            "4",
            "--num-gpu-blocks",
            "256",
            "--speedup",
            "1",
            "--policy",
            "round-robin,kvpick-precise",
            "--dump-requests",
            dir.to_str().unwrap(),
        ]);
        run(cli.args).unwrap();
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            files,
            [
                format!("{name}-256-1-kvpick-precise.jsonl"),
                format!("{name}-256-1-round-robin.jsonl"),
            ]
        );
        for file in files {
            let text = std::fs::read_to_string(dir.join(&file)).unwrap();
            let records: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_eq!(records.len(), 40, "{file}");
            assert!(
                records.iter().all(|r| r["ttft_ms"].as_f64().is_some()),
                "{file}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
        std::fs::remove_file(path).unwrap();
    }

    fn args(trace: &Path) -> AisimArgs {
        let trace = trace.to_str().unwrap();
        Cli::parse_from(["aisim", "--trace", trace, "--workers", "4"]).args
    }

    /// Sixteen prefixes of 48 engine blocks on four workers of 256 blocks: a
    /// worker holds about four, so only placement that keeps each prefix on one
    /// worker reuses them. kvpick's hits come from its index (precise: the
    /// engines' KV events through kvpick's ingest; approximate: its decisions):
    /// it beats round robin and fewest-in-flight (placement blind to prefixes,
    /// on the same engines and scrape) by a wide margin, while still using every
    /// worker; it read every engine's gauges, and every booking ended with its
    /// request.
    #[test]
    fn kvpick_reuses_prefixes_load_only_placement_thrashes_and_bookings_end() {
        let path = grouped_trace(16, 320);
        let opts = args(&path);
        let trace = TraceFile {
            path: &path,
            block_size: 512,
            workers: 4,
        };
        let config = opts.mocker_config(256, 256).unwrap();
        let rr = simulate_trace_file_with_router_mode(
            config.clone(),
            None,
            None,
            &path,
            512,
            4,
            1.0,
            ReplayRouterMode::RoundRobin,
        )
        .unwrap();
        let (fewest, _) = run_peer(&opts, &config, trace, 1.0, Peer::FewestInFlight).unwrap();
        assert_eq!(fewest.request_counts.completed_requests, 320);
        let blind = rr
            .prefix_cache_reused_ratio
            .max(fewest.prefix_cache_reused_ratio);
        for mode in Mode::ALL {
            let run = run_kvpick(&opts, &config, trace, 1.0, mode).unwrap();
            let counts = &run.report.request_counts;
            assert_eq!(counts.completed_requests, 320, "{}", mode.name());
            assert!(
                run.report.prefix_cache_reused_ratio > blind + 0.2,
                "{}: hit rate {} vs round robin {} and fewest-in-flight {}",
                mode.name(),
                run.report.prefix_cache_reused_ratio,
                rr.prefix_cache_reused_ratio,
                fewest.prefix_cache_reused_ratio
            );
            run.check(4).unwrap();
        }
        std::fs::remove_file(path).unwrap();
    }
}
