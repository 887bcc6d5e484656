//! The ext_proc server: listen address, ports and shutdown.

use std::net::IpAddr;
use std::time::Duration;

use super::duration;

/// The ext_proc server: listen address, ports and shutdown.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerFlags {
    /// Address to bind all listeners on.
    #[arg(long, env = "KVPICK_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub bind_address: IpAddr,

    /// ext_proc gRPC port.
    #[arg(long, env = "KVPICK_GRPC_PORT", default_value_t = 9002)]
    pub grpc_port: u16,

    /// gRPC health port (plaintext).
    #[arg(long, env = "KVPICK_GRPC_HEALTH_PORT", default_value_t = 9003)]
    pub grpc_health_port: u16,

    /// On SIGTERM/SIGINT: how long open ext_proc streams may take to finish (ms)
    /// after readiness turns NOT_SERVING and new connections are refused.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_DRAIN_TIMEOUT_MS", default_value = "120000", value_parser = duration::millis)]
    pub drain_timeout_ms: Duration,
}
