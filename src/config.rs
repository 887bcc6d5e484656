//! Command-line flags, in one place. Names and defaults follow the GIE EPP where
//! it has the flag; every flag can also be set through a `KVPICK_*` environment
//! variable.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, ArgGroup, Args as ClapArgs, Parser, Subcommand};

use crate::endpoint_picker_config::{EndpointPickerConfigError, Mapping};
use crate::extproc::ExtProcConfig;
use crate::kv::index::IndexConfig;
use crate::kvevents::subscriber::SubscriberConfig;
use crate::scheduler::{SchedulerConfig, Weights};
use crate::telemetry::LogFormat;

/// kvpick: a KV-cache-aware endpoint picker for the Gateway API Inference Extension.
///
/// The endpoint sources (`--endpoints-file`, `--pool-name`, `--endpoint-selector`)
/// exclude each other: passing two is an error, not a silent choice.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvpick", version, about)]
#[command(group(ArgGroup::new("endpoint_source").args(["endpoints_file", "pool_name", "endpoint_selector"])))]
pub struct Args {
    /// A subcommand instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,

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

    /// Admin gRPC port (`kvpick.admin.v1.Admin`: `Explain`), plaintext; 0 (the
    /// default) serves none.
    #[arg(long, env = "KVPICK_ADMIN_PORT", default_value_t = 0)]
    pub admin_port: u16,

    /// Address the admin port binds (loopback unless set: the admin API is not
    /// for clients).
    #[arg(long, env = "KVPICK_ADMIN_ADDRESS", default_value = "127.0.0.1")]
    pub admin_address: IpAddr,

    /// On SIGTERM/SIGINT: how long open ext_proc streams may take to finish (ms)
    /// after readiness turns NOT_SERVING and new connections are refused.
    #[arg(long, env = "KVPICK_DRAIN_TIMEOUT_MS", default_value_t = 120_000)]
    pub drain_timeout_ms: u64,

    /// Serve ext_proc over TLS (`--secure-serving=false` for plaintext).
    #[arg(long, env = "KVPICK_SECURE_SERVING", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: bool,

    /// PEM file of CA certificates: when set, ext_proc clients must present a
    /// certificate signed by one of them (mutual TLS), others are refused.
    #[arg(long, env = "KVPICK_CLIENT_CA_PATH")]
    pub client_ca_path: Option<PathBuf>,

    /// Directory with `tls.crt` and `tls.key`; without it a self-signed
    /// certificate is made at start-up.
    #[arg(long, env = "KVPICK_CERT_PATH")]
    pub cert_path: Option<PathBuf>,

    /// Reload `tls.crt`/`tls.key` (and `--client-ca-path`) when they change:
    /// new handshakes get the new certificate, open connections keep theirs;
    /// an invalid or half-written set is refused with a warning.
    #[arg(long, env = "KVPICK_ENABLE_CERT_RELOAD", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_cert_reload: bool,

    /// With `--enable-cert-reload`: how often the certificate files are read
    /// for changes (ms).
    #[arg(long, env = "KVPICK_CERT_RELOAD_INTERVAL_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub cert_reload_interval_ms: u64,

    /// Longest a client may take to finish its TLS handshake on the ext_proc
    /// port (ms); handshakes run concurrently.
    #[arg(long, env = "KVPICK_TLS_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub tls_handshake_timeout_ms: u64,

    /// Standalone mode: a YAML file of endpoints, reloaded when it changes.
    #[arg(long, env = "KVPICK_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,

    /// Name of the InferencePool to serve (Kubernetes mode).
    #[arg(long, env = "KVPICK_POOL_NAME")]
    pub pool_name: Option<String>,

    /// Namespace of the pool (or of the selected pods); when unset or `default`,
    /// the `NAMESPACE` environment variable, then `default`.
    #[arg(long, env = "KVPICK_POOL_NAMESPACE")]
    pub pool_namespace: Option<String>,

