//! A mock vLLM worker with its sidecar: an OpenAI-compatible server backed by a
//! simulated paged KV cache, vLLM-named metrics, vLLM-format KV events, routing
//! header checks and session management, plus a debug view for tests.
//!
//! Disaggregated pools: a decode worker acts like llm-d's P/D routing sidecar
//! with its SGLang connector. On `x-prefill-instance-id` and the bootstrap
//! headers it sends the request, with SGLang's `bootstrap_host`,
//! `bootstrap_port` and `bootstrap_room` body fields added, to that prefill
//! worker (a peer set with [`WorkerHandle::set_prefill_peers`]), then decodes.
//! The prefill worker records the body fields in `/debug/seen`.
//!
//! Timing: a request waits for one of `max_running` slots, then its first
//! token comes after `ttft` plus `prefill_per_token` per uncached prompt token
//! plus `cpu_load_per_token` per prompt token loaded back from the CPU offload
//! tier, and each later token after `itl`; `speed` divides them all (a pool
//! mixing two GPU generations runs workers at different speeds). A prompt the
//! GPU holds costs no prefill, one the CPU tier holds its load (by default a
//! fifth of its prefill), a cold one its prefill.
//!
//! Offload tier (`cpu_offload_blocks` > 0): blocks the GPU pool evicts are
//! copied to a bounded CPU pool first, published as vLLM's CPU offloading
//! connector does (`BlockStored` with `medium: "CPU"` and engine hashes only,
//! then the GPU's `BlockRemoved`); a block the CPU pool drops is published as
//! `BlockRemoved` with `medium: "CPU"`. `/metrics` serves
//! the resulting queue, TTFT and inter-token times as vLLM's histograms.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics`, `GET /debug/seen`.

mod latency;

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;

use crate::kv_events::{KvEvent, Publisher};
use crate::kvcache::{Access, CacheEvent, KvCache};
use crate::serve::{AbortOnDrop, Server};
use crate::tokenizer;

/// Header naming the worker kvpick chose.
pub const WORKER_ID_HEADER: &str = "x-worker-instance-id";
/// Header naming the data-parallel rank kvpick chose.
pub const DP_RANK_HEADER: &str = "x-dp-rank";
/// Header naming the destination endpoint.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Header naming the prefill worker (disaggregated pools).
pub const PREFILL_ID_HEADER: &str = "x-prefill-instance-id";
/// Header naming the prefill worker's data-parallel rank.
pub const PREFILL_DP_RANK_HEADER: &str = "x-prefill-dp-rank";
/// SGLang disaggregation bootstrap host, port and room headers.
pub const BOOTSTRAP_HEADERS: [&str; 3] = [
    "x-prefill-bootstrap-host",
    "x-prefill-bootstrap-port",
    "x-prefill-bootstrap-room",
];
/// Session inactivity timeout when an `open` turn gives none (Dynamo's default).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(300);

/// How a mock worker behaves.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Served model name.
    pub model: String,
    /// Instance id; `None` means kvpick's default for the bound address
    /// (`kvpick::identity::instance_id_for("ip:port")`).
    pub instance_id: Option<u64>,
    /// Data-parallel ranks, each with its own KV cache.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in each rank's pool.
    pub num_blocks: usize,
    /// Fixed time to first token.
    pub ttft: Duration,
    /// Extra prefill time per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Blocks of the CPU offload tier of each rank (0: none).
    pub cpu_offload_blocks: usize,
    /// Time to load one prompt token's KV back from the CPU offload tier.
    pub cpu_load_per_token: Duration,
    /// Time between output tokens.
    pub itl: Duration,
    /// Rate multiplier of every simulated time above: 2.0 runs twice as fast,
    /// 0.5 half as fast. Finite, in `[0.001, 1000]`.
    pub speed: f64,
    /// Output tokens when the request names no `max_tokens`.
    pub default_max_tokens: usize,
    /// Requests running at once; more wait (`vllm:num_requests_waiting`).
    pub max_running: usize,
    /// Publish KV events on this port (0 = any free port); `None` disables them.
    pub kv_events_port: Option<u16>,
    /// ZMQ topic of KV events.
    pub kv_events_topic: String,
    /// Reject requests that carry no `x-worker-instance-id` (a sidecar behind a gateway).
    pub require_routing_headers: bool,
    /// Multimodal engine (SGLang pad_value mode): chat prompts are tokenized with
    /// the model's tokenizer and images expanded into pad values.
    pub vision: Option<crate::mock_vision::MockVision>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            model: "mock-model".into(),
            instance_id: None,
            dp_size: 1,
            block_size: 16,
            num_blocks: 1024,
            ttft: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(10),
            cpu_offload_blocks: 0,
            cpu_load_per_token: Duration::from_micros(2),
            itl: Duration::from_millis(1),
            speed: 1.0,
            default_max_tokens: 16,
            max_running: 64,
            kv_events_port: None,
            kv_events_topic: String::new(),
            require_routing_headers: false,
            vision: None,
        }
    }
}

