//! `kvpick-bench`: kvpick's benchmarks. Each subcommand prints a Markdown table
//! (default) or one JSON object (`--format json`) and writes SVG plots to `--plots`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use e2e::bench::{
    agreement, flood, instructions, lowreuse, overhead, overload, peer_epp, plot, replay, replicas,
    scale, sync,
};
use kvpick::config::scheduling::Scoring;
use kvpick::scheduler::ScoringMode;

// The allocator `kvpick` runs with, so `overhead` and `flood` measure kvpick as
// it runs (the no-op server, the same binary, runs with it too).
kvpick::global_allocator!();

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A Markdown table.
    Markdown,
    /// One JSON object.
    Json,
}

#[derive(Debug, Parser)]
#[command(about = "kvpick benchmarks: overhead, trace replay, scale")]
struct Cli {
    /// Output format.
    #[arg(long, global = true, value_enum, default_value = "markdown")]
    format: Format,
    /// Directory for SVG plots (created if missing); plots are skipped when unset.
    #[arg(long, global = true)]
    plots: Option<PathBuf>,
    /// Also write the JSON report to this file.
    #[arg(long, global = true)]
    save: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// The cells of a request-path benchmark: every body size at every endpoint count.
#[derive(Debug, clap::Args)]
struct Cells {
    /// Chat body sizes in bytes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,32768,225280,1048576,8388608"
    )]
    body_bytes: Vec<usize>,
    /// Endpoint counts.
    #[arg(long, value_delimiter = ',', default_value = "8,64,1024")]
    endpoints: Vec<usize>,
}