    /// API group of the InferencePool: `inference.networking.k8s.io` (v1) or
    /// `inference.networking.x-k8s.io` (v1alpha2).
    #[arg(
        long,
        env = "KVPICK_POOL_GROUP",
        default_value = crate::discovery::pool::GROUP_V1
    )]
    pub pool_group: String,

    /// Without an InferencePool: select pods by `key=value[,key=value...]`.
    #[arg(long, env = "KVPICK_ENDPOINT_SELECTOR")]
    pub endpoint_selector: Option<String>,

    /// With `--endpoint-selector`: the pods' serving ports, `port[,port...]`.
    #[arg(long, env = "KVPICK_ENDPOINT_TARGET_PORTS")]
    pub endpoint_target_ports: Option<String>,

    /// Kubeconfig file; default: in-cluster config, then `KUBECONFIG`, then `~/.kube/config`.
    #[arg(long, env = "KVPICK_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// How often each endpoint's `/metrics` is scraped, in ms.
    #[arg(long, env = "KVPICK_SCRAPE_INTERVAL_MS", default_value_t = 50)]
    pub scrape_interval_ms: u64,

    /// Scraped load older than this (ms) is ignored.
    #[arg(long, env = "KVPICK_SCRAPE_STALENESS_MS", default_value_t = 2000)]
    pub scrape_staleness_ms: u64,

    /// Timeout of one scrape, in ms (a slow worker never delays the others).
    #[arg(long, env = "KVPICK_SCRAPE_TIMEOUT_MS", default_value_t = 1000)]
    pub scrape_timeout_ms: u64,

    /// Most scrapes in flight at once.
    #[arg(long, env = "KVPICK_SCRAPE_CONCURRENCY", default_value_t = 64)]
    pub scrape_concurrency: usize,

    /// Log format.
    #[arg(long, env = "KVPICK_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Flags of the GIE EPP, accepted so its Helm chart can run kvpick.
    #[command(flatten)]
    pub gie: GieFlags,

    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, env = "KVPICK_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,

    /// Without Envoy's protocol_config, how long (ms) to hold request headers
    /// waiting for a body before assuming a buffered body mode.
    #[arg(long, env = "KVPICK_BODY_WAIT_MS", default_value_t = 200)]
    pub body_wait_ms: u64,

    /// Bytes of request bodies all streams together may buffer; a body that does
    /// not fit gets a 429. Default: a quarter of the container memory limit
    /// (cgroup `memory.max`), 1 GiB without one.
    #[arg(long, env = "KVPICK_BODY_BUDGET_BYTES")]
    pub body_budget_bytes: Option<usize>,

    /// How long (ms) after the request headers the body must be complete; a body
    /// still arriving then gets a 408.
    #[arg(long, env = "KVPICK_BODY_DEADLINE_MS", default_value_t = 60_000)]
    pub body_deadline_ms: u64,

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

    /// GIE conformance-test hooks, as GIE's reference picker has them: the
    /// `test-epp-endpoint-selection` request header (comma-separated pod IPs or
    /// `ip:port`s) restricts the candidates, and responses carry the gateway's
    /// served endpoint in `x-conformance-test-served-endpoint`. Test only: any
    /// client could steer its own requests.
    #[arg(long, env = "KVPICK_CONFORMANCE_TEST_HOOKS")]
    pub conformance_test_hooks: bool,

    /// File holding the HMAC key that signs session tokens (mount a Secret); share
    /// it between replicas so they honour each other's tokens.
    #[arg(long, env = "KVPICK_SESSION_KEY_FILE")]
    pub session_key_file: Option<PathBuf>,

    /// The session token HMAC key itself (prefer --session-key-file). Without
    /// either, a random per-process key is used.
    #[arg(long, env = "KVPICK_SESSION_KEY", hide_env_values = true)]
    pub session_key: Option<String>,

    /// Most sessions held in the session table; past it the least recently used
    /// session is evicted (`kvpick_session_evictions_total`).
    #[arg(long, env = "KVPICK_SESSION_MAX_ENTRIES", default_value_t = 100_000)]
    pub session_max_entries: usize,

    /// Longest a signed session token stays valid after the turn that issued it,
    /// in seconds, whatever timeout the session asked for.
    #[arg(
        long,
        env = "KVPICK_SESSION_TOKEN_MAX_LIFETIME_SECS",
        default_value_t = 3600
    )]
    pub session_token_max_lifetime_secs: u64,

    /// Expected output tokens of a request without `nvext.agent_hints.osl`; the
    /// expected decode blocks count in the decode rank's booked load.
    #[arg(long, env = "KVPICK_DEFAULT_OSL_TOKENS", default_value_t = 0)]
    pub default_osl_tokens: u32,

    /// Most load one request may book on a worker, in blocks (prompt plus
    /// expected output; a block is 64 bytes of text or 16 tokens by default).
    #[arg(long, env = "KVPICK_MAX_REQUEST_LOAD_BLOCKS",
          default_value_t = crate::scheduler::DEFAULT_MAX_REQUEST_LOAD_BLOCKS)]
    pub max_request_load_blocks: u64,

    /// Bootstrap port of `sglang` prefill pods without a `kvpick.io/bootstrap-port`
    /// annotation (SGLang's default); 0 sends no bootstrap headers for them.
    #[arg(long, env = "KVPICK_SGLANG_BOOTSTRAP_PORT", default_value_t = 8998)]
    pub sglang_bootstrap_port: u16,

    /// Text prefix block size in bytes (about 4 bytes a token: 64 ≈ 16 tokens).
    #[arg(long, env = "KVPICK_PREFIX_BYTE_BLOCK", default_value_t = 64)]
    pub prefix_byte_block: usize,

    /// Prefix block size in tokens for prompts given as token ids (the engine's
    /// KV block size).
    #[arg(long, env = "KVPICK_PREFIX_TOKEN_BLOCK", default_value_t = 16)]
    pub prefix_token_block: usize,

    /// Most prompt tokens prefix matching hashes and looks up (the llm-d Router's
    /// `maxPrefixTokensToMatch`); the blocks past them count as uncached. In
    /// blocks: this over `--prefix-token-block` (a text block of
    /// `--prefix-byte-block` bytes counts as one block). 0: the whole prompt.
    #[arg(long, env = "KVPICK_MAX_PREFIX_TOKENS", default_value_t = crate::scheduler::DEFAULT_MAX_PREFIX_TOKENS)]
    pub max_prefix_tokens: usize,

    /// Approximate prefix index: blocks remembered per worker rank until its
    /// scraped KV capacity is known.
    #[arg(long, env = "KVPICK_PREFIX_CAPACITY_BLOCKS", default_value_t = 31_250)]
    pub prefix_capacity_blocks: usize,

    /// Approximate prefix index: seconds an entry stays valid after its last use
    /// (0: no expiry, LRU only).
    #[arg(long, env = "KVPICK_PREFIX_TTL_SECS", default_value_t = 900)]
    pub prefix_ttl_secs: u64,

    /// Precise workers: seconds a routed prompt counts as held there
    /// (provisional entries) at most, from its first routing (the requests it
    /// attracts do not renew it); its blocks' KV events end it sooner.
    #[arg(long, env = "KVPICK_PROVISIONAL_TTL_SECS", default_value_t = 10)]
    pub provisional_ttl_secs: u64,

    /// Precise workers: milliseconds after a request's response began (or it
    /// ended without one) within which the worker's KV events must report the
    /// prompt's blocks; what they have not reported is no longer counted there.
    #[arg(long, env = "KVPICK_PROVISIONAL_CONFIRM_MS", default_value_t = 2_000)]
    pub provisional_confirm_ms: u64,

    /// Precise prefix index: KV-event blocks kept per worker rank until its engine's
    /// block count is scraped (then `num_gpu_blocks` × `--prefix-precise-slack`);
    /// stores beyond the cap are dropped and counted.
    #[arg(
        long,
        env = "KVPICK_PREFIX_PRECISE_MAX_BLOCKS",
        default_value_t = 1_000_000
    )]
    pub prefix_precise_max_blocks: usize,

    /// Precise prefix index: the cap per worker rank is the engine's scraped
    /// `num_gpu_blocks` times this (at least 1).
    #[arg(long, env = "KVPICK_PREFIX_PRECISE_SLACK", default_value_t = 1.5)]
    pub prefix_precise_slack: f64,

    /// Cost weight per prompt block the candidate must still prefill.
    #[arg(long, env = "KVPICK_WEIGHT_PREFILL", default_value_t = 1.0)]
    pub weight_prefill: f64,

    /// Cost weight per block of active load on the candidate (counted while it
    /// is saturated, or has no fresh scrape).
    #[arg(long, env = "KVPICK_WEIGHT_DECODE", default_value_t = 0.1)]
    pub weight_decode: f64,

    /// Cost weight per block of scraped queued work (queued requests at their
    /// uncached size).
    #[arg(long, env = "KVPICK_WEIGHT_QUEUE", default_value_t = 0.25)]
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
    /// The scheduler's plugin list an `EndpointPickerConfig` built (not a flag).
    #[arg(skip)]
    pub plugins: Option<crate::scheduler::Plugins>,
    /// Follow the workers' KV events (precise prefix mode) where engines publish them.
    #[arg(long, env = "KVPICK_KV_EVENTS", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub kv_events: bool,

    /// Engine KV-event PUB port when a pod has no `kvpick.io/kv-events-port`
    /// annotation (data-parallel rank r publishes on port + r, as vLLM does).
    #[arg(long, env = "KVPICK_KV_EVENTS_PORT", default_value_t = 5557)]
    pub kv_events_port: u16,

    /// Engine KV-event replay (ROUTER) port, to recover missed batches after a
    /// sequence gap (rank-offset like the PUB port). Without it a gap resets the worker.
    #[arg(long, env = "KVPICK_KV_EVENTS_REPLAY_PORT")]
    pub kv_events_replay_port: Option<u16>,

    /// Model name that KV-event blocks are keyed under when the event topic
    /// (`kv@<pod>@<model>`) does not name one: the `model` clients send.
    #[arg(long, env = "KVPICK_KV_EVENTS_MODEL", default_value = "")]
    pub kv_events_model: String,

    /// Largest KV-event message accepted from an engine, all frames together; a
    /// publisher that declares a larger one is disconnected (and its worker reset).
    #[arg(long, env = "KVPICK_KV_EVENTS_MAX_MESSAGE_BYTES",
          default_value_t = crate::kvevents::subscriber::DEFAULT_MAX_MESSAGE_BYTES)]
    pub kv_events_max_message_bytes: usize,

    /// Bytes of KV-event batches queued for the ingest thread, all workers
    /// together (raised to one largest message if lower); past it the worker
    /// holding the most loses its queued batches and is reset.
    #[arg(long, env = "KVPICK_KV_EVENTS_MAX_QUEUED_BYTES",
          default_value_t = crate::kvevents::subscriber::DEFAULT_MAX_QUEUED_BYTES)]
    pub kv_events_max_queued_bytes: usize,

    /// Share routing state with the pool's other kvpick replicas through this
    /// Redis/Valkey server (`redis://[:password@]host[:port][/db]`; see
    /// docs/replicas.md). Unset: a single replica, nothing shared.
    #[arg(long, env = "KVPICK_REPLICA_SYNC")]
    pub replica_sync: Option<String>,

    /// Longest a replica's warm start (loading the shared state) holds
    /// readiness back; past it the replica is Ready on its local state.
    #[arg(
        long,
        env = "KVPICK_REPLICA_SYNC_WARM_START_MS",
        default_value_t = 10_000
    )]
    pub replica_sync_warm_start_ms: u64,

    /// Silence after which a peer replica's bookings are released.
    #[arg(long, env = "KVPICK_REPLICA_SYNC_LEASE_MS", default_value_t = 5_000)]
    pub replica_sync_lease_ms: u64,

    /// Model directory with `tokenizer.json` (and `tokenizer_config.json` with the
    /// chat template): tokenize requests in-process so their blocks match KV events.
    #[arg(long, env = "KVPICK_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,

    /// Requests tokenized at once (on blocking threads, off the request path).
    #[arg(long, env = "KVPICK_TOKENIZER_THREADS", default_value_t = 2)]
    pub tokenizer_threads: usize,

    /// Vision model family of the served model (`qwen2-vl`, `qwen2.5-vl`,
    /// `qwen3-vl`, `llava-1.5`, `llava-next`): with `--tokenizer-dir`, image
    /// tokens are counted and carry SGLang pad values, so multimodal blocks match
    /// the engines' (exact multimodal routing).
    #[arg(long, env = "KVPICK_MM_MODEL_FAMILY", value_parser = parse_vision_family)]
    pub mm_model_family: Option<crate::multimodal::VisionFamily>,

    /// Vision patch size in pixels (`patch_size` of `preprocessor_config.json`).
    #[arg(long, env = "KVPICK_MM_PATCH_SIZE")]
    pub mm_patch_size: Option<u32>,

    /// Patches merged per side into one token (Qwen `merge_size`).
    #[arg(long, env = "KVPICK_MM_MERGE_SIZE")]
    pub mm_merge_size: Option<u32>,

    /// Fewest pixels after resizing (Qwen `min_pixels`).
    #[arg(long, env = "KVPICK_MM_MIN_PIXELS")]
    pub mm_min_pixels: Option<u64>,

    /// Most pixels after resizing (Qwen `max_pixels`).
    #[arg(long, env = "KVPICK_MM_MAX_PIXELS")]
    pub mm_max_pixels: Option<u64>,

    /// The token the engine repeats per image token (default per family:
    /// `<|image_pad|>`, `<image>`).
    #[arg(long, env = "KVPICK_MM_IMAGE_TOKEN")]
    pub mm_image_token: Option<String>,

    /// The text standing for one image in a prompt (default per family).
    #[arg(long, env = "KVPICK_MM_PLACEHOLDER")]
    pub mm_placeholder: Option<String>,

    /// Fetch remote (`https`) images to identify them by content and size them
    /// from their header, as `data:` URLs are (exact mode only: needs
    /// `--tokenizer-dir` and `--mm-model-family`). Off: remote images keep their
    /// URL identity. A failed fetch keeps it too, and is counted.
    #[arg(long, env = "KVPICK_MM_FETCH", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch: bool,

    /// The longest one image fetch may take, in milliseconds.
    #[arg(long, env = "KVPICK_MM_FETCH_TIMEOUT_MS", default_value_t = 500)]
    pub mm_fetch_timeout_ms: u64,

    /// The largest image fetched, in bytes.
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_BYTES", default_value_t = 8 << 20)]
    pub mm_fetch_max_bytes: usize,

    /// Image fetches running at once.
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_CONCURRENT", default_value_t = 16)]
    pub mm_fetch_max_concurrent: usize,

    /// Distinct image URLs fetched per request (the rest keep URL identities).
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_PER_REQUEST", default_value_t = 8)]
    pub mm_fetch_max_per_request: usize,

    /// Fetched image identities kept (URL -> hash and size, never the bytes).
    #[arg(long, env = "KVPICK_MM_FETCH_CACHE_ENTRIES", default_value_t = 1024)]
    pub mm_fetch_cache_entries: usize,

    /// How long a fetched identity is reused, in seconds.
    #[arg(long, env = "KVPICK_MM_FETCH_CACHE_TTL_SECS", default_value_t = 600)]
    pub mm_fetch_cache_ttl_secs: u64,

    /// A host images may be fetched from (repeatable; exact names). None: any
    /// host with only public addresses.
    #[arg(
        long = "mm-fetch-allow-host",
        env = "KVPICK_MM_FETCH_ALLOW_HOSTS",
        value_delimiter = ','
    )]
    pub mm_fetch_allow_hosts: Vec<String>,

    /// Also fetch plain `http` image URLs (off: `https` only).
    #[arg(long, env = "KVPICK_MM_FETCH_ALLOW_HTTP", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch_allow_http: bool,

    /// Also fetch from loopback, private and link-local addresses (off: a URL
    /// whose host resolves to any such address is refused). For tests and
    /// trusted in-cluster image servers only.
    #[arg(long, env = "KVPICK_MM_FETCH_ALLOW_PRIVATE", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch_allow_private: bool,

    /// Passive health: consecutive failing responses (5xx, or Envoy's 503 when it
    /// cannot connect) that take an endpoint out of the candidate set.
    #[arg(long, env = "KVPICK_EJECT_AFTER_FAILURES", default_value_t = 3)]
    pub eject_after_failures: u32,

    /// Passive health: how long the first ejection lasts; each one in a row doubles it.
    #[arg(long, env = "KVPICK_EJECT_BASE_MS", default_value_t = 1000)]
    pub eject_base_ms: u64,

    /// Passive health: the longest ejection.
    #[arg(long, env = "KVPICK_EJECT_MAX_MS", default_value_t = 60_000)]
    pub eject_max_ms: u64,

    /// Flow control: under saturation, queue requests by priority (fair across
    /// flows, with a TTL) and shed sheddable ones with 429. Off by default, as the
    /// llm-d Router's `flowControl` feature gate.
    #[arg(long, env = "KVPICK_FLOW_CONTROL", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub flow_control: bool,

    /// Priority of a request naming no known InferenceObjective and carrying no
    /// `nvext.agent_hints.priority` (negative: sheddable).
    #[arg(
        long,
        env = "KVPICK_DEFAULT_PRIORITY",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub default_priority: i32,

    /// InferenceObjective priorities without Kubernetes (standalone), or as a base
    /// the watched objectives override: `name=priority[,name=priority...]`.
    #[arg(long, env = "KVPICK_INFERENCE_OBJECTIVES", default_value = "")]
    pub inference_objectives: String,

    /// Watch the pool namespace's InferenceObjectives (`llm-d.ai/v1alpha2` and
    /// `inference.networking.x-k8s.io/v1alpha2`) in Kubernetes pool mode.
    #[arg(long, env = "KVPICK_WATCH_INFERENCE_OBJECTIVES", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub watch_inference_objectives: bool,

    /// Flow control: longest a request waits in a queue, in ms (then 429).
    #[arg(long, env = "KVPICK_FLOW_CONTROL_TTL_MS", default_value_t = 60_000)]
    pub flow_control_ttl_ms: u64,

    /// Flow control: most requests queued in one priority band (then 429).
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_MAX_BAND_REQUESTS",
        default_value_t = 5000
    )]
    pub flow_control_max_band_requests: usize,

    /// Flow control: most body bytes queued in one priority band (then 429).
    #[arg(long, env = "KVPICK_FLOW_CONTROL_MAX_BAND_BYTES", default_value_t = 256 << 20)]
    pub flow_control_max_band_bytes: usize,

    /// Saturation: engine queue length at which a worker counts as full.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_QUEUE_DEPTH_THRESHOLD",
        default_value_t = 5.0
    )]
    pub flow_control_queue_depth_threshold: f64,

    /// Saturation: KV-cache usage (0..1) at which a worker counts as full.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_KV_CACHE_UTIL_THRESHOLD",
        default_value_t = 0.8
    )]
    pub flow_control_kv_cache_util_threshold: f64,

    /// Saturation: requests kvpick has in flight on one worker rank at which it
    /// counts as full (0: booked load left out).
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_MAX_IN_FLIGHT_PER_RANK",
        default_value_t = 100
    )]
    pub flow_control_max_in_flight_per_rank: u32,

    /// Flow control: how often (ms) saturation is re-read while requests wait.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_DISPATCH_INTERVAL_MS",
        default_value_t = 5
    )]
    pub flow_control_dispatch_interval_ms: u64,
}

