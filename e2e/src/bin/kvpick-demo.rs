//! `kvpick-demo`: kvpick in standalone mode, 4 mock workers and the test
//! gateway on 127.0.0.1, a short multi-turn chat workload through them, and a
//! table of what each worker saw.

use std::time::{Duration, Instant};

use clap::Parser;
use e2e::gateway::BodyMode;
use e2e::mock_worker::WorkerConfig;
use e2e::report::{markdown_table, WorkerRow};
use e2e::stack::{Stack, StackOptions};
use e2e::workload::{self, Workload};

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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let a = Args::parse();
    let stack = Stack::start(StackOptions {
        workers: a.workers,
        worker: WorkerConfig {
            ttft: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(20),
            itl: Duration::from_millis(1),
            ..WorkerConfig::default()
        },
        body_mode: a.body_mode,
        ..StackOptions::default()
    })
    .await?;
    println!(
        "kvpick (standalone, ext_proc on {}) + {} mock workers + test gateway on {}",
        stack.kvpick.addr(),
        stack.workers.len(),
        stack.gateway.addr()
    );
    let w = Workload {
        sessions: a.sessions,
        turns: a.turns,
        system_prompts: a.system_prompts,
        session_control: a.session_control,
        ..Workload::default()
    };
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
    if !outcome.failures.is_empty() {
        anyhow::bail!(
            "{} requests failed: statuses {:?}",
            outcome.failures.len(),
            outcome.failures
        );
    }
    Ok(())
}
