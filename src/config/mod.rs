//! Command-line flags. Names and defaults follow the GIE EPP where it has the
//! flag; every flag can also be set through a `KVPICK_*` environment variable.
//!
//! One `clap::Args` struct per subsystem, each in its own file, flattened into
//! [`Args`] under a `--help` heading of its own. A new flag is one field in its
//! subsystem's struct. Field names are the flag names (clap derives `--flag`
//! and the argument id from them), so a `*_ms` or `*_secs` field is a
//! [`Duration`] parsed by [`duration`]: a bare integer keeps the unit the name
//! says, a Go duration (`250ms`, `2s`) is accepted too.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, Subcommand};

use crate::endpoint_picker_config::{EndpointPickerConfigError, Mapping};
use crate::scheduler::SchedulerConfig;
use crate::telemetry::LogFormat;

pub mod discovery;
pub mod duration;
pub mod flow_control;
pub mod gie;
pub mod health;
pub mod image_fetch;
pub mod kv_events;
pub mod multimodal;
pub mod replica_sync;
pub mod requests;
pub mod scheduling;
pub mod scrape;
pub mod server;
pub mod sessions;
pub mod telemetry;
pub mod tls;

pub use discovery::{resolve_namespace, DiscoveryFlags, DEFAULT_STANDALONE_POOL};
pub use duration::parse_go_duration;
pub use flow_control::FlowControlFlags;
pub use gie::GieFlags;
pub use health::HealthFlags;
pub use image_fetch::ImageFetchFlags;
pub use kv_events::KvEventFlags;
pub use multimodal::MultimodalFlags;
pub use replica_sync::ReplicaSyncFlags;
pub use requests::RequestFlags;
pub use scheduling::SchedulingFlags;
pub use scrape::ScrapeFlags;
pub use server::ServerFlags;
pub use sessions::SessionFlags;
pub use telemetry::TelemetryFlags;
pub use tls::TlsFlags;

/// kvpick: a KV-cache-aware endpoint picker for the Gateway API Inference Extension.
///
/// The endpoints come from one source: `--endpoints-file` (standalone), an
/// InferencePool (`--pool-name`) or a pod selector (`--endpoint-selector`);
/// passing two is an error, not a silent choice. With `--endpoints-file`,
/// `--pool-name` only names the pool (default `standalone`): replicas sharing
/// a `--replica-sync` server under one pool name route as one, wherever their
/// endpoints files are. Durations take a bare integer in the flag's unit
/// (`-ms`, `-secs`) or a Go duration such as `250ms`, `2s`, `1m30s`.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvpick", version, about)]
pub struct Args {
    /// A subcommand instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten, next_help_heading = "Server")]
    pub server: ServerFlags,

    #[command(flatten, next_help_heading = "Metrics, logs and admin")]
    pub telemetry: TelemetryFlags,

    #[command(flatten, next_help_heading = "TLS")]
    pub tls: TlsFlags,

    #[command(flatten, next_help_heading = "Endpoint discovery")]
    pub discovery: DiscoveryFlags,

    #[command(flatten, next_help_heading = "Worker metrics scraping")]
    pub scrape: ScrapeFlags,

    #[command(flatten, next_help_heading = "Passive health")]
    pub health: HealthFlags,

    #[command(flatten, next_help_heading = "Request handling")]
    pub requests: RequestFlags,

    #[command(flatten, next_help_heading = "Sessions")]
    pub sessions: SessionFlags,

    #[command(flatten, next_help_heading = "Scheduling")]
    pub scheduling: SchedulingFlags,

    #[command(flatten, next_help_heading = "KV events")]
    pub kv_events: KvEventFlags,

    #[command(flatten, next_help_heading = "Replica sync")]
    pub replica_sync: ReplicaSyncFlags,

    #[command(flatten, next_help_heading = "Tokenizer and multimodal")]
    pub multimodal: MultimodalFlags,

    #[command(flatten, next_help_heading = "Remote image fetch")]
    pub image_fetch: ImageFetchFlags,

    #[command(flatten, next_help_heading = "Flow control")]
    pub flow_control: FlowControlFlags,