fn parse_vision_family(s: &str) -> Result<crate::multimodal::VisionFamily, String> {
    crate::multimodal::VisionFamily::parse(s).ok_or_else(|| {
        format!("unknown vision model family {s:?} (qwen2-vl, qwen2.5-vl, qwen3-vl, llava-1.5, llava-next)")
    })
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

/// GIE EPP flags: the ones that map to kvpick are honoured, the rest are accepted
/// and ignored with a warning (see `docs/discovery.md`). Hidden from `--help`.
#[derive(Debug, Clone, Default, ClapArgs)]
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
    /// Ignored with a warning.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
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
    /// scorers kvpick has an equivalent for set its cost weights.
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
    /// Ignored with a warning.
    #[arg(long, hide = true)]
    pub lora_info_metric: Option<String>,
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
            ("tracing", self.tracing.is_some()),
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
            ("lora-info-metric", self.lora_info_metric.is_some()),
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

/// Parses a Go `time.Duration` string such as `50ms`, `2s`, `1m30s` or `1.5h`.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = s;
    let mut total = 0f64;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("{s:?}: missing unit (ns, us, ms, s, m, h)"))?;
        let value: f64 = rest[..num_end]
            .parse()
            .map_err(|_| format!("{s:?}: bad number"))?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            u => return Err(format!("{s:?}: unknown unit {u:?}")),
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Ok(Duration::from_secs_f64(total))
}

