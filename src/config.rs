//! Command-line flags, in one place. Names and defaults follow the GIE EPP where
//! it has the flag; every flag can also be set through a `KVPICK_*` environment
//! variable.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

use crate::extproc::ExtProcConfig;
use crate::kv::index::IndexConfig;
use crate::scheduler::{SchedulerConfig, Weights};
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

    /// File holding the HMAC key that signs session tokens (mount a Secret); share
    /// it between replicas so they honour each other's tokens.
    #[arg(long, env = "KVPICK_SESSION_KEY_FILE")]
    pub session_key_file: Option<PathBuf>,

    /// The session token HMAC key itself (prefer --session-key-file). Without
    /// either, a random per-process key is used.
    #[arg(long, env = "KVPICK_SESSION_KEY", hide_env_values = true)]
    pub session_key: Option<String>,

    /// Text prefix block size in bytes (about 4 bytes a token: 64 ≈ 16 tokens).
    #[arg(long, env = "KVPICK_PREFIX_BYTE_BLOCK", default_value_t = 64)]
    pub prefix_byte_block: usize,

    /// Prefix block size in tokens for prompts given as token ids (the engine's
    /// KV block size).
    #[arg(long, env = "KVPICK_PREFIX_TOKEN_BLOCK", default_value_t = 16)]
    pub prefix_token_block: usize,

    /// Approximate prefix index: blocks remembered per worker rank until its
    /// scraped KV capacity is known.
    #[arg(long, env = "KVPICK_PREFIX_CAPACITY_BLOCKS", default_value_t = 31_250)]
    pub prefix_capacity_blocks: usize,

    /// Approximate prefix index: seconds an entry stays valid after its last use
    /// (0: no expiry, LRU only).
    #[arg(long, env = "KVPICK_PREFIX_TTL_SECS", default_value_t = 900)]
    pub prefix_ttl_secs: u64,

    /// Cost weight per prompt block the candidate must still prefill.
    #[arg(long, env = "KVPICK_WEIGHT_PREFILL", default_value_t = 1.0)]
    pub weight_prefill: f64,

    /// Cost weight per block of active load on the candidate.
    #[arg(long, env = "KVPICK_WEIGHT_DECODE", default_value_t = 1.0)]
    pub weight_decode: f64,

    /// Cost weight per scraped queued request (counted at the request's size).
    #[arg(long, env = "KVPICK_WEIGHT_QUEUE", default_value_t = 1.0)]
    pub weight_queue: f64,

    /// Cost weight of scraped KV-cache usage (0..1, counted at the request's size).
    #[arg(long, env = "KVPICK_WEIGHT_KV_USAGE", default_value_t = 1.0)]
    pub weight_kv_usage: f64,

    /// Prefill weight when picking the prefill worker of a disaggregated pool.
    #[arg(long, env = "KVPICK_WEIGHT_PREFILL_OVERLAP", default_value_t = 2.0)]
    pub weight_prefill_overlap: f64,

    /// 0 picks the cheapest candidate; above 0, softmax sampling over costs scaled
    /// to [0, 1] with this temperature.
    #[arg(long, env = "KVPICK_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f64,

    /// Scraped load older than this (ms) is ignored by the scheduler.
    #[arg(long, env = "KVPICK_SCRAPE_MAX_AGE_MS", default_value_t = 5_000)]
    pub scrape_max_age_ms: u64,
}

impl Args {
    /// The scheduler settings these flags describe; `session_key` is loaded by the caller.
    pub fn scheduler(&self, session_key: Vec<u8>) -> SchedulerConfig {
        SchedulerConfig {
            byte_block: self.prefix_byte_block.max(1),
            token_block: self.prefix_token_block.max(1),
            weights: Weights {
                prefill: self.weight_prefill,
                decode: self.weight_decode,
                queue: self.weight_queue,
                kv_usage: self.weight_kv_usage,
                prefill_overlap: self.weight_prefill_overlap,
            },
            temperature: self.temperature.max(0.0),
            scrape_max_age: Duration::from_millis(self.scrape_max_age_ms),
            index: IndexConfig {
                default_capacity: self.prefix_capacity_blocks,
                ttl: (self.prefix_ttl_secs > 0).then(|| Duration::from_secs(self.prefix_ttl_secs)),
            },
            session_token_header: self.session_token_header.to_ascii_lowercase(),
            session_key,
        }
    }

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

    #[test]
    fn scheduler_flags_map_to_config() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        let c = a.scheduler(Vec::new());
        let d = SchedulerConfig::default();
        assert_eq!((c.byte_block, c.token_block), (d.byte_block, d.token_block));
        assert_eq!(c.weights, d.weights);
        assert_eq!(c.index.ttl, d.index.ttl);
        assert_eq!(c.index.default_capacity, d.index.default_capacity);
        let a = Args::try_parse_from([
            "kvpick",
            "--prefix-ttl-secs=0",
            "--weight-decode=0.5",
            "--temperature=0.2",
        ])
        .unwrap();
        let c = a.scheduler(Vec::new());
        assert_eq!(c.index.ttl, None);
        assert_eq!(c.weights.decode, 0.5);
        assert_eq!(c.temperature, 0.2);
    }
}