    /// Flags of the GIE EPP, accepted so its Helm chart can run kvpick.
    #[command(flatten)]
    pub gie: GieFlags,
}

/// Subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the InferencePool CRD (YAML) and exit.
    Crd,
    /// Check the flags and the EndpointPickerConfig, print the warnings and the
    /// cost weights they give, and exit (non-zero when kvpick would not start).
    CheckArgs,
    /// Ask a running kvpick's admin port how it would route a request body
    /// (per-candidate scores), print the answer as JSON, and exit.
    Explain(ExplainArgs),
}

/// `kvpick explain FILE`.
#[derive(Debug, Clone, ClapArgs)]
pub struct ExplainArgs {
    /// The request body (JSON), `-` for stdin.
    pub file: PathBuf,
    /// The admin endpoint.
    #[arg(long, default_value = "http://127.0.0.1:9004")]
    pub admin: String,
    /// The request path (chooses the API).
    #[arg(long, default_value = "/v1/chat/completions")]
    pub path: String,
    /// A session id, as the session header would carry it.
    #[arg(long)]
    pub session_id: Option<String>,
}

impl Args {
    /// The scheduler settings these flags describe; `session_key` is loaded by the caller.
    pub fn scheduler(&self, session_key: Vec<u8>) -> SchedulerConfig {
        let s = &self.scheduling;
        SchedulerConfig {
            byte_block: s.prefix_byte_block.max(1),
            token_block: s.prefix_token_block.max(1),
            max_prefix_blocks: s.max_prefix_blocks(),
            pending_prefill_weight: crate::scheduler::PENDING_PREFILL_WEIGHT,
            plugins: s.plugins(),
            tie_break_seed: None,
            scrape_max_age: self.scrape_staleness(),
            index: s.index(),
            provisional_ttl: s.provisional_ttl_secs.max(Duration::from_secs(1)),
            provisional_confirm: s.provisional_confirm_ms,
            session_token_header: self.sessions.session_token_header.to_ascii_lowercase(),
            session_key,
            vision: self.multimodal.vision_prompt().map(|v| v.model),
            session_max_entries: self.sessions.session_max_entries.max(1),
            session_token_max_lifetime: self
                .sessions
                .session_token_max_lifetime_secs
                .max(Duration::from_secs(1)),
            default_osl_tokens: s.default_osl_tokens,
            max_request_load_blocks: s.max_request_load_blocks.max(1),
            max_endpoints: s.max_endpoints as usize,
            scoring: s.scoring.mode(),
            tier_costs: s.tier_costs.0,
            sglang_bootstrap_port: (s.sglang_bootstrap_port != 0)
                .then_some(s.sglang_bootstrap_port),
            health: self.health.config(),
        }
    }

    /// Reads `--config-file` / `--config-text` and sets the scheduler's plugin
    /// list from its main profile, the weight flags scaled by its scorers'
    /// weights (see [`crate::endpoint_picker_config`]); `None` without one.
    pub fn apply_endpoint_picker_config(
        &mut self,
    ) -> Result<Option<Mapping>, EndpointPickerConfigError> {
        let text = match (&self.gie.config_file, &self.gie.config_text) {
            (Some(_), Some(_)) => return Err(EndpointPickerConfigError::Both),
            (Some(path), None) => {
                std::fs::read_to_string(path).map_err(|source| EndpointPickerConfigError::Read {
                    path: path.clone(),
                    source,
                })?
            }
            (None, Some(text)) => text.clone(),
            (None, None) => return Ok(None),
        };
        let s = &mut self.scheduling;
        let mapping =
            crate::endpoint_picker_config::map(&text, &s.weights.0, s.temperature.max(0.0))?;
        s.plugins = Some(mapping.plugins.clone());
        Ok(Some(mapping))
    }

    /// The `--config-file` to watch while serving, with the flags its text is
    /// mapped onto (`--config-text` is not watched); `None` without one.
    pub fn endpoint_picker_config_source(&self) -> Option<crate::scheduler::reload::ConfigSource> {
        self.gie
            .config_file
            .as_ref()
            .map(|path| crate::scheduler::reload::ConfigSource {
                path: path.clone(),
                weights: self.scheduling.weights.0.clone(),
                temperature: self.scheduling.temperature.max(0.0),
            })
    }

