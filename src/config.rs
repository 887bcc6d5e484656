//! Command-line flags, in one place. Names and defaults follow the GIE EPP where
//! it has the flag; every flag can also be set through a `KVPICK_*` environment
//! variable.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

use crate::extproc::ExtProcConfig;
use crate::telemetry::LogFormat;

/// kvpick: a KV-cache-aware endpoint picker for the Gateway API Inference Extension.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvpick", version, about)]
pub struct Args {
    /// Address to bind all listeners on.
    #[arg(long, env = "KVPICK_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub bind_address: IpAddr,

    /// ext_proc gRPC port.
    #[arg(long, env = "KVPICK_GRPC_PORT", default_value_t = 9002)]
    pub grpc_port: u16,

    /// gRPC health port (plaintext).
    #[arg(long, env = "KVPICK_GRPC_HEALTH_PORT", default_value_t = 9003)]
    pub grpc_health_port: u16,

    /// Prometheus metrics port (`/metrics`).
    #[arg(long, env = "KVPICK_METRICS_PORT", default_value_t = 9090)]
    pub metrics_port: u16,

    /// Serve ext_proc over TLS (`--secure-serving=false` for plaintext).
    #[arg(long, env = "KVPICK_SECURE_SERVING", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: bool,

    /// Directory with `tls.crt` and `tls.key`; without it a self-signed
    /// certificate is made at start-up.
    #[arg(long, env = "KVPICK_CERT_PATH")]
    pub cert_path: Option<PathBuf>,

    /// Standalone mode: a YAML file of endpoints, reloaded when it changes.
    #[arg(long, env = "KVPICK_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,

    /// Log format.
    #[arg(long, env = "KVPICK_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, env = "KVPICK_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,

    /// Without Envoy's protocol_config, how long (ms) to hold request headers
    /// waiting for a body before assuming a buffered body mode.
    #[arg(long, env = "KVPICK_BODY_WAIT_MS", default_value_t = 200)]
    pub body_wait_ms: u64,

    /// Request header carrying a session id (for clients that cannot edit the body).
    #[arg(long, env = "KVPICK_SESSION_HEADER", default_value = "x-session-id")]
    pub session_header: String,

    /// Header carrying kvpick's signed session token (set on responses, read on requests).
    #[arg(
        long,
        env = "KVPICK_SESSION_TOKEN_HEADER",
        default_value = "x-kvpick-session"
    )]
    pub session_token_header: String,
}

impl Args {
    /// The ext_proc handler settings these flags describe.
    pub fn ext_proc(&self) -> ExtProcConfig {
        ExtProcConfig {
            max_body_bytes: self.max_body_bytes,
            body_wait: Duration::from_millis(self.body_wait_ms),
            session_header: self.session_header.to_ascii_lowercase(),
            session_token_header: self.session_token_header.to_ascii_lowercase(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gie_defaults_and_secure_serving_forms() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert_eq!(
            (a.grpc_port, a.grpc_health_port, a.metrics_port),
            (9002, 9003, 9090)
        );
        assert!(a.secure_serving);
        let a = Args::try_parse_from(["kvpick", "--secure-serving=false"]).unwrap();
        assert!(!a.secure_serving);
        let a = Args::try_parse_from(["kvpick", "--secure-serving"]).unwrap();
        assert!(a.secure_serving);
    }
}
