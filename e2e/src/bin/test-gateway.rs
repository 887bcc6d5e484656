//! `test-gateway`: an HTTP/1.1 proxy that drives an endpoint picker over ext_proc
//! the way Envoy does under the Gateway API Inference Extension (see `e2e::gateway`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use e2e::gateway::{BodyMode, FailureMode, GatewayConfig, GatewayHandle};

/// An Envoy-behaving ext_proc gateway for testing endpoint pickers.
#[derive(Debug, Parser)]
#[command(name = "test-gateway", version, about)]
struct Args {
    /// HTTP listen address.
    #[arg(long, env = "TEST_GATEWAY_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// The picker's ext_proc address: http://host:port (plaintext) or https://host:port.
    #[arg(
        long,
        env = "TEST_GATEWAY_EXT_PROC",
        default_value = "http://127.0.0.1:9002"
    )]
    ext_proc: String,
    /// PEM file of the certificate (or CA) to trust for an https:// picker.
    #[arg(long, env = "TEST_GATEWAY_EXT_PROC_CA")]
    ext_proc_ca: Option<PathBuf>,
    /// For https://: skip verifying the picker's certificate (kvpick's self-signed one).
    #[arg(long, env = "TEST_GATEWAY_EXT_PROC_INSECURE")]
    ext_proc_insecure: bool,
    /// TLS server name of the picker.
    #[arg(
        long,
        env = "TEST_GATEWAY_EXT_PROC_SERVER_NAME",
        default_value = "localhost"
    )]
    ext_proc_server_name: String,
    /// Body mode towards the picker.
    #[arg(
        long,
        env = "TEST_GATEWAY_BODY_MODE",
        value_enum,
        default_value = "full-duplex"
    )]
    body_mode: BodyMode,
    /// Failure mode when the picker is unreachable.
    #[arg(
        long,
        env = "TEST_GATEWAY_FAILURE_MODE",
        value_enum,
        default_value = "close"
    )]
    failure_mode: FailureMode,
    /// Fallback endpoints for fail-open (repeatable, ip:port).
    #[arg(
        long = "fallback",
        env = "TEST_GATEWAY_FALLBACK",
        value_delimiter = ','
    )]
    fallback: Vec<SocketAddr>,
    /// Request body chunk size sent to the picker, bytes.
    #[arg(long, env = "TEST_GATEWAY_CHUNK_SIZE", default_value_t = 4096)]
    chunk_size: usize,
    /// Subset hint sent in metadata_context (comma-separated ip:port).
    #[arg(long, env = "TEST_GATEWAY_SUBSET", value_delimiter = ',')]
    subset: Option<Vec<String>>,
    /// Per-message timeout towards the picker, ms.
    #[arg(long, env = "TEST_GATEWAY_MESSAGE_TIMEOUT_MS", default_value_t = 5000)]
    message_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let a = Args::parse();
    let ext_proc_ca = match &a.ext_proc_ca {
        Some(p) => Some(std::fs::read_to_string(p)?),
        None => None,
    };
    let gw = GatewayHandle::start(
        a.listen,
        GatewayConfig {
            ext_proc: a.ext_proc,
            ext_proc_ca,
            ext_proc_server_name: a.ext_proc_server_name,
            ext_proc_insecure: a.ext_proc_insecure,
            body_mode: a.body_mode,
            failure_mode: a.failure_mode,
            fallback: a.fallback,
            chunk_size: a.chunk_size,
            subset: a.subset,
            message_timeout: Duration::from_millis(a.message_timeout_ms),
        },
    )
    .await?;
    println!("test-gateway listening on {}", gw.addr());
    gw.wait().await;
    Ok(())
}