// Parsed once per run: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Decision latency and throughput of kvpick's ext_proc server next to a no-op server.
    Overhead {
        #[command(flatten)]
        cells: Cells,
        /// Measured seconds per cell and server.
        #[arg(long, default_value_t = 3.0)]
        duration: f64,
        /// Warm-up seconds before each measured slice (not measured).
        #[arg(long, default_value_t = 0.5)]
        warmup: f64,
        /// Slices each server's measured time is split into, the servers taking
        /// turns (order alternating), so passing load on the machine falls on both.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Concurrent streams.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// HTTP/2 connections shared by the streams.
        #[arg(long, default_value_t = 2)]
        connections: usize,
        /// kvpick's OpenTelemetry tracing, one cell each: `off`, `on` (its
        /// default sampling) or `all` (every request), exported over OTLP/gRPC
        /// to a receiver in this process.
        #[arg(long, value_enum, value_delimiter = ',', default_value = "off")]
        tracing: Vec<overhead::Tracing>,
        /// Leave out the peer EPP (run as a third server, over mock workers,
        /// in tracing-off cells when it is installed).
        #[arg(long)]
        no_peer: bool,
    },
    /// Instructions per request of kvpick's ext_proc server and the no-op server,
    /// counted by valgrind, this binary beside older ones in one run.
    Instructions {
        #[command(flatten)]
        cells: Cells,
        /// A baseline: `NAME=PATH` of another `kvpick-bench` (repeatable).
        #[arg(long = "against", value_parser = named_path)]
        against: Vec<(String, PathBuf)>,
        /// Body bytes the longer run of each cell sends in all.
        #[arg(long, default_value_t = 64 << 20)]
        bytes_per_run: usize,
        /// Directory for valgrind's output files.
        #[arg(long, default_value = "target/instructions")]
        work_dir: PathBuf,
        /// Times each count is taken; the table shows their median.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// This binary's kvpick with each `--scoring` listed, the first the one
        /// the ratios are of (every `--against` build runs its default).
        #[arg(long, value_enum, value_delimiter = ',', default_value = "heuristic")]
        scoring: Vec<Scoring>,
    },
    /// Decision latency of small requests alone and next to large ones, kvpick
    /// and the no-op server, in one run.
    Stall {
        /// Small (measured) body size in bytes.
        #[arg(long, default_value_t = 1024)]
        small_bytes: usize,
        /// Large (background) body size in bytes.
        #[arg(long, default_value_t = 8 << 20)]
        large_bytes: usize,
        /// Background streams sending large bodies.
        #[arg(long, default_value_t = 4)]
        large_streams: usize,
        /// Endpoints in kvpick's pool.
        #[arg(long, default_value_t = 64)]
        endpoints: usize,
        /// Measured seconds per server and load.
        #[arg(long, default_value_t = 3.0)]
        duration: f64,
        /// Warm-up seconds (not measured).
        #[arg(long, default_value_t = 0.5)]
        warmup: f64,
        /// Concurrent small-request streams.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
    },
    /// Peak RSS of kvpick and the no-op server while large numeric prompts run
    /// at once (`/v1/completions`, one-digit token ids).
    PeakRss {
        /// Token ids per prompt (12 M ≈ 23 MiB).
        #[arg(long, default_value_t = 12_000_000)]
        tokens: usize,
        /// Requests sent together.
        #[arg(long, default_value_t = 2)]
        concurrent: usize,
        /// Endpoints in kvpick's pool.
        #[arg(long, default_value_t = 8)]
        endpoints: usize,
    },
    /// The `kvpick` binary flooded by one worker's KV-event publisher: peak RSS
    /// against the ingest queue's byte budget, and how long another worker's
    /// events take meanwhile (fresh process per run).
    Flood {
        /// The `kvpick` binary (default: beside this one).
        #[arg(long)]
        kvpick: Option<PathBuf>,
        /// Runs.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Blocks per flooding `BlockStored` batch (30,000 ≈ 2 MiB).
        #[arg(long, default_value_t = 30_000)]
        blocks: usize,
        /// Seconds of flood per run.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Seconds RSS is watched after the flood stops.
        #[arg(long, default_value_t = 2.0)]
        settle: f64,
        /// kvpick's `--kv-events-max-queued-bytes`.
        #[arg(long, default_value_t = 256 << 20)]
        max_queued_bytes: u64,
    },
    /// How often the replay's `llm-d` policy picks as the real peer endpoint
    /// picker does on the same decisions (needs e2e/peers/install-gie-epp.sh).
    Agreement {
        /// Mock workers in the pool.
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Requests sent.
        #[arg(long, default_value_t = 2_000)]
        requests: usize,
        /// Prefix groups the requests share.
        #[arg(long, default_value_t = 12)]
        groups: usize,
        /// Seed of the prompts and of the re-implementation's tie-break.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// One server of an overhead cell, in its own process: prints its port, serves
    /// until stdin closes.
    #[command(hide = true)]
    OverheadServer {
        /// kvpick over this many endpoints.
        #[arg(long, default_value_t = 8)]
        endpoints: usize,
        /// The endpoints are mock workers on this port at the bench's loopback
        /// worker addresses, and kvpick scrapes their metrics.
        #[arg(long)]
        workers_port: Option<u16>,
        /// The no-op server instead of kvpick.
        #[arg(long)]
        noop: bool,
        /// kvpick's tracing (exported to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).
        #[arg(long, value_enum, default_value = "off")]
        tracing: overhead::Tracing,
        /// kvpick's `--scoring`.
        #[arg(long, value_enum, default_value = "heuristic")]
        scoring: Scoring,
    },
    /// Writes a seeded low-reuse chat trace (Mooncake format, 64-token blocks):
    /// short multi-turn chats of ~2k-token prompts sharing only a small system prompt.
    GenTrace(lowreuse::GenTraceArgs),
    /// Replays a Mooncake-format trace through routing policies against simulated
    /// workers (several capacities or speeds: one table of every run).
    Replay {
        #[command(flatten)]
        args: replay::ReplayArgs,
        /// Instead of the policy comparison: replay X times faster (and at 1×) with
        /// a mix of priorities, with and without flow control.
        #[arg(long)]
        overload: Option<f64>,
        /// With --overload: shares of high, normal and sheddable requests.
        #[arg(long, value_delimiter = ',', default_value = "0.2,0.5,0.3")]
        mix: Vec<f64>,
        /// With --overload: flow control's engine-queue threshold per worker.
        #[arg(long, default_value_t = 1.0)]
        queue_depth_threshold: f64,
        /// With --overload: flow control's queue TTL in seconds.
        #[arg(long, default_value_t = 60.0)]
        ttl: f64,
        /// Instead of the policy comparison: kvpick-approx as this many replicas
        /// (requests to them in turn), each count synced and unsynced, beside
        /// one replica (e.g. `2,4`).
        #[arg(long, value_delimiter = ',')]
        replicas: Vec<usize>,
        /// With --replicas: modelled propagation delay of a synced delta to the
        /// peers, ms (`kvpick-bench sync` measures the real one).
        #[arg(long, default_value_t = 1.0)]
        sync_delay_ms: f64,
        /// With --replicas: spread requests recorded on one timestamp over the gap
        /// to the next (a trace rounded to coarse buckets), for every replica count.
        #[arg(long)]
        spread_ties: bool,
        /// With --replicas: run every cell with this many tie-break seeds from
        /// --seed on; figures are means over them.
        #[arg(long, default_value_t = 1)]
        seeds: u64,
    },
    /// Replica sync against a real redis-server: propagation p50/p99, bytes and
    /// CPU per decision, beside the same decisions without sync (alternating rounds).
    Sync {
        /// The server (`redis://HOST:PORT`); default: start redis-server on a free port.
        #[arg(long)]
        redis: Option<String>,
        /// Replicas.
        #[arg(long, default_value_t = 3)]
        replicas: usize,
        /// Workers every replica routes over.
        #[arg(long, default_value_t = 1_024)]
        workers: usize,
        /// Target decisions per second, all replicas together.
        #[arg(long, default_value_t = 5_000.0)]
        rate: f64,
        /// Seconds of one round.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Rounds of each kind (baseline, sync, alternating).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Tokens of each prompt (a 512-token system prompt shared by all).
        #[arg(long, default_value_t = 2_048)]
        prompt_tokens: usize,
    },
    /// Index and scheduler at fleet scale: memory, lookup, ingest, churn.
    Scale {
        /// Workers.
        #[arg(long, default_value_t = 10_000)]
        endpoints: usize,
        /// Indexed blocks per worker (10,000 × 1,000 = 10 M).
        #[arg(long, default_value_t = 1_000)]
        blocks_per_endpoint: usize,
        /// Timed lookups and picks.
        #[arg(long, default_value_t = 200)]
        iterations: usize,
    },
}

