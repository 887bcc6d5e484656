//! `kvpick-demo`: kvpick in standalone mode, 4 mock workers and the test
//! gateway on 127.0.0.1, a short multi-turn chat workload through them, a table
//! of what each worker saw, then the same workload behind the same gateway with
//! no picker (Envoy failing open round robin over fresh workers) next to it.
//!
//! Light, the pool is idle and the prompt's prefix decides: each shared system
//! prompt's conversations stay on the worker that holds it (2 prompts, 2 of 4
//! workers busy), which the demo says. A second phase runs many more
//! conversations at once on fresh stacks: the in-flight load then outweighs
//! the prefix on a busy holder, kvpick spreads over every worker and keeps its
//! hit rate; per-worker shares are printed for both pickers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;
use e2e::client::Client;
use e2e::gateway::{BodyMode, FailureMode, GatewayConfig, GatewayHandle};
use e2e::mock_worker::{Counters, WorkerConfig, WorkerHandle};
use e2e::report::{markdown_table, WorkerRow};
use e2e::stack::{Stack, StackOptions};
use e2e::workload::{self, Outcome, Workload};

/// Runs kvpick end to end on this machine and prints per-worker results.
#[derive(Debug, Parser)]
#[command(name = "kvpick-demo", version, about)]
struct Args {
    /// Mock workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Concurrent conversations.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Distinct shared system prompts.
    #[arg(long, default_value_t = 2)]
    system_prompts: usize,
    /// Mark conversations with nvext.session_control (needs kvpick session affinity).
    #[arg(long)]
    session_control: bool,
    /// How the gateway sends bodies to kvpick.
    #[arg(long, value_enum, default_value = "full-duplex")]
    body_mode: BodyMode,
    /// Concurrent conversations of the phase at load (0 skips it).
    #[arg(long, default_value_t = 48)]
    load_sessions: usize,
}