/// One request as the worker saw it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SeenRequest {
    /// Request path.
    pub path: String,
    /// `x-worker-instance-id` as received.
    pub worker_instance_id: Option<String>,
    /// `x-dp-rank` as received.
    pub dp_rank: Option<String>,
    /// `x-gateway-destination-endpoint` as received.
    pub destination: Option<String>,
    /// `x-prefill-instance-id` as received.
    pub prefill_instance_id: Option<String>,
    /// `x-prefill-dp-rank` as received.
    pub prefill_dp_rank: Option<String>,
    /// `x-prefill-bootstrap-host`, `-port`, `-room` as received.
    pub bootstrap: [Option<String>; 3],
    /// `x-request-id` as received.
    pub request_id: Option<String>,
    /// W3C `traceparent` as received (the trace context kvpick passed on).
    pub traceparent: Option<String>,
    /// `nvext.session_control.session_id`.
    pub session_id: Option<String>,
    /// `nvext.session_control.action`.
    pub session_action: Option<String>,
    /// Image tokens in the prompt (multimodal mode).
    pub image_tokens: usize,
    /// Whether the request carried one `nvext.mm_hashes` entry per image.
    pub mm_hashes_given: bool,
    /// `nvext.session_control.timeout`.
    pub session_timeout: Option<u64>,
    /// The turn named a session this worker did not hold: served without
    /// isolation (Dynamo's graceful degradation), with a warning.
    pub session_unknown: bool,
    /// Prompt tokens served from the cache.
    pub hit_tokens: usize,
    /// Prompt tokens after those loaded back from the CPU offload tier.
    pub cpu_hit_tokens: usize,
    /// Prompt tokens.
    pub queried_tokens: usize,
    /// SGLang's `bootstrap_host`, `bootstrap_port`, `bootstrap_room` body
    /// fields as received (the request a decode sidecar sent a prefill worker).
    pub body_bootstrap: [Option<String>; 3],
    /// Status of the prefill request this decode worker sent first.
    pub prefill_status: Option<u16>,
    /// HTTP status the worker answered.
    pub status: u16,
    /// The error message, for rejected requests.
    pub error: Option<String>,
}

/// Running totals.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Counters {
    /// Requests answered 2xx.
    pub requests: u64,
    /// Requests rejected (4xx).
    pub errors: u64,
    /// Requests rejected because they were routed to another worker id.
    pub misdirected: u64,
    /// Prompt tokens served from the cache (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Prompt tokens looked up (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens loaded back from the CPU offload tier.
    pub cpu_hit_tokens: u64,
    /// Sessions open now.
    pub sessions_open: u64,
    /// Sessions ever opened.
    pub sessions_opened: u64,
    /// Sessions closed.
    pub sessions_closed: u64,
    /// Sessions closed because their inactivity timeout passed.
    pub sessions_expired: u64,
    /// Turns for sessions this worker did not hold, served without isolation.
    pub sessions_unknown: u64,
    /// Blocks freed by session closes.
    pub session_blocks_freed: u64,
    /// Blocks in use over all ranks.
    pub blocks_used: u64,
    /// Blocks over all ranks.
    pub blocks_total: u64,
}

impl Counters {
    /// Prefix-cache hit rate (hits / queries), 0 with no queries.
    pub fn hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }
}

/// What `/debug/seen` returns.
#[derive(Debug, Clone, Serialize)]
pub struct Seen {
    /// This worker's instance id.
    pub instance_id: u64,
    /// This worker's address.
    pub address: String,
    /// Totals.
    pub counters: Counters,
    /// Every request, in arrival order of completion.
    pub requests: Vec<SeenRequest>,
    /// Open session ids.
    pub sessions: Vec<String>,
}

struct Session {
    rank: u32,
    /// Inactivity timeout from the `open` turn.
    timeout: Duration,
    /// When the last turn arrived.
    last_used: Instant,
    /// Blocks the session pins (each once).
    pinned: HashSet<u64>,
    /// Blocks first stored by one of the session's turns: freed on close.
    created: HashSet<u64>,
}

struct Inner {
    caches: Vec<KvCache>,
    sessions: HashMap<String, Session>,
    seen: Vec<SeenRequest>,
    counters: Counters,
    /// Latency histograms per rank (vLLM's engine label).
    latency: Vec<latency::EngineLatency>,
}