/// The pool namespace as the GIE EPP resolves it: the flag unless unset or
/// `default`, then the `NAMESPACE` environment variable, then `default`.
pub fn resolve_namespace(flag: Option<&str>, env_namespace: Option<&str>) -> String {
    let flag = flag.map(str::trim).filter(|s| !s.is_empty());
    match (flag, env_namespace.map(str::trim).filter(|s| !s.is_empty())) {
        (Some(f), _) if f != "default" => f.to_string(),
        (_, Some(env)) => env.to_string(),
        (f, None) => f.unwrap_or("default").to_string(),
    }
}

impl Args {
    /// The vision model the `--mm-*` flags describe, or `None` without a family.
    pub fn vision_prompt(&self) -> Option<crate::multimodal::VisionPrompt> {
        let mut v = crate::multimodal::VisionPrompt::new(self.mm_model_family?);
        let p = &mut v.model.processor;
        p.patch_size = self.mm_patch_size.unwrap_or(p.patch_size);
        p.merge_size = self.mm_merge_size.unwrap_or(p.merge_size);
        p.min_pixels = self.mm_min_pixels.unwrap_or(p.min_pixels);
        p.max_pixels = self.mm_max_pixels.unwrap_or(p.max_pixels);
        if let Some(t) = &self.mm_image_token {
            v.image_token = t.clone();
        }
        if let Some(t) = &self.mm_placeholder {
            v.placeholder = t.clone();
        }
        Some(v)
    }