impl Args {
    /// The idle-pool phase's conversations (the at-load phase runs more of them).
    fn light_workload(&self) -> Workload {
        Workload {
            sessions: self.sessions,
            turns: self.turns,
            system_prompts: self.system_prompts,
            session_control: self.session_control,
            ..Workload::default()
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // The baseline run fails open on every request by design: its gateway
            // warnings are not news.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,e2e::gateway=error".into()),
        )
        .init();
    let a = Args::parse();
    let worker = demo_worker();
    let stack = start_stack(&a, &worker).await?;
    println!(
        "kvpick (standalone, ext_proc on {}) + {} mock workers + test gateway on {}",
        stack.kvpick.addr(),
        stack.workers.len(),
        stack.gateway.addr()
    );
    let w = a.light_workload();
    println!(
        "workload: {} conversations x {} turns, {} shared system prompts of {} words, streaming\n",
        w.sessions, w.turns, w.system_prompts, w.system_words
    );
    let started = Instant::now();
    let outcome = workload::run(&stack.client(), &w).await?;
    let took = started.elapsed();
    let rows: Vec<WorkerRow> = stack
        .workers
        .iter()
        .map(|wk| WorkerRow {
            address: wk.addr().to_string(),
            instance_id: wk.instance_id(),
            counters: wk.counters(),
        })
        .collect();
    print!("{}", markdown_table(&rows));
    println!(
        "\n{} requests, {} ok, in {:.2} s",
        outcome.requests,
        outcome.ok,
        took.as_secs_f64()
    );
    ensure_ok("kvpick", &outcome)?;
    let picked: Vec<Counters> = rows.into_iter().map(|r| r.counters).collect();
    let (unpicked, rr) = round_robin(&a, &worker, &w).await?;
    ensure_ok("round robin", &rr)?;
    println!("\nthe same workload, same gateway, no picker (fail-open round robin):\n");
    println!("| picker | prefix hit rate | mean TTFT (ms, the workers' prefill model) |");
    println!("| --- | --- | --- |");
    for (name, counters) in [("kvpick", &picked), ("round robin", &unpicked)] {
        let (hit, ttft) = summary(counters, &worker);
        println!("| {name} | {:.1}% | {ttft:.1} |", hit * 100.0);
    }
    let busy = picked.iter().filter(|c| c.requests > 0).count();
    println!(
        "\nWhy {busy} of {} workers: the pool is idle, so the cheapest worker for a \
         conversation is the one already holding its system prompt ({} shared \
         prompts). Load enters the cost once workers are busy:",
        picked.len(),
        w.system_prompts
    );
    if a.load_sessions > 0 {
        at_load(&a, &worker, &w).await?;
    }
    Ok(())
}

/// The mock workers' model: a short fixed TTFT plus a prefill time per
/// uncached prompt token, and a short inter-token latency.
fn demo_worker() -> WorkerConfig {
    WorkerConfig {
        ttft: Duration::from_millis(5),
        prefill_per_token: Duration::from_micros(20),
        itl: Duration::from_millis(1),
        ..WorkerConfig::default()
    }
}

/// kvpick behind the test gateway with `a.workers` fresh mock workers.
async fn start_stack(a: &Args, worker: &WorkerConfig) -> anyhow::Result<Stack> {
    Ok(Stack::start(StackOptions {
        workers: a.workers,
        worker: worker.clone(),
        body_mode: a.body_mode,
        ..StackOptions::default()
    })
    .await?)
}

/// The phase at load: `a.load_sessions` conversations at once through kvpick
/// and through round robin (fresh stacks); prints each worker's share of the
/// requests and each picker's hit rate.
async fn at_load(a: &Args, worker: &WorkerConfig, light: &Workload) -> anyhow::Result<()> {
    let (w, picked, unpicked) = load_phase(a, worker, light).await?;
    println!(
        "\nat load: {} conversations x {} turns at once\n",
        w.sessions, w.turns
    );
    print!("{}", share_table(&picked, &unpicked));
    println!("\n| picker | prefix hit rate | mean TTFT (ms, the workers' prefill model) |");
    println!("| --- | --- | --- |");
    for (name, counters) in [("kvpick", &picked), ("round robin", &unpicked)] {
        let (hit, ttft) = summary(counters, worker);
        println!("| {name} | {:.1}% | {ttft:.1} |", hit * 100.0);
    }
    Ok(())
}

/// Runs the phase at load: its workload, and each worker's counters under
/// kvpick and under round robin.
async fn load_phase(
    a: &Args,
    worker: &WorkerConfig,
    light: &Workload,
) -> anyhow::Result<(Workload, Vec<Counters>, Vec<Counters>)> {
    let w = Workload {
        sessions: a.load_sessions,
        ..light.clone()
    };
    let stack = start_stack(a, worker).await?;
    let outcome = workload::run(&stack.client(), &w).await?;
    ensure_ok("kvpick at load", &outcome)?;
    let picked: Vec<Counters> = stack.workers.iter().map(WorkerHandle::counters).collect();
    drop(stack);
    let (unpicked, rr) = round_robin(a, worker, &w).await?;
    ensure_ok("round robin at load", &rr)?;
    Ok((w, picked, unpicked))
}

/// Each worker's share of the requests under both pickers, as a markdown table.
fn share_table(picked: &[Counters], unpicked: &[Counters]) -> String {
    let share = |all: &[Counters], i: usize| {
        let total: u64 = all.iter().map(|c| c.requests).sum();
        100.0 * all[i].requests as f64 / total.max(1) as f64
    };
    let mut out =
        String::from("| worker | kvpick share | round robin share |\n| --- | --- | --- |\n");
    for i in 0..picked.len().min(unpicked.len()) {
        out.push_str(&format!(
            "| {} | {:.1}% | {:.1}% |\n",
            i + 1,
            share(picked, i),
            share(unpicked, i)
        ));
    }
    out
}

fn ensure_ok(who: &str, outcome: &Outcome) -> anyhow::Result<()> {
    if outcome.failures.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{who}: {} requests failed: statuses {:?}",
        outcome.failures.len(),
        outcome.failures
    )
}