struct Worker {
    config: WorkerConfig,
    instance_id: u64,
    address: SocketAddr,
    inner: Mutex<Inner>,
    slots: Arc<Semaphore>,
    waiting: AtomicU64,
    running: AtomicU64,
    healthy: AtomicBool,
    events: Option<Publisher>,
    /// Prefill workers by instance id (the decode sidecar's targets).
    prefill_peers: Mutex<HashMap<u64, SocketAddr>>,
    /// LoRA slots and resident adapters, served as `vllm:lora_requests_info`
    /// (`None`: LoRA off, no gauge).
    lora: Mutex<Option<(u32, Vec<String>)>>,
}

/// A running mock worker.
pub struct WorkerHandle {
    worker: Arc<Worker>,
    server: Server,
    kv_events_port: Option<u16>,
    events_task: Option<AbortOnDrop>,
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The HTTP listener could not bind.
    #[error("cannot bind {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
    /// The KV-event publisher could not start.
    #[error(transparent)]
    Events(#[from] crate::kv_events::PublishError),
    /// `speed` is not a finite multiplier in `[0.001, 1000]`.
    #[error("speed {0} is not in [0.001, 1000]")]
    Speed(f64),
}

impl WorkerHandle {
    /// Starts a worker on `addr` (port 0 for any free port).
    pub async fn start(addr: SocketAddr, config: WorkerConfig) -> Result<Self, WorkerError> {
        if !(0.001..=1000.0).contains(&config.speed) {
            return Err(WorkerError::Speed(config.speed));
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| WorkerError::Bind(addr, e))?;
        let address = listener
            .local_addr()
            .map_err(|e| WorkerError::Bind(addr, e))?;
        let instance_id = config
            .instance_id
            .unwrap_or_else(|| kvpick::identity::instance_id_for(&address.to_string()));
        let (events, kv_events_port, events_task) = match config.kv_events_port {
            Some(port) => {
                let (p, port, task) = Publisher::bind(
                    &address.ip().to_string(),
                    port,
                    config.kv_events_topic.clone(),
                )
                .await?;
                (Some(p), Some(port), Some(AbortOnDrop(task)))
            }
            None => (None, None, None),
        };
        let ranks = config.dp_size.max(1) as usize;
        let worker = Arc::new(Worker {
            inner: Mutex::new(Inner {
                caches: (0..ranks)
                    .map(|_| {
                        KvCache::with_offload(
                            config.block_size,
                            config.num_blocks,
                            config.cpu_offload_blocks,
                        )
                    })
                    .collect(),
                sessions: HashMap::new(),
                seen: Vec::new(),
                counters: Counters::default(),
                latency: (0..ranks).map(|_| latency::EngineLatency::new()).collect(),
            }),
            slots: Arc::new(Semaphore::new(config.max_running.max(1))),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            events,
            prefill_peers: Mutex::new(HashMap::new()),
            lora: Mutex::new(None),
            instance_id,
            address,
            config,
        });
        let server = Server::start(listener, router(Arc::clone(&worker)));
        Ok(WorkerHandle {
            worker,
            server,
            kv_events_port,
            events_task,
        })
    }

    /// Serves `vllm:lora_requests_info` with `max_lora` slots and `resident`
    /// adapters running, as vLLM started with `--enable-lora` does.
    pub fn set_lora(&self, max_lora: u32, resident: &[&str]) {
        let names = resident.iter().map(|a| a.to_string()).collect();
        *self.worker.lora.lock() = Some((max_lora, names));
    }

    /// The prefill workers this (decode) worker's sidecar may send prefill
    /// requests to, by instance id.
    pub fn set_prefill_peers(&self, peers: impl IntoIterator<Item = (u64, SocketAddr)>) {
        *self.worker.prefill_peers.lock() = peers.into_iter().collect();
    }

    /// The HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// The instance id this worker expects in `x-worker-instance-id`.
    pub fn instance_id(&self) -> u64 {
        self.worker.instance_id
    }

    /// The KV-event port, when publishing.
    pub fn kv_events_port(&self) -> Option<u16> {
        self.kv_events_port
    }

    /// What the worker has seen so far.
    pub fn seen(&self) -> Seen {
        self.worker.seen()
    }

    /// Totals so far.
    pub fn counters(&self) -> Counters {
        self.worker.seen().counters
    }

    /// Makes `/health` answer 503 (`false`) or 200 (`true`).
    pub fn set_healthy(&self, healthy: bool) {
        self.worker.healthy.store(healthy, Ordering::Relaxed);
    }

    /// Kills the worker: the listener and every open connection close at once.
    pub fn kill(&self) {
        self.server.stop();
        if let Some(t) = &self.events_task {
            t.0.abort();
        }
    }

    /// Serves until killed.
    pub async fn wait(self) {
        self.server.wait().await;
    }
}

fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<Worker>>, h: HeaderMap, b: Bytes| async move {
                serve_completion(s.0, Api::Chat, h, b).await
            }),
        )
        .route(
            "/v1/completions",
            post(|s: State<Arc<Worker>>, h: HeaderMap, b: Bytes| async move {
                serve_completion(s.0, Api::Completions, h, b).await
            }),
        )
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/debug/seen", get(debug_seen))
        .with_state(worker)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