    /// Remote image fetching as the `--mm-fetch*` flags set it, or `None` when off.
    pub fn image_fetch(
        &self,
    ) -> Option<(
        crate::image_fetch::FetchPolicy,
        crate::multimodal::remote::FetchLimits,
    )> {
        self.mm_fetch.then(|| {
            let policy = crate::image_fetch::FetchPolicy {
                allow_http: self.mm_fetch_allow_http,
                allow_private: self.mm_fetch_allow_private,
                allow_hosts: self
                    .mm_fetch_allow_hosts
                    .iter()
                    .map(|h| h.trim().to_ascii_lowercase())
                    .filter(|h| !h.is_empty())
                    .collect(),
                max_bytes: self.mm_fetch_max_bytes,
            };
            let limits = crate::multimodal::remote::FetchLimits {
                timeout: Duration::from_millis(self.mm_fetch_timeout_ms),
                max_concurrent: self.mm_fetch_max_concurrent,
                max_per_request: self.mm_fetch_max_per_request,
                cache_entries: self.mm_fetch_cache_entries,
                cache_ttl: Duration::from_secs(self.mm_fetch_cache_ttl_secs),
            };
            (policy, limits)
        })
    }

    /// KV-event subscriber settings, or `None` when `--kv-events=false`.
    pub fn kv_events(&self) -> Option<SubscriberConfig> {
        self.kv_events.then(|| SubscriberConfig {
            port: self.kv_events_port,
            replay_port: self.kv_events_replay_port,
            model: self.kv_events_model.clone(),
            max_message_bytes: self.kv_events_max_message_bytes,
            max_queued_bytes: self.kv_events_max_queued_bytes,
            ..SubscriberConfig::default()
        })
    }

