//! `mock-worker`: a mock vLLM worker with its sidecar (see `e2e::mock_worker`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use e2e::mock_worker::{WorkerConfig, WorkerHandle};

/// A mock vLLM worker: OpenAI API, simulated KV cache, vLLM metrics and KV events.
#[derive(Debug, Parser)]
#[command(name = "mock-worker", version, about)]
struct Args {
    /// HTTP listen address.
    #[arg(long, env = "MOCK_WORKER_LISTEN", default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    /// Served model name.
    #[arg(long, env = "MOCK_WORKER_MODEL", default_value = "mock-model")]
    model: String,
    /// Instance id (default: kvpick's hash of `ip:port` in standalone mode).
    #[arg(long, env = "MOCK_WORKER_INSTANCE_ID")]
    instance_id: Option<u64>,
    /// Data-parallel ranks.
    #[arg(long, env = "MOCK_WORKER_DP_SIZE", default_value_t = 1)]
    dp_size: u32,
    /// Tokens per KV block.
    #[arg(long, env = "MOCK_WORKER_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// KV blocks per rank.
    #[arg(long, env = "MOCK_WORKER_NUM_BLOCKS", default_value_t = 1024)]
    num_blocks: usize,
    /// Time to first token, ms.
    #[arg(long, env = "MOCK_WORKER_TTFT_MS", default_value_t = 20)]
    ttft_ms: u64,
    /// Extra prefill time per uncached prompt token, µs.
    #[arg(long, env = "MOCK_WORKER_PREFILL_US_PER_TOKEN", default_value_t = 50)]
    prefill_us_per_token: u64,
    /// Inter-token latency, ms.
    #[arg(long, env = "MOCK_WORKER_ITL_MS", default_value_t = 5)]
    itl_ms: u64,
    /// Rate multiplier of the simulated times (2 runs twice as fast).
    #[arg(long, env = "MOCK_WORKER_SPEED", default_value_t = 1.0)]
    speed: f64,
    /// Requests running at once.
    #[arg(long, env = "MOCK_WORKER_MAX_RUNNING", default_value_t = 64)]
    max_running: usize,
    /// Publish vLLM KV events over ZMQ PUB on this port.
    #[arg(long, env = "MOCK_WORKER_KV_EVENTS_PORT")]
    kv_events_port: Option<u16>,
    /// ZMQ topic of KV events.
    #[arg(long, env = "MOCK_WORKER_KV_EVENTS_TOPIC", default_value = "")]
    kv_events_topic: String,
    /// Reject requests without `x-worker-instance-id`.
    #[arg(long, env = "MOCK_WORKER_REQUIRE_ROUTING_HEADERS")]
    require_routing_headers: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let a = Args::parse();
    let config = WorkerConfig {
        model: a.model,
        instance_id: a.instance_id,
        dp_size: a.dp_size,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        ttft: Duration::from_millis(a.ttft_ms),
        prefill_per_token: Duration::from_micros(a.prefill_us_per_token),
        itl: Duration::from_millis(a.itl_ms),
        speed: a.speed,
        max_running: a.max_running,
        kv_events_port: a.kv_events_port,
        kv_events_topic: a.kv_events_topic,
        require_routing_headers: a.require_routing_headers,
        ..WorkerConfig::default()
    };
    let worker = WorkerHandle::start(a.listen, config).await?;
    println!(
        "mock-worker listening on {} (instance id {}, kv events port {:?})",
        worker.addr(),
        worker.instance_id(),
        worker.kv_events_port()
    );
    worker.wait().await;
    Ok(())
}