async fn models(State(w): State<Arc<Worker>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": w.config.model, "object": "model", "owned_by": "kvpick-e2e"}],
    }))
}

async fn health(State(w): State<Arc<Worker>>) -> StatusCode {
    if w.healthy.load(Ordering::Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn debug_seen(State(w): State<Arc<Worker>>) -> Json<Seen> {
    Json(w.seen())
}

async fn metrics(State(w): State<Arc<Worker>>) -> Response {
    let (usage, hits, queries, histograms) = {
        let inner = w.inner.lock();
        let used: usize = inner.caches.iter().map(KvCache::used).sum();
        let total: usize = inner.caches.iter().map(KvCache::capacity).sum();
        (
            used as f64 / total.max(1) as f64,
            inner.counters.prefix_cache_hits,
            inner.counters.prefix_cache_queries,
            latency::render(&w.config.model, &inner.latency),
        )
    };
    let m = &w.config.model;
    let text = format!(
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"{m}\"}} {waiting}\n\
         # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"{m}\"}} {running}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{bs}\",num_gpu_blocks=\"{nb}\"}} 1.0\n\
         # HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits counter\n\
         vllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {hits}\n\
         # HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.\n\
         # TYPE vllm:prefix_cache_queries counter\n\
         vllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {queries}\n",
        waiting = w.waiting.load(Ordering::Relaxed),
        running = w.running.load(Ordering::Relaxed),
        bs = w.config.block_size,
        nb = w.config.num_blocks,
    );
    let mut text = text + &histograms;
    if let Some((max_lora, resident)) = w.lora.lock().clone() {
        // vLLM keeps every label combination it set, each valued with the
        // time it was last set: an older idle series stays on the page.
        let now = crate::kv_events::now_ts();
        text += &format!(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge\n\
             vllm:lora_requests_info{{max_lora=\"{max_lora}\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"}} {idle}\n\
             vllm:lora_requests_info{{max_lora=\"{max_lora}\",waiting_lora_adapters=\"\",running_lora_adapters=\"{running}\"}} {now}\n",
            idle = now - 60.0,
            running = resident.join(","),
        );
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// A rejected request: status, OpenAI error type, message.
struct Reject(StatusCode, &'static str, String);

impl Reject {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {"message": self.2, "type": self.1, "code": self.0.as_u16()}
        });
        (self.0, Json(body)).into_response()
    }
}

/// What the prompt needs from the body.
struct Prompt {
    tokens: Vec<u32>,
    image_tokens: usize,
    mm_hashes_given: bool,
    max_tokens: usize,
    stream: bool,
    session_id: Option<String>,
    session_action: Option<String>,
    session_timeout: Option<u64>,
}

fn header_str(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// The prompt tokens of chat `messages` under the worker's chat template: each
/// message is its role marker followed by its text, then the assistant marker.
pub fn chat_prompt_tokens(messages: &[Value]) -> Vec<u32> {
    let mut tokens = Vec::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        tokens.push(tokenizer::role_marker(role));
        tokens.extend(tokenizer::encode(&text_of(
            m.get("content").unwrap_or(&Value::Null),
        )));
    }
    tokens.push(tokenizer::role_marker("assistant"));
    tokens
}

fn parse_prompt(
    api: Api,
    body: &[u8],
    default_max: usize,
    vision: Option<&crate::mock_vision::MockVision>,
) -> Result<Prompt, Reject> {
    let bad = |m: String| Reject(StatusCode::BAD_REQUEST, "invalid_request_error", m);
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("body is not JSON: {e}")))?;
    let (mut image_tokens, mut mm_hashes_given) = (0, false);
    let tokens = match (api, vision) {
        (Api::Chat, Some(vision)) => {
            let t = vision.chat_tokens(&v).map_err(bad)?;
            image_tokens = t.image_tokens;
            mm_hashes_given = t.hashes_given;
            t.tokens
        }
        (Api::Chat, None) => chat_prompt_tokens(
            v.get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("`messages` must be an array".into()))?,
        ),
        (Api::Completions, _) => match v.get("prompt") {
            Some(Value::String(s)) => tokenizer::encode(s),
            Some(Value::Array(a)) if a.iter().all(Value::is_u64) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| t as u32)
                .collect(),
            Some(Value::Array(a)) => {
                tokenizer::encode(a.first().and_then(Value::as_str).unwrap_or(""))
            }
            _ => return Err(bad("`prompt` must be a string or an array".into())),
        },
    };
    let max_tokens = v
        .get("max_completion_tokens")
        .or_else(|| v.get("max_tokens"))
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .unwrap_or(default_max)
        .min(4096);
    let sc = v.get("nvext").and_then(|n| n.get("session_control"));
    Ok(Prompt {
        tokens,
        image_tokens,
        mm_hashes_given,
        max_tokens,
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        session_id: sc
            .and_then(|s| s.get("session_id"))
            .and_then(Value::as_str)
            .map(str::to_string),
        session_action: sc
            .and_then(|s| s.get("action"))
            .and_then(Value::as_str)
            .map(str::to_string),
        session_timeout: sc.and_then(|s| s.get("timeout")).and_then(Value::as_u64),
    })
}