/// The workload through the test gateway with no picker reachable and failing
/// open, which is what Envoy does without an endpoint picker: round robin over
/// the pool (fresh workers, same settings). Returns each worker's counters.
async fn round_robin(
    a: &Args,
    worker: &WorkerConfig,
    w: &Workload,
) -> anyhow::Result<(Vec<Counters>, Outcome)> {
    let local: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mut workers = Vec::with_capacity(a.workers);
    for _ in 0..a.workers {
        workers.push(WorkerHandle::start(local, worker.clone()).await?);
    }
    // A port nothing listens on: every ext_proc call is refused at once.
    let closed = std::net::TcpListener::bind(local)?.local_addr()?;
    let gateway = GatewayHandle::start(
        local,
        GatewayConfig {
            ext_proc: format!("http://{closed}"),
            body_mode: a.body_mode,
            failure_mode: FailureMode::Open,
            fallback: workers.iter().map(WorkerHandle::addr).collect(),
            ..GatewayConfig::default()
        },
    )
    .await?;
    let outcome = workload::run(&Client::new(gateway.addr()), w).await?;
    Ok((
        workers.iter().map(WorkerHandle::counters).collect(),
        outcome,
    ))
}

/// Prefix hit rate over all workers, and the mean time to first token their
/// prefill model gives: `ttft + prefill_per_token × uncached prompt tokens`.
fn summary(counters: &[Counters], worker: &WorkerConfig) -> (f64, f64) {
    let (hits, queries, requests) = counters.iter().fold((0, 0, 0), |(h, q, r), c| {
        (
            h + c.prefix_cache_hits,
            q + c.prefix_cache_queries,
            r + c.requests,
        )
    });
    let hit = hits as f64 / queries.max(1) as f64;
    let uncached_per_request = (queries - hits) as f64 / requests.max(1) as f64;
    let ttft =
        worker.ttft.as_secs_f64() + worker.prefill_per_token.as_secs_f64() * uncached_per_request;
    (hit, ttft * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's phase at load, as `kvpick-demo` runs it by default: kvpick
    /// spreads over every worker (each at least 15% of the requests, a fair
    /// share being 25%) and still hits the prefix cache at least as often as
    /// round robin.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_load_kvpick_spreads_over_every_worker_and_keeps_its_hit_rate() {
        let a = Args::parse_from(["kvpick-demo"]);
        let light = a.light_workload();
        let worker = demo_worker();
        let (w, picked, unpicked) = load_phase(&a, &worker, &light).await.unwrap();
        let total: u64 = picked.iter().map(|c| c.requests).sum();
        assert_eq!(total, (w.sessions * w.turns) as u64);
        assert_eq!(picked.len(), 4);
        for (i, c) in picked.iter().enumerate() {
            let share = c.requests as f64 / total as f64;
            assert!(
                share >= 0.15,
                "worker {} got {:.1}%: {picked:?}",
                i + 1,
                share * 100.0
            );
        }
        let (kvpick_hit, _) = summary(&picked, &worker);
        let (rr_hit, _) = summary(&unpicked, &worker);
        assert!(
            kvpick_hit >= rr_hit,
            "kvpick {:.1}% < round robin {:.1}%",
            kvpick_hit * 100.0,
            rr_hit * 100.0
        );
    }

    #[tokio::test]
    async fn the_baseline_spreads_every_request_round_robin_without_a_picker() {
        let a = Args::parse_from(["kvpick-demo"]);
        let worker = WorkerConfig {
            ttft: Duration::from_millis(1),
            prefill_per_token: Duration::from_micros(1),
            ..WorkerConfig::default()
        };
        let w = Workload {
            sessions: 4,
            turns: 2,
            sequential: true,
            ..Workload::default()
        };
        let (counters, outcome) = round_robin(&a, &worker, &w).await.unwrap();
        assert_eq!((outcome.requests, outcome.ok), (8, 8));
        // Sequential requests over 4 workers in turn: 2 each.
        assert!(counters.iter().all(|c| c.requests == 2), "{counters:?}");
        let (hit, ttft) = summary(&counters, &worker);
        let (h, q): (u64, u64) = counters.iter().fold((0, 0), |(h, q), c| {
            (h + c.prefix_cache_hits, q + c.prefix_cache_queries)
        });
        assert!((hit - h as f64 / q as f64).abs() < 1e-12);
        let expected = 1.0 + 0.001 * (q - h) as f64 / 8.0;
        assert!((ttft - expected).abs() < 1e-9, "{ttft} vs {expected}");
    }
}