    /// The scrape interval (`--refresh-metrics-interval` wins over `--scrape-interval-ms`).
    pub fn scrape_interval(&self) -> Duration {
        self.gie
            .refresh_metrics_interval
            .unwrap_or(self.scrape.scrape_interval_ms)
            .max(Duration::from_millis(1))
    }

    /// How old scraped load may be (`--metrics-staleness-threshold` wins).
    pub fn scrape_staleness(&self) -> Duration {
        self.gie
            .metrics_staleness_threshold
            .unwrap_or(self.scrape.scrape_staleness_ms)
    }

    /// The scraper settings these flags describe.
    pub fn scrape_config(&self) -> crate::scrape::ScrapeConfig {
        crate::scrape::ScrapeConfig {
            interval: self.scrape_interval(),
            timeout: self.scrape.scrape_timeout_ms.max(Duration::from_millis(1)),
            concurrency: self.scrape.scrape_concurrency.max(1),
            path: self.gie.model_server_metrics_path.clone(),
            port: self.gie.model_server_metrics_port,
            lora_info_metric: Some(self.gie.lora_info_metric.clone()).filter(|m| !m.is_empty()),
        }
    }

    /// The admission settings these flags describe.
    pub fn admission(&self) -> crate::admission::AdmissionConfig {
        self.flow_control.admission(self.scrape_staleness())
    }

    /// The ext_proc handler settings these flags describe.
    pub fn ext_proc(&self) -> crate::extproc::ExtProcConfig {
        self.requests.ext_proc(&self.sessions)
    }

    /// The log format (`--zap-encoder json` selects JSON).
    pub fn log_format(&self) -> LogFormat {
        match self.gie.zap_encoder.as_deref() {
            Some("json") => LogFormat::Json,
            Some("console") => LogFormat::Text,
            _ => self.telemetry.log_format,
        }
    }

    /// The default log filter for GIE's `-v` verbosity.
    pub fn log_level(&self) -> &'static str {
        match self.gie.verbosity {
            None | Some(0..=1) => "info",
            Some(2..=4) => "debug",
            Some(_) => "trace",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::terms::{kv_usage, load, prefix, queue};
    use crate::scheduler::{Plugins, TermWeights};

    #[test]
    fn gie_defaults_and_secure_serving_forms() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert_eq!(
            (
                a.server.grpc_port,
                a.server.grpc_health_port,
                a.telemetry.metrics_port
            ),
            (9002, 9003, 9090)
        );
        assert!(a.tls.secure_serving);
        let a = Args::try_parse_from(["kvpick", "--secure-serving=false"]).unwrap();
        assert!(!a.tls.secure_serving);
        let a = Args::try_parse_from(["kvpick", "--secure-serving"]).unwrap();
        assert!(a.tls.secure_serving);
    }

