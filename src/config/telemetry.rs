//! kvpick's own metrics port, log format and admin API.

use std::net::IpAddr;

use crate::telemetry::LogFormat;

/// kvpick's own metrics port, log format and admin API.
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryFlags {
    /// Prometheus metrics port (`/metrics`).
    #[arg(long, env = "KVPICK_METRICS_PORT", default_value_t = 9090)]
    pub metrics_port: u16,

    /// Admin gRPC port (`kvpick.admin.v1.Admin`: `Explain`), plaintext; 0 (the
    /// default) serves none.
    #[arg(long, env = "KVPICK_ADMIN_PORT", default_value_t = 0)]
    pub admin_port: u16,

    /// Address the admin port binds (loopback unless set: the admin API is not
    /// for clients).
    #[arg(long, env = "KVPICK_ADMIN_ADDRESS", default_value = "127.0.0.1")]
    pub admin_address: IpAddr,

    /// Log format.
    #[arg(long, env = "KVPICK_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}