const WORDS: &[&str] = &[
    "the", "cache", "block", "worker", "prefix", "token", "route", "session", "picks", "fast",
    "and", "keeps", "warm", "pool", "of", "gpus",
];

/// The deterministic reply to a prompt: `n` words chosen by the prompt's hash.
fn reply_words(prompt: &[u32], n: usize) -> Vec<&'static str> {
    let mut h = crate::kvcache::block_hash(None, prompt);
    (0..n)
        .map(|_| {
            h = h
                .wrapping_mul(0x5851_f42d_4c95_7f2d)
                .wrapping_add(1442695040888963407);
            WORDS[(h >> 33) as usize % WORDS.len()]
        })
        .collect()
}

impl Worker {
    fn seen(&self) -> Seen {
        let inner = self.inner.lock();
        let mut counters = inner.counters.clone();
        counters.blocks_used = inner.caches.iter().map(|c| c.used() as u64).sum();
        counters.blocks_total = inner.caches.iter().map(|c| c.capacity() as u64).sum();
        counters.sessions_open = inner.sessions.len() as u64;
        let mut sessions: Vec<String> = inner.sessions.keys().cloned().collect();
        sessions.sort();
        Seen {
            instance_id: self.instance_id,
            address: self.address.to_string(),
            counters,
            requests: inner.seen.clone(),
            sessions,
        }
    }

    /// `d` at this worker's speed.
    fn scaled(&self, d: Duration) -> Duration {
        Duration::try_from_secs_f64(d.as_secs_f64() / self.config.speed).unwrap_or(Duration::MAX)
    }

    /// Records into rank `rank`'s latency histograms.
    fn engine_latency(&self, rank: u32, f: impl FnOnce(&mut latency::EngineLatency)) {
        if let Some(l) = self.inner.lock().latency.get_mut(rank as usize) {
            f(l);
        }
    }

    fn record(&self, seen: SeenRequest) {
        let mut inner = self.inner.lock();
        if seen.status < 400 {
            inner.counters.requests += 1;
        } else {
            inner.counters.errors += 1;
            if seen.status == StatusCode::MISDIRECTED_REQUEST.as_u16() {
                inner.counters.misdirected += 1;
            }
        }
        inner.seen.push(seen);
    }

    /// Publishes cache changes of `rank` (the batch names the rank when dp size > 1).
    fn publish(&self, rank: u32, events: &[CacheEvent]) {
        if let Some(p) = &self.events {
            p.publish(
                events
                    .iter()
                    .map(|e| KvEvent::from_cache(e, self.config.block_size))
                    .collect(),
                (self.config.dp_size > 1).then_some(rank),
            );
        }
    }

    /// Whether the destination list names this worker after its first entry:
    /// a gateway's retry on a fallback, whose worker headers name the first.
    fn is_fallback(&self, headers: &HeaderMap) -> bool {
        let me = self.address.to_string();
        header_str(headers, DESTINATION_HEADER)
            .is_some_and(|list| list.split(',').skip(1).any(|d| d.trim() == me))
    }