    #[test]
    fn flow_control_is_off_by_default_and_flags_map_to_config() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        let c = a.admission();
        let d = crate::admission::AdmissionConfig::default();
        assert!(!c.enabled);
        assert_eq!(
            (c.ttl, c.max_band_requests, c.max_band_bytes),
            (d.ttl, d.max_band_requests, d.max_band_bytes)
        );
        assert_eq!(
            c.saturation.queue_depth_threshold,
            d.saturation.queue_depth_threshold
        );
        assert_eq!(
            c.saturation.kv_cache_util_threshold,
            d.saturation.kv_cache_util_threshold
        );
        assert_eq!(
            c.saturation.max_in_flight_per_rank,
            d.saturation.max_in_flight_per_rank
        );
        let a = Args::try_parse_from([
            "kvpick",
            "--flow-control",
            "--default-priority",
            "-1",
            "--flow-control-ttl-ms=1500",
            "--inference-objectives=chat=10,batch=-1",
        ])
        .unwrap();
        let c = a.admission();
        assert!(c.enabled);
        assert_eq!(c.default_priority, -1);
        assert_eq!(c.ttl, Duration::from_millis(1500));
        let o = crate::admission::priority::parse_objectives(&a.flow_control.inference_objectives)
            .unwrap();
        assert_eq!(o.get("batch"), Some(&-1));
    }

    #[test]
    fn scheduler_flags_map_to_config() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        let c = a.scheduler(Vec::new());
        let d = SchedulerConfig::default();
        assert_eq!((c.byte_block, c.token_block), (d.byte_block, d.token_block));
        assert_eq!(format!("{:?}", c.plugins), format!("{:?}", d.plugins));
        assert_eq!(c.index.ttl, d.index.ttl);
        assert_eq!(c.index.default_capacity, d.index.default_capacity);
        assert_eq!((c.max_prefix_blocks, d.max_prefix_blocks), (8192, 8192));
        let whole = Args::try_parse_from(["kvpick", "--max-prefix-tokens=0"]).unwrap();
        assert_eq!(whole.scheduler(Vec::new()).max_prefix_blocks, usize::MAX);
        let a = Args::try_parse_from([
            "kvpick",
            "--prefix-ttl-secs=0",
            "--weight-decode=0.5",
            "--temperature=0.2",
            "--max-endpoints=3",
        ])
        .unwrap();
        let c = a.scheduler(Vec::new());
        assert_eq!(c.index.ttl, None);
        let want = Plugins::with_weights(&TermWeights::default().with(&load::TERM, 0.5), 0.2);
        assert_eq!(format!("{:?}", c.plugins), format!("{want:?}"));
        assert_eq!((c.max_endpoints, d.max_endpoints), (3, 1));
        assert!(Args::try_parse_from(["kvpick", "--max-endpoints=0"]).is_err());
    }

    #[test]
    fn enable_cert_reload_is_honoured_not_warned_about() {
        let a = Args::try_parse_from([
            "kvpick",
            "--enable-cert-reload",
            "--cert-reload-interval-ms",
            "250",
        ])
        .unwrap();
        assert_eq!(
            a.tls.cert_reload_interval(),
            Some(Duration::from_millis(250))
        );
        assert!(a.gie.warnings().is_empty(), "{:?}", a.gie.warnings());
        let a = Args::try_parse_from(["kvpick", "--enable-cert-reload=false"]).unwrap();
        assert_eq!(a.tls.cert_reload_interval(), None);
        assert_eq!(a.tls.tls_handshake_timeout_ms, Duration::from_secs(10));
        assert!(Args::try_parse_from(["kvpick", "--cert-reload-interval-ms=0"]).is_err());
    }

    #[test]
    fn gie_v1_5_and_llm_d_v0_10_flags_are_accepted_with_warnings() {
        // Flags defined in GIE v1.5.0 and llm-d Router v0.10.0
        // `pkg/epp/server/options.go` that kvpick has no equivalent for.
        let a = Args::try_parse_from([
            "kvpick",
            "--disable-endpoint-subset-filter",
            "--allow-experimental-plugins=true",
            "--emit-endpoint-scores",
            "false",
            "--enable-grpc-stream-metrics=false",
            "--drain-timeout=30s",
            "--grpc-max-recv-msg-size",
            "104857600",
            "--grpc-max-send-msg-size=104857600",
            "--metrics-cert-dir",
            "/certs",
            "--metrics-client-ca-file=/ca/ca.crt",
            "--tls-min-version",
            "VersionTLS13",
            "--tls-cipher-suites=TLS_AES_128_GCM_SHA256",
        ])
        .unwrap();
        assert_eq!(a.gie.disable_endpoint_subset_filter, Some(true));
        assert_eq!(a.gie.emit_endpoint_scores, Some(false));
        let warnings = a.gie.warnings();
        assert_eq!(warnings.len(), 11, "{warnings:?}");
        for flag in [
            "--disable-endpoint-subset-filter",
            "--drain-timeout",
            "--tls-cipher-suites",
        ] {
            assert!(
                warnings.iter().any(|w| w.contains(flag)),
                "{flag}: {warnings:?}"
            );
        }
        assert!(Args::try_parse_from(["kvpick", "--no-such-epp-flag"]).is_err());
    }

    #[test]
    fn llm_d_v0_10_chart_arguments_run_kvpick_with_its_config_file() {
        // What llm-d Router v0.10.0's chart (config/charts/routerlib/templates/
        // _deployment.yaml) passes to its EPP with 2 replicas, tracing and
        // metrics auth off and router.epp.flags {v: 2}, with its ConfigMap's
        // default-plugins.yaml mounted as the config file.
        let config = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/llm-d-v0.10.0/chart-default-plugins.yaml"
        );
        let mut a = Args::try_parse_from([
            "kvpick",
            "--pool-name",
            "qwen",
            "--pool-namespace",
            "llm-d",
            "--pool-group",
            "inference.networking.k8s.io",
            "--zap-encoder",
            "json",
            "--config-file",
            config,
            "--ha-enable-leader-election",
            "--grpc-health-port",
            "9003",
            "--v=2",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
        ])
        .unwrap();
        let mapping = a.apply_endpoint_picker_config().unwrap().unwrap();
        assert_eq!(mapping.mapped.len(), 3, "{mapping:?}");
        let w = |t| mapping.weights.get(t).weight;
        assert_eq!((w(&prefix::TERM), w(&load::TERM)), (1.0, 0.0));
        // The flag weights scaled by the scorers' ratios (queue flag default 0.25).
        assert!(
            (w(&queue::TERM) - 0.25 * 2.0 / 3.0).abs() < 1e-9
                && (w(&kv_usage::TERM) - 2.0 / 3.0).abs() < 1e-9
        );
        let scheduled = a.scheduler(Vec::new()).plugins;
        assert_eq!(format!("{scheduled:?}"), format!("{:?}", mapping.plugins));
        assert_eq!(a.log_format(), LogFormat::Json);
        // Standalone mode (router.inferencePool.create=false).
        let a = Args::try_parse_from([
            "kvpick",
            "--endpoint-selector",
            "app=vllm-qwen",
            "--endpoint-target-ports",
            "8000",
            "--zap-encoder",
            "json",
            "--config-text",
            "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\nschedulingProfiles: []\n",
        ])
        .unwrap();
        assert_eq!(
            a.discovery.endpoint_selector.as_deref(),
            Some("app=vllm-qwen")
        );
        let mut both = a.clone();
        both.gie.config_file = Some(config.into());
        assert!(matches!(
            both.apply_endpoint_picker_config(),
            Err(EndpointPickerConfigError::Both)
        ));
        let mut missing = Args::try_parse_from(["kvpick", "--config-file=/no/such/file"]).unwrap();
        assert!(matches!(
            missing.apply_endpoint_picker_config(),
            Err(EndpointPickerConfigError::Read { .. })
        ));
    }

    #[test]
    fn gie_chart_arguments_parse() {
        // What the GIE inferencepool chart passes to its EPP container.
        let a = Args::try_parse_from([
            "kvpick",
            "--pool-name",
            "llama",
            "--pool-namespace",
            "team",
            "--pool-group",
            "inference.networking.x-k8s.io",
            "--zap-encoder",
            "json",
            "--config-file",
            "/config/default-plugins.yaml",
            "--total-queued-requests-metric",
            "nv_trt_llm_request_metrics{request_type=waiting}",
            "--lora-info-metric",
            "",
            "--ha-enable-leader-election",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
            "--v",
            "3",
            "--refresh-metrics-interval",
            "100ms",
            "--metrics-staleness-threshold",
            "1m30s",
            "--model-server-metrics-port",
            "8080",
        ])
        .unwrap();
        assert_eq!(a.discovery.pool_name.as_deref(), Some("llama"));
        assert_eq!(a.discovery.pool_group, "inference.networking.x-k8s.io");
        assert_eq!(a.log_format(), LogFormat::Json);
        assert_eq!(a.log_level(), "debug");
        assert_eq!(a.scrape_interval(), Duration::from_millis(100));
        assert_eq!(a.scrape_staleness(), Duration::from_secs(90));
        assert_eq!(a.scrape_config().port, Some(8080));
        // The chart's empty `--lora-info-metric` (trtllm) turns adapters off.
        assert_eq!(a.scrape_config().lora_info_metric, None);
        assert_eq!(a.gie.tracing, Some(false));
        let warnings = a.gie.warnings();
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(!warnings.iter().any(|w| w.contains("--config-file")));
        assert!(warnings
            .iter()
            .any(|w| w.contains("--ha-enable-leader-election")));

        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert!(a.gie.warnings().is_empty());
        assert_eq!(
            a.scrape_config().lora_info_metric.as_deref(),
            Some("vllm:lora_requests_info")
        );
        assert_eq!(a.scrape_interval(), Duration::from_millis(50));
        assert_eq!(a.scrape_staleness(), Duration::from_secs(2));
        assert_eq!(a.discovery.pool_group, "inference.networking.k8s.io");
    }

    #[test]
    fn crd_subcommand() {
        let a = Args::try_parse_from(["kvpick", "crd"]).unwrap();
        assert!(matches!(a.command, Some(Command::Crd)));
    }

    #[test]
    fn kv_event_flags() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        let c = a.kv_events.subscriber().unwrap();
        assert_eq!((c.port, c.replay_port), (5557, None));
        assert_eq!(
            (
                a.multimodal.tokenizer_dir.as_deref(),
                a.multimodal.tokenizer_threads
            ),
            (None, 2)
        );
        let a = Args::try_parse_from([
            "kvpick",
            "--kv-events-port=6000",
            "--kv-events-replay-port=6100",
            "--kv-events-model=llama",
        ])
        .unwrap();
        let c = a.kv_events.subscriber().unwrap();
        assert_eq!(
            (c.port, c.replay_port, c.model.as_str()),
            (6000, Some(6100), "llama")
        );
        let a = Args::try_parse_from(["kvpick", "--kv-events=false"]).unwrap();
        assert!(a.kv_events.subscriber().is_none());
    }

    #[test]
    fn vision_flags() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert!(a.multimodal.vision_prompt().is_none());
        let a = Args::try_parse_from([
            "kvpick",
            "--mm-model-family=qwen2.5-vl",
            "--mm-max-pixels=1003520",
            "--mm-image-token=<|img|>",
        ])
        .unwrap();
        let v = a.multimodal.vision_prompt().unwrap();
        assert_eq!(v.model.family, crate::multimodal::VisionFamily::Qwen25Vl);
        assert_eq!(v.model.processor.max_pixels, 1_003_520);
        assert_eq!(v.model.processor.patch_size, 14);
        assert_eq!(v.image_token, "<|img|>");
        assert!(Args::try_parse_from(["kvpick", "--mm-model-family=gpt"]).is_err());
    }

    #[test]
    fn the_admin_port_is_off_and_on_loopback_by_default() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert_eq!(a.telemetry.admin_port, 0);
        assert!(a.telemetry.admin_address.is_loopback());
        let a = Args::try_parse_from(["kvpick", "explain", "body.json", "--path=/v1/completions"])
            .unwrap();
        match a.command {
            Some(Command::Explain(e)) => {
                assert_eq!(e.file, PathBuf::from("body.json"));
                assert_eq!(e.path, "/v1/completions");
                assert_eq!(e.admin, "http://127.0.0.1:9004");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn image_fetch_is_off_and_https_public_only_by_default() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert!(a.image_fetch.config().is_none());
        let (policy, limits) = Args::try_parse_from(["kvpick", "--mm-fetch"])
            .unwrap()
            .image_fetch
            .config()
            .unwrap();
        assert_eq!(policy, crate::multimodal::fetch::FetchPolicy::default());
        assert_eq!(limits, crate::multimodal::remote::FetchLimits::default());
        let (policy, limits) = Args::try_parse_from([
            "kvpick",
            "--mm-fetch=true",
            "--mm-fetch-allow-host=Img.Example",
            "--mm-fetch-allow-host=cdn.example",
            "--mm-fetch-timeout-ms=250",
            "--mm-fetch-max-bytes=1024",
        ])
        .unwrap()
        .image_fetch
        .config()
        .unwrap();
        assert_eq!(policy.allow_hosts, ["img.example", "cdn.example"]);
        assert!(!policy.allow_http && !policy.allow_private);
        assert_eq!(policy.max_bytes, 1024);
        assert_eq!(limits.timeout, Duration::from_millis(250));
    }
}