    /// Replica sync settings, when `--replica-sync` is set; the stream is
    /// keyed by `pool`.
    pub fn replica_sync(
        &self,
        pool: &str,
    ) -> Result<Option<crate::replica_sync::SyncConfig>, crate::replica_sync::resp::RespError> {
        let Some(url) = &self.replica_sync else {
            return Ok(None);
        };
        let mut c = crate::replica_sync::SyncConfig::new(url, pool)?;
        c.warm_start_timeout = Duration::from_millis(self.replica_sync_warm_start_ms);
        c.lease = Duration::from_millis(self.replica_sync_lease_ms.max(1));
        Ok(Some(c))
    }

    /// The scheduler settings these flags describe; `session_key` is loaded by the caller.
    pub fn scheduler(&self, session_key: Vec<u8>) -> SchedulerConfig {
        SchedulerConfig {
            byte_block: self.prefix_byte_block.max(1),
            token_block: self.prefix_token_block.max(1),
            max_prefix_blocks: match self.max_prefix_tokens {
                0 => usize::MAX,
                t => (t / self.prefix_token_block.max(1)).max(1),
            },
            weights: Weights {
                prefill: self.weight_prefill,
                decode: self.weight_decode,
                queue: self.weight_queue,
                kv_usage: self.weight_kv_usage,
                prefill_overlap: self.weight_prefill_overlap,
            },
            temperature: self.temperature.max(0.0),
            plugins: self.plugins.clone(),
            tie_break_seed: None,
            scrape_max_age: self.scrape_staleness(),
            index: IndexConfig {
                default_capacity: self.prefix_capacity_blocks,
                ttl: (self.prefix_ttl_secs > 0).then(|| Duration::from_secs(self.prefix_ttl_secs)),
                default_precise_limit: self.prefix_precise_max_blocks,
                precise_slack: self.prefix_precise_slack.max(1.0),
                // kvpick's block hashes and the engines' are chained.
                chained: true,
            },
            provisional_ttl: Duration::from_secs(self.provisional_ttl_secs.max(1)),
            provisional_confirm: Duration::from_millis(self.provisional_confirm_ms),
            session_token_header: self.session_token_header.to_ascii_lowercase(),
            session_key,
            vision: self.vision_prompt().map(|v| v.model),
            session_max_entries: self.session_max_entries.max(1),
            session_token_max_lifetime: Duration::from_secs(
                self.session_token_max_lifetime_secs.max(1),
            ),
            default_osl_tokens: self.default_osl_tokens,
            max_request_load_blocks: self.max_request_load_blocks.max(1),
            sglang_bootstrap_port: (self.sglang_bootstrap_port != 0)
                .then_some(self.sglang_bootstrap_port),
            health: crate::health::HealthConfig {
                failures: self.eject_after_failures.max(1),
                base_ejection: Duration::from_millis(self.eject_base_ms),
                max_ejection: Duration::from_millis(self.eject_max_ms.max(self.eject_base_ms)),
            },
        }
    }