    /// Checks routing headers and the session; returns the rank to serve on.
    /// A retried fallback serves on rank 0 (the headers are the first's).
    fn admit(&self, headers: &HeaderMap, prompt: &Prompt) -> Result<u32, Reject> {
        let fallback = self.is_fallback(headers);
        match header_str(headers, WORKER_ID_HEADER) {
            Some(_) if fallback => {}
            Some(id) if id.trim() != self.instance_id.to_string() => {
                return Err(Reject(
                    StatusCode::MISDIRECTED_REQUEST,
                    "misdirected_request",
                    format!(
                        "request routed to worker {id} arrived at worker {} ({})",
                        self.instance_id, self.address
                    ),
                ));
            }
            None if self.config.require_routing_headers => {
                return Err(Reject(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    format!("missing {WORKER_ID_HEADER}: requests must come through the gateway"),
                ));
            }
            _ => {}
        }
        let rank = match header_str(headers, DP_RANK_HEADER) {
            None => 0,
            Some(_) if fallback => 0,
            Some(r) => match r.trim().parse::<u32>() {
                Ok(r) if r < self.config.dp_size.max(1) => r,
                _ => {
                    return Err(Reject(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        format!(
                            "{DP_RANK_HEADER} {r:?} is not a rank of this worker (dp size {})",
                            self.config.dp_size
                        ),
                    ))
                }
            },
        };
        let Some(id) = &prompt.session_id else {
            return Ok(rank);
        };
        self.expire_sessions(Instant::now());
        let mut inner = self.inner.lock();
        match prompt.session_action.as_deref() {
            Some("open") => {
                if !inner.sessions.contains_key(id) {
                    let timeout = prompt
                        .session_timeout
                        .map_or(DEFAULT_SESSION_TIMEOUT, Duration::from_secs);
                    inner.sessions.insert(
                        id.clone(),
                        Session {
                            rank,
                            timeout,
                            last_used: Instant::now(),
                            pinned: HashSet::new(),
                            created: HashSet::new(),
                        },
                    );
                    inner.counters.sessions_opened += 1;
                }
                Ok(rank)
            }
            None | Some("close") => match inner.sessions.get_mut(id) {
                Some(s) if s.rank == rank => {
                    s.last_used = Instant::now();
                    Ok(rank)
                }
                Some(s) => Err(Reject(
                    StatusCode::MISDIRECTED_REQUEST,
                    "misdirected_request",
                    format!("session {id} lives on dp rank {}, not {rank}", s.rank),
                )),
                None => {
                    // Dynamo degrades gracefully: the turn is served without
                    // isolation and the router is warned.
                    tracing::warn!(
                        session = %id,
                        worker = self.instance_id,
                        "turn for a session that is not open here: served without isolation"
                    );
                    inner.counters.sessions_unknown += 1;
                    Ok(rank)
                }
            },
            Some(other) => Err(Reject(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("unknown session action {other:?} (open, close, or none)"),
            )),
        }
    }

    /// Closes every session idle past its timeout at `now`.
    fn expire_sessions(&self, now: Instant) {
        let expired: Vec<String> = {
            let inner = self.inner.lock();
            inner
                .sessions
                .iter()
                .filter(|(_, s)| now.saturating_duration_since(s.last_used) > s.timeout)
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in expired {
            if self.close_session(&id) {
                self.inner.lock().counters.sessions_expired += 1;
            }
        }
    }

    /// Whether `id` names a session open here.
    fn holds_session(&self, id: &str) -> bool {
        self.inner.lock().sessions.contains_key(id)
    }

    /// Runs the prompt through the rank's cache (and pins it for a session).
    fn prefill(&self, rank: u32, prompt: &Prompt) -> Access {
        let mut inner = self.inner.lock();
        let access = self.cache_tokens(&mut inner, rank, prompt, &prompt.tokens);
        inner.counters.prefix_cache_hits += access.hit_tokens as u64;
        inner.counters.cpu_hit_tokens += access.cpu_hit_tokens as u64;
        inner.counters.prefix_cache_queries += access.queried_tokens as u64;
        access
    }

    /// Time to the first token of a prompt that `access` found: the fixed
    /// time, the uncached tokens' prefill and the CPU tier's tokens' load.
    fn first_token_after(&self, access: &Access) -> Duration {
        let loaded = access.cpu_hit_tokens as u32;
        let uncached = access
            .queried_tokens
            .saturating_sub(access.hit_tokens + access.cpu_hit_tokens)
            as u32;
        self.scaled(
            self.config.ttft
                + self.config.prefill_per_token * uncached
                + self.config.cpu_load_per_token * loaded,
        )
    }

    /// Caches the generated tokens after the prompt, as an engine keeps them.
    fn store_output(&self, rank: u32, prompt: &Prompt, output: &[u32]) {
        let mut all = prompt.tokens.clone();
        all.extend_from_slice(output);
        let mut inner = self.inner.lock();
        self.cache_tokens(&mut inner, rank, prompt, &all);
    }

    /// Runs `tokens` through the rank's cache, pins the blocks for the prompt's
    /// session, and publishes the resulting KV events.
    fn cache_tokens(
        &self,
        inner: &mut Inner,
        rank: u32,
        prompt: &Prompt,
        tokens: &[u32],
    ) -> Access {
        let (access, present) = inner.caches[rank as usize].access(tokens);
        if let Some(s) = prompt
            .session_id
            .as_ref()
            .and_then(|id| inner.sessions.get_mut(id))
        {
            pin_for_session(
                &mut inner.caches[rank as usize],
                s,
                &present,
                &access.events,
            );
        }
        self.publish(rank, &access.events);
        access
    }

    /// Ends a session: unpins its blocks and frees those it created; false if
    /// it was not open.
    fn close_session(&self, id: &str) -> bool {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let Some(s) = inner.sessions.remove(id) else {
            return false;
        };
        let pinned: Vec<u64> = s.pinned.iter().copied().collect();
        let freed = inner.caches[s.rank as usize].release(&pinned, &s.created);
        inner.counters.sessions_closed += 1;
        inner.counters.session_blocks_freed += freed.len() as u64;
        if !freed.is_empty() {
            self.publish(s.rank, &[CacheEvent::Removed(freed)]);
        }
        true
    }
}

fn pin_for_session(cache: &mut KvCache, s: &mut Session, present: &[u64], events: &[CacheEvent]) {
    for e in events {
        if let CacheEvent::Stored { hashes, .. } = e {
            s.created.extend(hashes.iter().copied());
        }
        if let CacheEvent::Removed(hashes) = e {
            for h in hashes {
                s.created.remove(h);
            }
        }
    }
    let new: Vec<u64> = present
        .iter()
        .copied()
        .filter(|h| !s.pinned.contains(h))
        .collect();
    cache.pin(&new);
    s.pinned.extend(new);
}

/// Releases the running slot and closes the session when the response ends
/// (also when the client goes away mid-stream).
struct Finish {
    worker: Arc<Worker>,
    close_session: Option<String>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.worker.running.fetch_sub(1, Ordering::Relaxed);
        if let Some(id) = self.close_session.take() {
            let _ = self.worker.close_session(&id);
        }
    }
}

