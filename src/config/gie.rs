//! Flags of the GIE EPP and the llm-d Router that kvpick accepts so their Helm
//! charts can run it: the ones with a kvpick equivalent are honoured, the rest
//! are accepted and ignored with a warning.

use std::path::PathBuf;
use std::time::Duration;

use clap::ArgAction;

use super::duration::parse_go_duration;

/// GIE EPP flags: the ones that map to kvpick are honoured, the rest are accepted
/// and ignored with a warning (see `docs/discovery.md`). Hidden from `--help`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct GieFlags {
    /// Honoured: overrides `--scrape-interval-ms` (Go duration, e.g. `50ms`).
    #[arg(long, hide = true, value_parser = parse_go_duration)]
    pub refresh_metrics_interval: Option<Duration>,
    /// Honoured: overrides `--scrape-staleness-ms` (Go duration, e.g. `2s`).
    #[arg(long, hide = true, value_parser = parse_go_duration)]
    pub metrics_staleness_threshold: Option<Duration>,
    /// Honoured: URL path of the workers' metrics.
    #[arg(
        long,
        hide = true,
        env = "KVPICK_MODEL_SERVER_METRICS_PATH",
        default_value = "/metrics"
    )]
    pub model_server_metrics_path: String,
    /// Honoured: scrape this port instead of each endpoint's own port.
    #[arg(long, hide = true, env = "KVPICK_MODEL_SERVER_METRICS_PORT")]
    pub model_server_metrics_port: Option<u16>,
    /// Honoured for `http`; `https` is not supported (warning, scraped over http).
    #[arg(long, hide = true, default_value = "http")]
    pub model_server_metrics_scheme: String,
    /// Honoured: `json` selects JSON logs, `console` text logs.
    #[arg(long, hide = true)]
    pub zap_encoder: Option<String>,
    /// Honoured: log verbosity (0-1 info, 2-4 debug, 5+ trace) unless `RUST_LOG` is set.
    #[arg(short = 'v', long = "v", hide = true)]
    pub verbosity: Option<u8>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub ha_enable_leader_election: Option<bool>,
    /// Honoured: export OpenTelemetry traces over OTLP/gRPC, configured by the
    /// standard `OTEL_*` variables (off unless given; see `docs/observability.md`).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub tracing: Option<bool>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub health_checking: Option<bool>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_pprof: Option<bool>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub metrics_endpoint_auth: Option<bool>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub model_server_metrics_https_insecure_skip_verify: Option<bool>,
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub zap_devel: Option<bool>,
    /// Honoured: an `EndpointPickerConfig` file (llm-d Router / GIE); the
    /// scorers kvpick has an equivalent for set its cost weights. Watched
    /// while serving: a valid edit applies within a second, an invalid one is
    /// logged and ignored. Flags given on the command line keep precedence
    /// (the file's weights scale the `--weight-*` flags).
    #[arg(long, hide = true, env = "KVPICK_CONFIG_FILE")]
    pub config_file: Option<PathBuf>,
    /// Honoured: the same as `--config-file`, inline.
    #[arg(long, hide = true)]
    pub config_text: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub refresh_prometheus_metrics_interval: Option<String>,
    /// Ignored with a warning (kvpick reads its metric names by engine type).
    #[arg(long, hide = true)]
    pub total_queued_requests_metric: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub total_running_requests_metric: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub kv_cache_usage_percentage_metric: Option<String>,
    /// Honoured: the LoRA adapter gauge scraped from every worker (GIE's
    /// default, vLLM's name; empty: adapters are not read).
    #[arg(long, hide = true, default_value = crate::scrape::DEFAULT_LORA_INFO_METRIC)]
    pub lora_info_metric: String,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub cache_info_metric: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub zap_log_level: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub zap_stacktrace_level: Option<String>,
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub zap_time_encoding: Option<String>,
    /// Ignored with a warning (GIE v1.5 / llm-d Router v0.10).
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub disable_endpoint_subset_filter: Option<bool>,
    /// Ignored with a warning (GIE v1.5 / llm-d Router v0.10).
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub allow_experimental_plugins: Option<bool>,
    /// Ignored with a warning (GIE v1.5 / llm-d Router v0.10).
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub emit_endpoint_scores: Option<bool>,
    /// Ignored with a warning (GIE v1.5 / llm-d Router v0.10).
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_grpc_stream_metrics: Option<bool>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub drain_timeout: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub grpc_max_recv_msg_size: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub grpc_max_send_msg_size: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub metrics_cert_dir: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub metrics_client_ca_file: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10).
    #[arg(long, hide = true)]
    pub tls_min_version: Option<String>,
    /// Ignored with a warning (llm-d Router v0.10; repeatable, comma-separated).
    #[arg(long, hide = true)]
    pub tls_cipher_suites: Vec<String>,
}