    /// Reads `--config-file` / `--config-text`, sets the cost weights from its
    /// scorers and the scheduler's plugin list from its main profile (see
    /// [`crate::endpoint_picker_config`]); `None` without one.
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
        let base = Weights {
            prefill: self.weight_prefill,
            decode: self.weight_decode,
            queue: self.weight_queue,
            kv_usage: self.weight_kv_usage,
            prefill_overlap: self.weight_prefill_overlap,
        };
        let mapping = crate::endpoint_picker_config::map(&text, base, self.temperature.max(0.0))?;
        self.plugins = mapping.plugins.clone();
        let w = mapping.weights;
        self.weight_prefill = w.prefill;
        self.weight_decode = w.decode;
        self.weight_queue = w.queue;
        self.weight_kv_usage = w.kv_usage;
        self.weight_prefill_overlap = w.prefill_overlap;
        Ok(Some(mapping))
    }

    /// How often to look for changed certificate files, if at all.
    pub fn cert_reload_interval(&self) -> Option<Duration> {
        self.enable_cert_reload
            .then(|| Duration::from_millis(self.cert_reload_interval_ms))
    }

    /// The bound on one ext_proc TLS handshake.
    pub fn tls_handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.tls_handshake_timeout_ms)
    }

    /// How long open streams may finish on shutdown.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    /// The namespace to watch (see [`resolve_namespace`]).
    pub fn namespace(&self) -> String {
        let env = std::env::var("NAMESPACE").ok();
        resolve_namespace(self.pool_namespace.as_deref(), env.as_deref())
    }

    /// The scrape interval (`--refresh-metrics-interval` wins over `--scrape-interval-ms`).
    pub fn scrape_interval(&self) -> Duration {
        self.gie
            .refresh_metrics_interval
            .unwrap_or(Duration::from_millis(self.scrape_interval_ms))
            .max(Duration::from_millis(1))
    }

    /// How old scraped load may be (`--metrics-staleness-threshold` wins).
    pub fn scrape_staleness(&self) -> Duration {
        self.gie
            .metrics_staleness_threshold
            .unwrap_or(Duration::from_millis(self.scrape_staleness_ms))
    }

    /// The scraper settings these flags describe.
    pub fn scrape(&self) -> crate::scrape::ScrapeConfig {
        crate::scrape::ScrapeConfig {
            interval: self.scrape_interval(),
            timeout: Duration::from_millis(self.scrape_timeout_ms.max(1)),
            concurrency: self.scrape_concurrency.max(1),
            path: self.gie.model_server_metrics_path.clone(),
            port: self.gie.model_server_metrics_port,
        }
    }

    /// The log format (`--zap-encoder json` selects JSON).
    pub fn log_format(&self) -> LogFormat {
        match self.gie.zap_encoder.as_deref() {
            Some("json") => LogFormat::Json,
            Some("console") => LogFormat::Text,
            _ => self.log_format,
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

    /// The admission settings these flags describe.
    pub fn admission(&self) -> crate::admission::AdmissionConfig {
        crate::admission::AdmissionConfig {
            enabled: self.flow_control,
            default_priority: self.default_priority,
            ttl: Duration::from_millis(self.flow_control_ttl_ms),
            max_band_requests: self.flow_control_max_band_requests,
            max_band_bytes: self.flow_control_max_band_bytes,
            dispatch_interval: Duration::from_millis(self.flow_control_dispatch_interval_ms.max(1)),
            saturation: crate::admission::SaturationConfig {
                queue_depth_threshold: self.flow_control_queue_depth_threshold,
                kv_cache_util_threshold: self.flow_control_kv_cache_util_threshold,
                max_in_flight_per_rank: self.flow_control_max_in_flight_per_rank,
                metrics_staleness: self.scrape_staleness(),
            },
        }
    }

    /// The ext_proc handler settings these flags describe.
    pub fn ext_proc(&self) -> ExtProcConfig {
        ExtProcConfig {
            max_body_bytes: self.max_body_bytes,
            body_wait: Duration::from_millis(self.body_wait_ms),
            body_budget_bytes: self
                .body_budget_bytes
                .unwrap_or_else(crate::extproc::budget::default_budget_bytes),
            body_deadline: Duration::from_millis(self.body_deadline_ms.max(1)),
            session_header: self.session_header.to_ascii_lowercase(),
            session_token_header: self.session_token_header.to_ascii_lowercase(),
            conformance_test_hooks: self.conformance_test_hooks,
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
        let o = crate::admission::priority::parse_objectives(&a.inference_objectives).unwrap();
        assert_eq!(o.get("batch"), Some(&-1));
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
        assert_eq!((c.max_prefix_blocks, d.max_prefix_blocks), (8192, 8192));
        let whole = Args::try_parse_from(["kvpick", "--max-prefix-tokens=0"]).unwrap();
        assert_eq!(whole.scheduler(Vec::new()).max_prefix_blocks, usize::MAX);
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

    #[test]
    fn enable_cert_reload_is_honoured_not_warned_about() {
        let a = Args::try_parse_from([
            "kvpick",
            "--enable-cert-reload",
            "--cert-reload-interval-ms",
            "250",
        ])
        .unwrap();
        assert_eq!(a.cert_reload_interval(), Some(Duration::from_millis(250)));
        assert!(a.gie.warnings().is_empty(), "{:?}", a.gie.warnings());
        let a = Args::try_parse_from(["kvpick", "--enable-cert-reload=false"]).unwrap();
        assert_eq!(a.cert_reload_interval(), None);
        assert_eq!(a.tls_handshake_timeout(), Duration::from_secs(10));
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
        let w = a.scheduler(Vec::new()).weights;
        assert_eq!((w.prefill, w.decode), (1.0, 0.0));
        // The flag weights scaled by the scorers' ratios (queue flag default 0.25).
        assert!((w.queue - 0.25 * 2.0 / 3.0).abs() < 1e-9 && (w.kv_usage - 2.0 / 3.0).abs() < 1e-9);
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
        assert_eq!(a.endpoint_selector.as_deref(), Some("app=vllm-qwen"));
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
        assert_eq!(a.pool_name.as_deref(), Some("llama"));
        assert_eq!(a.pool_group, "inference.networking.x-k8s.io");
        assert_eq!(a.log_format(), LogFormat::Json);
        assert_eq!(a.log_level(), "debug");
        assert_eq!(a.scrape_interval(), Duration::from_millis(100));
        assert_eq!(a.scrape_staleness(), Duration::from_secs(90));
        assert_eq!(a.scrape().port, Some(8080));
        assert_eq!(a.gie.tracing, Some(false));
        let warnings = a.gie.warnings();
        assert_eq!(warnings.len(), 5, "{warnings:?}");
        assert!(!warnings.iter().any(|w| w.contains("--config-file")));
        assert!(warnings
            .iter()
            .any(|w| w.contains("--ha-enable-leader-election")));

        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert!(a.gie.warnings().is_empty());
        assert_eq!(a.scrape_interval(), Duration::from_millis(50));
        assert_eq!(a.scrape_staleness(), Duration::from_secs(2));
        assert_eq!(a.pool_group, "inference.networking.k8s.io");
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("50ms"), Ok(Duration::from_millis(50)));
        assert_eq!(parse_go_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_go_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m"), Ok(Duration::from_secs(3720)));
        assert_eq!(parse_go_duration("0"), Ok(Duration::ZERO));
        assert!(parse_go_duration("5").is_err());
        assert!(parse_go_duration("5d").is_err());
        assert!(parse_go_duration("").is_err());
    }

    #[test]
    fn namespace_resolution_follows_gie() {
        assert_eq!(resolve_namespace(Some("team"), Some("other")), "team");
        assert_eq!(resolve_namespace(None, Some("other")), "other");
        assert_eq!(resolve_namespace(Some("default"), Some("other")), "other");
        assert_eq!(resolve_namespace(Some("default"), None), "default");
        assert_eq!(resolve_namespace(None, None), "default");
        assert_eq!(resolve_namespace(Some(""), Some(" ")), "default");
    }

    #[test]
    fn crd_subcommand() {
        let a = Args::try_parse_from(["kvpick", "crd"]).unwrap();
        assert!(matches!(a.command, Some(Command::Crd)));
    }

    #[test]
    fn kv_event_flags() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        let c = a.kv_events().unwrap();
        assert_eq!((c.port, c.replay_port), (5557, None));
        assert_eq!((a.tokenizer_dir.as_deref(), a.tokenizer_threads), (None, 2));
        let a = Args::try_parse_from([
            "kvpick",
            "--kv-events-port=6000",
            "--kv-events-replay-port=6100",
            "--kv-events-model=llama",
        ])
        .unwrap();
        let c = a.kv_events().unwrap();
        assert_eq!(
            (c.port, c.replay_port, c.model.as_str()),
            (6000, Some(6100), "llama")
        );
        let a = Args::try_parse_from(["kvpick", "--kv-events=false"]).unwrap();
        assert!(a.kv_events().is_none());
    }

    #[test]
    fn vision_flags() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert!(a.vision_prompt().is_none());
        let a = Args::try_parse_from([
            "kvpick",
            "--mm-model-family=qwen2.5-vl",
            "--mm-max-pixels=1003520",
            "--mm-image-token=<|img|>",
        ])
        .unwrap();
        let v = a.vision_prompt().unwrap();
        assert_eq!(v.model.family, crate::multimodal::VisionFamily::Qwen25Vl);
        assert_eq!(v.model.processor.max_pixels, 1_003_520);
        assert_eq!(v.model.processor.patch_size, 14);
        assert_eq!(v.image_token, "<|img|>");
        assert!(Args::try_parse_from(["kvpick", "--mm-model-family=gpt"]).is_err());
    }

    #[test]
    fn the_admin_port_is_off_and_on_loopback_by_default() {
        let a = Args::try_parse_from(["kvpick"]).unwrap();
        assert_eq!(a.admin_port, 0);
        assert!(a.admin_address.is_loopback());
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
        assert!(a.image_fetch().is_none());
        let (policy, limits) = Args::try_parse_from(["kvpick", "--mm-fetch"])
            .unwrap()
            .image_fetch()
            .unwrap();
        assert_eq!(policy, crate::image_fetch::FetchPolicy::default());
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
        .image_fetch()
        .unwrap();
        assert_eq!(policy.allow_hosts, ["img.example", "cdn.example"]);
        assert!(!policy.allow_http && !policy.allow_private);
        assert_eq!(policy.max_bytes, 1024);
        assert_eq!(limits.timeout, Duration::from_millis(250));
    }
}