/// SGLang's disaggregation request fields, in header order.
const BODY_BOOTSTRAP_FIELDS: [&str; 3] = ["bootstrap_host", "bootstrap_port", "bootstrap_room"];

/// What the decode sidecar sends its prefill worker: the prefill peer and the
/// bootstrap host, port and room from kvpick's headers.
struct PrefillTarget {
    addr: SocketAddr,
    host: String,
    port: u64,
    room: u64,
}

impl Worker {
    /// The prefill request to send first, when the headers name a known prefill
    /// worker and carry the three bootstrap headers.
    fn prefill_target(&self, headers: &HeaderMap) -> Option<PrefillTarget> {
        let id: u64 = header_str(headers, PREFILL_ID_HEADER)?.parse().ok()?;
        let addr = *self.prefill_peers.lock().get(&id)?;
        let [host, port, room] = BOOTSTRAP_HEADERS.map(|h| header_str(headers, h));
        Some(PrefillTarget {
            addr,
            host: host?,
            port: port?.parse().ok()?,
            room: room?.parse().ok()?,
        })
    }
}

/// Sends the prefill request (the body with SGLang's bootstrap fields, as
/// llm-d's sidecar does) and returns its status (502 when it failed to send).
async fn send_prefill(t: PrefillTarget, api: Api, mut body: Value) -> u16 {
    if let Some(obj) = body.as_object_mut() {
        obj.insert("bootstrap_host".into(), json!(t.host));
        obj.insert("bootstrap_port".into(), json!(t.port));
        obj.insert("bootstrap_room".into(), json!(t.room));
    }
    match crate::client::Client::new(t.addr)
        .post_json(api.path(), &body, &[])
        .await
    {
        Ok(reply) => reply.status.as_u16(),
        Err(e) => {
            tracing::warn!(prefill = %t.addr, error = %kvpick::error_chain::ErrorChain(&e), "prefill request failed");
            StatusCode::BAD_GATEWAY.as_u16()
        }
    }
}