fn emit<T: serde::Serialize>(
    format: Format,
    save: Option<&Path>,
    report: &T,
    markdown: String,
) -> anyhow::Result<()> {
    if let Some(path) = save {
        std::fs::write(path, serde_json::to_string_pretty(report)? + "\n")?;
    }
    match format {
        Format::Markdown => print!("{markdown}"),
        Format::Json => println!("{}", serde_json::to_string(report)?),
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(dir) = &cli.plots {
        std::fs::create_dir_all(dir)?;
    }
    match cli.command {
        Command::Overhead {
            cells: Cells {
                body_bytes,
                endpoints,
            },
            duration,
            warmup,
            rounds,
            concurrency,
            connections,
            tracing,
            no_peer,
        } => {
            let cfg = overhead::OverheadConfig {
                body_bytes,
                endpoints,
                tracing,
                duration: Duration::from_secs_f64(duration),
                warmup: Duration::from_secs_f64(warmup),
                rounds,
                concurrency,
                connections,
                server_exe: std::env::current_exe()?,
                peer: match (no_peer, peer_epp::installed()) {
                    (true, _) => None,
                    (false, Some(exe)) => Some(exe),
                    (false, None) => {
                        eprintln!(
                            "overhead: no peer EPP column: {} is not installed (e2e/peers/install-gie-epp.sh, or set {})",
                            peer_epp::PINNED,
                            peer_epp::BIN_ENV
                        );
                        None
                    }
                },
            };
            let report = tokio::runtime::Runtime::new()?.block_on(overhead::run(&cfg))?;
            if let Some(dir) = &cli.plots {
                plot::overhead(&report, &dir.join("overhead.svg"))?;
            }
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Instructions {
            cells: Cells {
                body_bytes,
                endpoints,
            },
            against,
            bytes_per_run,
            work_dir,
            rounds,
            scoring,
        } => {
            let this = std::env::current_exe()?;
            let mut servers: Vec<_> = scoring
                .iter()
                .map(|s| instructions::Server {
                    name: match scoring.len() {
                        1 => "this".to_string(),
                        _ => format!(
                            "this/{}",
                            s.to_possible_value()
                                .map_or_else(String::new, |v| v.get_name().to_string())
                        ),
                    },
                    exe: this.clone(),
                    scoring: s.mode(),
                })
                .collect();
            servers.extend(against.into_iter().map(|(name, exe)| instructions::Server {
                name,
                exe,
                scoring: ScoringMode::Heuristic,
            }));
            let cfg = instructions::InstructionsConfig {
                body_bytes,
                endpoints,
                servers,
                bytes_per_run,
                work_dir,
                rounds,
            };
            let report = tokio::runtime::Runtime::new()?.block_on(instructions::run(&cfg))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Stall {
            small_bytes,
            large_bytes,
            large_streams,
            endpoints,
            duration,
            warmup,
            concurrency,
        } => {
            let cfg = overhead::OverheadConfig {
                body_bytes: vec![small_bytes],
                endpoints: vec![endpoints],
                tracing: vec![overhead::Tracing::Off],
                duration: Duration::from_secs_f64(duration),
                warmup: Duration::from_secs_f64(warmup),
                rounds: 1,
                concurrency,
                connections: 1,
                server_exe: std::env::current_exe()?,
                peer: None,
            };
            let report = tokio::runtime::Runtime::new()?.block_on(overhead::stall(
                &cfg,
                small_bytes,
                large_bytes,
                large_streams,
                endpoints,
            ))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::PeakRss {
            tokens,
            concurrent,
            endpoints,
        } => {
            let report = tokio::runtime::Runtime::new()?.block_on(overhead::peak_rss(
                &std::env::current_exe()?,
                "/v1/completions",
                overhead::numeric_prompt_body(tokens),
                concurrent,
                endpoints,
            ))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Flood {
            kvpick,
            runs,
            blocks,
            seconds,
            settle,
            max_queued_bytes,
        } => {
            let kvpick = match kvpick {
                Some(p) => p,
                None => std::env::current_exe()?.with_file_name("kvpick"),
            };
            let cfg = flood::FloodConfig {
                kvpick,
                runs,
                blocks,
                seconds,
                settle,
                max_queued_bytes,
            };
            let report = tokio::runtime::Runtime::new()?.block_on(flood::run(&cfg))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Agreement {
            workers,
            requests,
            groups,
            seed,
        } => {
            let Some(exe) = peer_epp::installed() else {
                anyhow::bail!(
                    "{} is not installed: run e2e/peers/install-gie-epp.sh (or set {})",
                    peer_epp::PINNED,
                    peer_epp::BIN_ENV
                );
            };
            let cfg = agreement::AgreementConfig {
                workers,
                requests,
                groups,
                seed,
            };
            let report = tokio::runtime::Runtime::new()?.block_on(agreement::run(&exe, &cfg))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::OverheadServer {
            endpoints,
            workers_port,
            noop,
            tracing,
            scoring,
        } => {
            let kind = match noop {
                true => overhead::ServerKind::Noop,
                false => overhead::ServerKind::Kvpick {
                    endpoints,
                    tracing,
                    workers_port,
                    scoring: scoring.mode(),
                },
            };
            tokio::runtime::Runtime::new()?.block_on(overhead::serve_until_stdin_closes(kind))
        }
        Command::GenTrace(args) => {
            let n = args.write()?;
            eprintln!("gen-trace: {n} requests written to {}", args.out.display());
            Ok(())
        }
        Command::Replay {
            args,
            overload: factor,
            mix,
            queue_depth_threshold,
            ttl,
            replicas: counts,
            sync_delay_ms,
            spread_ties,
            seeds,
        } => {
            let (name, mut requests) = args.load()?;
            if spread_ties && !counts.is_empty() {
                e2e::bench::trace::spread_ties(&mut requests);
            }
            let configs = args.configs();
            if !counts.is_empty() {
                let rc = replicas::ReplicaConfig {
                    replicas: counts,
                    delay: Duration::from_secs_f64(sync_delay_ms / 1000.0),
                    seeds: (args.seed..).take(seeds.max(1) as usize).collect(),
                    dump_requests: args.dump_requests.clone(),
                };
                let report = replicas::ReplicaReport {
                    workers: args.workers,
                    delay_ms: sync_delay_ms,
                    seeds: rc.seeds.clone(),
                    cells: configs
                        .iter()
                        .map(|cfg| replicas::cell(&name, &requests, cfg, &rc))
                        .collect(),
                };
                return emit(cli.format, cli.save.as_deref(), &report, report.markdown());
            }
            if let Some(factor) = factor {
                let mut shares = [0.0; 3];
                for (s, m) in shares.iter_mut().zip(&mix) {
                    *s = *m;
                }
                let report = overload::run(
                    &requests,
                    &overload::OverloadConfig {
                        factor,
                        workers: args.workers,
                        capacity_blocks: configs[0].capacity_blocks,
                        model: args.model(),
                        mix: shares,
                        queue_depth_threshold,
                        ttl: Duration::from_secs_f64(ttl),
                        seed: args.seed,
                    },
                );
                return emit(cli.format, cli.save.as_deref(), &report, report.markdown());
            }
            if let [cfg] = &configs[..] {
                let report = replay::run(&name, &requests, cfg, replay::builtin(cfg));
                if let Some(dir) = &args.dump_requests {
                    replay::write_requests(dir, std::slice::from_ref(&report))?;
                }
                if let Some(dir) = &cli.plots {
                    plot::replay_hit_rate(&report, &dir.join("replay-hit-rate.svg"))?;
                    plot::replay_ttft(&report, &dir.join("replay-ttft.svg"))?;
                }
                return emit(cli.format, cli.save.as_deref(), &report, report.markdown());
            }
            let report = replay::matrix(&name, &requests, &configs, &replay::builtin);
            if let Some(dir) = &args.dump_requests {
                replay::write_requests(dir, &report.runs)?;
            }
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Sync {
            redis,
            replicas,
            workers,
            rate,
            seconds,
            rounds,
            prompt_tokens,
        } => {
            let cfg = sync::SyncBenchConfig {
                redis,
                replicas,
                workers,
                rate,
                round: Duration::from_secs_f64(seconds),
                rounds,
                prompt_tokens,
                ..sync::SyncBenchConfig::default()
            };
            let report = tokio::runtime::Runtime::new()?.block_on(sync::run(&cfg))?;
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
        Command::Scale {
            endpoints,
            blocks_per_endpoint,
            iterations,
        } => {
            let report = scale::run(&scale::ScaleConfig {
                endpoints,
                blocks_per_endpoint,
                iterations,
            });
            emit(cli.format, cli.save.as_deref(), &report, report.markdown())
        }
    }
}

/// `NAME=PATH` of `--against`.
fn named_path(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!("expected NAME=PATH, got {s:?}")),
    }
}