impl GieFlags {
    /// One warning per GIE flag that was given but has no effect in kvpick.
    pub fn warnings(&self) -> Vec<String> {
        let set = [
            (
                "ha-enable-leader-election",
                self.ha_enable_leader_election.is_some(),
            ),
            ("health-checking", self.health_checking.is_some()),
            ("enable-pprof", self.enable_pprof.is_some()),
            (
                "metrics-endpoint-auth",
                self.metrics_endpoint_auth.is_some(),
            ),
            (
                "model-server-metrics-https-insecure-skip-verify",
                self.model_server_metrics_https_insecure_skip_verify
                    .is_some(),
            ),
            ("zap-devel", self.zap_devel.is_some()),
            (
                "refresh-prometheus-metrics-interval",
                self.refresh_prometheus_metrics_interval.is_some(),
            ),
            (
                "total-queued-requests-metric",
                self.total_queued_requests_metric.is_some(),
            ),
            (
                "total-running-requests-metric",
                self.total_running_requests_metric.is_some(),
            ),
            (
                "kv-cache-usage-percentage-metric",
                self.kv_cache_usage_percentage_metric.is_some(),
            ),
            ("cache-info-metric", self.cache_info_metric.is_some()),
            ("zap-log-level", self.zap_log_level.is_some()),
            ("zap-stacktrace-level", self.zap_stacktrace_level.is_some()),
            ("zap-time-encoding", self.zap_time_encoding.is_some()),
            (
                "disable-endpoint-subset-filter",
                self.disable_endpoint_subset_filter.is_some(),
            ),
            (
                "allow-experimental-plugins",
                self.allow_experimental_plugins.is_some(),
            ),
            ("emit-endpoint-scores", self.emit_endpoint_scores.is_some()),
            (
                "enable-grpc-stream-metrics",
                self.enable_grpc_stream_metrics.is_some(),
            ),
            ("drain-timeout", self.drain_timeout.is_some()),
            (
                "grpc-max-recv-msg-size",
                self.grpc_max_recv_msg_size.is_some(),
            ),
            (
                "grpc-max-send-msg-size",
                self.grpc_max_send_msg_size.is_some(),
            ),
            ("metrics-cert-dir", self.metrics_cert_dir.is_some()),
            (
                "metrics-client-ca-file",
                self.metrics_client_ca_file.is_some(),
            ),
            ("tls-min-version", self.tls_min_version.is_some()),
            ("tls-cipher-suites", !self.tls_cipher_suites.is_empty()),
        ];
        let mut out: Vec<String> = set
            .iter()
            .filter(|(_, given)| *given)
            .map(|(name, _)| format!("GIE flag --{name} has no effect in kvpick; ignored"))
            .collect();
        if !self
            .model_server_metrics_scheme
            .eq_ignore_ascii_case("http")
        {
            out.push(format!(
                "--model-server-metrics-scheme={} is not supported; scraping over http",
                self.model_server_metrics_scheme
            ));
        }
        out
    }
}