async fn serve_completion(w: Arc<Worker>, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let mut seen = SeenRequest {
        path: api.path().to_string(),
        worker_instance_id: header_str(&headers, WORKER_ID_HEADER),
        dp_rank: header_str(&headers, DP_RANK_HEADER),
        destination: header_str(&headers, DESTINATION_HEADER),
        prefill_instance_id: header_str(&headers, PREFILL_ID_HEADER),
        prefill_dp_rank: header_str(&headers, PREFILL_DP_RANK_HEADER),
        bootstrap: BOOTSTRAP_HEADERS.map(|h| header_str(&headers, h)),
        request_id: header_str(&headers, "x-request-id"),
        traceparent: header_str(&headers, "traceparent"),
        session_id: None,
        session_action: None,
        image_tokens: 0,
        mm_hashes_given: false,
        session_timeout: None,
        session_unknown: false,
        hit_tokens: 0,
        cpu_hit_tokens: 0,
        queried_tokens: 0,
        body_bootstrap: [None, None, None],
        prefill_status: None,
        status: 200,
        error: None,
    };
    let json_body: Option<Value> = serde_json::from_slice(&body).ok();
    if let Some(b) = &json_body {
        seen.body_bootstrap = BODY_BOOTSTRAP_FIELDS.map(|f| match b.get(f) {
            Some(Value::String(v)) => Some(v.clone()),
            Some(v) if !v.is_null() => Some(v.to_string()),
            _ => None,
        });
    }
    let admitted = parse_prompt(
        api,
        &body,
        w.config.default_max_tokens,
        w.config.vision.as_ref(),
    )
    .and_then(|p| {
        seen.session_id = p.session_id.clone();
        seen.session_action = p.session_action.clone();
        seen.image_tokens = p.image_tokens;
        seen.mm_hashes_given = p.mm_hashes_given;
        seen.session_timeout = p.session_timeout;
        w.expire_sessions(Instant::now());
        let known = p.session_id.as_deref().map(|id| w.holds_session(id));
        let admitted = w.admit(&headers, &p).map(|rank| (p, rank));
        if let (Ok((p, _)), Some(known)) = (&admitted, known) {
            seen.session_unknown = !known && p.session_action.as_deref() != Some("open");
        }
        admitted
    });
    let (prompt, rank) = match admitted {
        Ok(ok) => ok,
        Err(reject) => {
            seen.status = reject.0.as_u16();
            seen.error = Some(reject.2.clone());
            w.record(seen);
            return reject.into_response();
        }
    };
    let arrived = Instant::now();
    w.waiting.fetch_add(1, Ordering::Relaxed);
    let permit = match Arc::clone(&w.slots).acquire_owned().await.ok() {
        Some(p) => p,
        None => {
            w.waiting.fetch_sub(1, Ordering::Relaxed);
            return Reject(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "worker is shutting down".into(),
            )
            .into_response();
        }
    };
    w.waiting.fetch_sub(1, Ordering::Relaxed);
    w.running.fetch_add(1, Ordering::Relaxed);
    w.engine_latency(rank, |l| l.queued(arrived.elapsed()));
    let finish = Finish {
        worker: Arc::clone(&w),
        close_session: (prompt.session_action.as_deref() == Some("close"))
            .then(|| prompt.session_id.clone())
            .flatten(),
        _permit: permit,
    };
    if let (Some(target), Some(b)) = (w.prefill_target(&headers), json_body) {
        seen.prefill_status = Some(send_prefill(target, api, b).await);
    }
    let access = w.prefill(rank, &prompt);
    let (hit, queried) = (access.hit_tokens, access.queried_tokens);
    seen.hit_tokens = hit;
    seen.cpu_hit_tokens = access.cpu_hit_tokens;
    seen.queried_tokens = queried;
    w.record(seen);
    let prefill = w.first_token_after(&access);
    let itl = w.scaled(w.config.itl);
    let words = reply_words(&prompt.tokens, prompt.max_tokens);
    let output: Vec<u32> = match &w.config.vision {
        Some(v) => v.encode(&words.join(" ")),
        None => words.iter().map(|wd| tokenizer::word_id(wd)).collect(),
    };
    let id = format!(
        "cmpl-{:016x}",
        crate::kvcache::block_hash(None, &prompt.tokens)
    );
    let created = crate::kv_events::now_ts() as u64;
    let usage = json!({
        "prompt_tokens": queried,
        "completion_tokens": words.len(),
        "total_tokens": queried + words.len(),
        "prompt_tokens_details": {"cached_tokens": hit},
    });
    let model = w.config.model.clone();
    if !prompt.stream {
        tokio::time::sleep(prefill).await;
        w.engine_latency(rank, |l| l.first_token(arrived.elapsed()));
        let mut last = Instant::now();
        for _ in 1..words.len() {
            tokio::time::sleep(itl).await;
            let now = Instant::now();
            w.engine_latency(rank, |l| l.inter_token(now - last));
            last = now;
        }
        w.store_output(rank, &prompt, &output);
        drop(finish);
        let text = words.join(" ");
        let body = match api {
            Api::Chat => json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": usage,
            }),
            Api::Completions => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": usage,
            }),
        };
        return Json(body).into_response();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    tokio::spawn(async move {
        let finish = finish;
        let w = Arc::clone(&finish.worker);
        tokio::time::sleep(prefill).await;
        let last = words.len().saturating_sub(1);
        let mut emitted = Instant::now();
        for (i, word) in words.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(itl).await;
                let now = Instant::now();
                w.engine_latency(rank, |l| l.inter_token(now - emitted));
                emitted = now;
            } else {
                w.engine_latency(rank, |l| l.first_token(arrived.elapsed()));
            }
            let piece = if i == 0 {
                word.to_string()
            } else {
                format!(" {word}")
            };
            let finish_reason = if i == last {
                json!("stop")
            } else {
                Value::Null
            };
            let chunk = match api {
                Api::Chat => json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish_reason}],
                }),
                Api::Completions => json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": piece, "finish_reason": finish_reason}],
                }),
            };
            if tx
                .send(Bytes::from(format!("data: {chunk}\n\n")))
                .await
                .is_err()
            {
                return;
            }
        }
        let object = match api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        let tail = json!({"id": id, "object": object, "created": created, "model": model,
                          "choices": [], "usage": usage});
        let _ = tx.send(Bytes::from(format!("data: {tail}\n\n"))).await;
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        finish.worker.store_output(rank, &prompt, &output);
        drop(finish);
    });
    let stream = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}
