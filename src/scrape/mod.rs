//! Polls every endpoint's Prometheus `/metrics` and stores its load in the
//! [`EndpointTable`] ([`EndpointState::set_scraped`]).
//!
//! Each tick (default 50 ms) starts a scrape for every endpoint that has none in
//! flight, up to a concurrency bound; each scrape has its own timeout, so a slow or
//! dead worker only delays itself. Metric names follow the engine label:
//!
//! | figure | vLLM | SGLang | trtllm-serve |
//! | --- | --- | --- | --- |
//! | queue | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `trtllm_num_requests_waiting` |
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` | `trtllm_num_requests_running` |
//! | KV usage (0-1) | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` | `trtllm_kv_cache_utilization` |
//! | block size | `vllm:cache_config_info{block_size}` | `sglang:cache_config_info{page_size}` | `trtllm_kv_cache_tokens_per_block` |
//! | blocks | `vllm:cache_config_info{num_gpu_blocks}` | `sglang:cache_config_info{num_pages}` | `trtllm_kv_cache_max_blocks` |
//!
//! trtllm names are also read with a `trtllm:` prefix (as Dynamo re-exports them).
//! Several samples of one gauge (one per data-parallel engine) are summed for queue
//! and running and averaged for KV usage.
//!
//! LoRA adapters ([`parse_lora`]) come from the gauge `--lora-info-metric` names
//! (GIE's flag and default, `vllm:lora_requests_info`; empty turns it off), read
//! on every engine's page as GIE reads it: labels `running_lora_adapters` and
//! `waiting_lora_adapters` (comma-separated names) and `max_lora` (slots), the
//! value the time the series was last set. vLLM keeps every label combination
//! it ever set, so the newest series with an adapter named wins (one with none
//! is the idle engine, whose adapters stay loaded: GIE skips it too). The base
//! model is the `model_name` label of the running gauge. SGLang and trtllm-serve
//! export no such gauge.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;
use prometheus_parse::{Sample, Scrape, Value};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::endpoints::{EndpointState, EndpointTable, Engine, LoraInfo, ScrapedLoad};
use crate::error_chain::ErrorChain;
use crate::telemetry::Metrics;

/// Largest metrics page read, in bytes.
const MAX_PAGE_BYTES: usize = 8 << 20;

/// Scraper settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time between scrape rounds.
    pub interval: Duration,
    /// Timeout of one scrape (connect, request and body).
    pub timeout: Duration,
    /// Most scrapes in flight at once.
    pub concurrency: usize,
    /// URL path of the metrics page.
    pub path: String,
    /// Port to scrape instead of each endpoint's own port.
    pub port: Option<u16>,
    /// The LoRA adapter gauge (`None`: adapters are not read).
    pub lora_info_metric: Option<String>,
}

/// GIE's default `--lora-info-metric`: vLLM's adapter gauge.
pub const DEFAULT_LORA_INFO_METRIC: &str = "vllm:lora_requests_info";

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            concurrency: 64,
            path: "/metrics".to_string(),
            port: None,
            lora_info_metric: Some(DEFAULT_LORA_INFO_METRIC.to_string()),
        }
    }
}

/// Why one scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Connection or protocol failure.
    #[error("request failed: {0}")]
    Http(String),
    /// The worker answered with a non-2xx status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// No complete answer within the timeout.
    #[error("timed out")]
    Timeout,
    /// The page is not Prometheus text.
    #[error("unparsable metrics: {0}")]
    Parse(String),
    /// A metric kvpick needs is absent.
    #[error("metric {0} missing")]
    Missing(&'static str),
}

impl ScrapeError {
    /// The failure's class, as the `reason` label of the scrape-error counter.
    pub fn reason(&self) -> ScrapeFailure {
        match self {
            ScrapeError::Http(_) => ScrapeFailure::Connect,
            ScrapeError::Status(_) => ScrapeFailure::Status,
            ScrapeError::Timeout => ScrapeFailure::Timeout,
            ScrapeError::Parse(_) => ScrapeFailure::Parse,
            ScrapeError::Missing(_) => ScrapeFailure::MissingMetric,
        }
    }
}

/// Classes of scrape failure (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScrapeFailure {
    /// Connection or protocol failure.
    Connect,
    /// A non-2xx status.
    Status,
    /// No complete answer in time.
    Timeout,
    /// Not Prometheus text.
    Parse,
    /// A metric kvpick needs is absent.
    MissingMetric,
}

impl ScrapeFailure {
    /// Every class, in label order.
    pub const ALL: [ScrapeFailure; 5] = [
        ScrapeFailure::Connect,
        ScrapeFailure::Status,
        ScrapeFailure::Timeout,
        ScrapeFailure::Parse,
        ScrapeFailure::MissingMetric,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ScrapeFailure::Connect => "connect",
            ScrapeFailure::Status => "status",
            ScrapeFailure::Timeout => "timeout",
            ScrapeFailure::Parse => "parse",
            ScrapeFailure::MissingMetric => "missing_metric",
        }
    }
}

/// Failed scrapes so far, by class (telemetry reads them).
#[derive(Debug, Default)]
pub struct ScrapeErrors([std::sync::atomic::AtomicU64; 5]);

impl ScrapeErrors {
    /// Counts one failure.
    pub fn record(&self, failure: ScrapeFailure) {
        self.0[failure as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Failures of one class so far.
    pub fn count(&self, failure: ScrapeFailure) -> u64 {
        self.0[failure as usize].load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Metric names of one engine.
struct Names {
    queue: &'static [&'static str],
    running: &'static [&'static str],
    kv_usage: &'static [&'static str],
    /// Info metric with block size and count as labels.
    cache_info: &'static [&'static str],
    block_size_label: &'static str,
    num_blocks_label: &'static str,
    /// Gauges with block size and count as values (trtllm).
    block_size_gauge: &'static [&'static str],
    num_blocks_gauge: &'static [&'static str],
}

fn names(engine: Engine) -> Names {
    match engine {
        Engine::Vllm => Names {
            queue: &["vllm:num_requests_waiting"],
            running: &["vllm:num_requests_running"],
            kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            cache_info: &["vllm:cache_config_info"],
            block_size_label: "block_size",
            num_blocks_label: "num_gpu_blocks",
            block_size_gauge: &[],
            num_blocks_gauge: &[],
        },
        Engine::Sglang => Names {
            queue: &["sglang:num_queue_reqs"],
            running: &["sglang:num_running_reqs"],
            kv_usage: &["sglang:token_usage"],
            cache_info: &["sglang:cache_config_info"],
            block_size_label: "page_size",
            num_blocks_label: "num_pages",
            block_size_gauge: &[],
            num_blocks_gauge: &[],
        },
        Engine::Trtllm => Names {
            queue: &["trtllm_num_requests_waiting", "trtllm:num_requests_waiting"],
            running: &["trtllm_num_requests_running", "trtllm:num_requests_running"],
            kv_usage: &["trtllm_kv_cache_utilization", "trtllm:kv_cache_utilization"],
            cache_info: &[],
            block_size_label: "",
            num_blocks_label: "",
            block_size_gauge: &[
                "trtllm_kv_cache_tokens_per_block",
                "trtllm:kv_cache_tokens_per_block",
            ],
            num_blocks_gauge: &["trtllm_kv_cache_max_blocks", "trtllm:kv_cache_max_blocks"],
        },
    }
}

fn scalar(v: &Value) -> Option<f64> {
    match v {
        Value::Gauge(x) | Value::Counter(x) | Value::Untyped(x) => {
            Some(*x).filter(|x| x.is_finite())
        }
        _ => None,
    }
}

/// The parser's name for `name` (see [`normalise_line`]).
fn parsed_name(name: &str) -> String {
    name.replace(':', "_")
}

/// Rewrites the metric name of a line so `prometheus-parse` (whose name pattern is
/// `\w+`) accepts it: `:` becomes `_` (`vllm:num_requests_waiting` is read as
/// `vllm_num_requests_waiting`). Label values are left alone.
fn normalise_line(line: &str) -> String {
    let line = line.trim_start();
    if let Some(comment) = line.strip_prefix('#') {
        let mut parts = comment.trim_start().splitn(3, char::is_whitespace);
        return match (parts.next(), parts.next(), parts.next()) {
            (Some(kw @ ("HELP" | "TYPE")), Some(name), rest) => {
                format!("# {kw} {} {}", parsed_name(name), rest.unwrap_or_default())
            }
            _ => String::new(),
        };
    }
    let end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let mut out = String::with_capacity(line.len());
    out.extend(line[..end].chars().map(|c| if c == ':' { '_' } else { c }));
    out.push_str(&line[end..]);
    out
}

/// The metric name of a sample line (empty for comments and blank lines).
fn sample_name(line: &str) -> &str {
    let line = line.trim_start();
    if line.starts_with('#') {
        return "";
    }
    let end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    &line[..end]
}

/// Values of the first name in `candidates` that has samples.
fn values(by_name: &HashMap<&str, Vec<&Sample>>, candidates: &[&str]) -> Vec<f64> {
    candidates
        .iter()
        .find_map(|n| {
            by_name
                .get(parsed_name(n).as_str())
                .filter(|s| !s.is_empty())
        })
        .map(|samples| samples.iter().filter_map(|s| scalar(&s.value)).collect())
        .unwrap_or_default()
}

/// Parses a metrics page of `engine` into load figures stamped `at`.
///
/// Only the sample lines of the metrics kvpick reads reach the parser: a vLLM page
/// is mostly histogram buckets, and skipping them makes parsing ~50x cheaper.
pub fn parse_load(engine: Engine, text: &str, at: Instant) -> Result<ScrapedLoad, ScrapeError> {
    let n = names(engine);
    let wanted: Vec<&str> = [
        n.queue,
        n.running,
        n.kv_usage,
        n.cache_info,
        n.block_size_gauge,
        n.num_blocks_gauge,
    ]
    .concat();
    let lines = text
        .lines()
        .filter(|l| wanted.contains(&sample_name(l)))
        .map(|l| Ok(normalise_line(l)));
    let scrape = Scrape::parse(lines).map_err(|e| ScrapeError::Parse(e.to_string()))?;
    let mut by_name: HashMap<&str, Vec<&Sample>> = HashMap::new();
    for s in &scrape.samples {
        by_name.entry(s.metric.as_str()).or_default().push(s);
    }
    let sum = |candidates: &'static [&'static str]| {
        let v = values(&by_name, candidates);
        (!v.is_empty()).then(|| v.iter().sum::<f64>())
    };
    let queue = sum(n.queue).ok_or(ScrapeError::Missing(n.queue[0]))?;
    let running = sum(n.running).ok_or(ScrapeError::Missing(n.running[0]))?;
    let kv = values(&by_name, n.kv_usage);
    if kv.is_empty() {
        return Err(ScrapeError::Missing(n.kv_usage[0]));
    }
    let kv_usage = (kv.iter().sum::<f64>() / kv.len() as f64).clamp(0.0, 1.0);

    let info = n.cache_info.iter().find_map(|name| {
        by_name
            .get(parsed_name(name).as_str())
            .and_then(|s| s.first())
    });
    let label = |key: &str| -> Option<f64> { info?.labels.get(key)?.parse::<f64>().ok() };
    let gauge = |candidates: &[&str]| values(&by_name, candidates).first().copied();
    let block_size = label(n.block_size_label)
        .or_else(|| gauge(n.block_size_gauge))
        .filter(|v| *v >= 1.0 && *v <= f64::from(u32::MAX))
        .map(|v| v as u32);
    let num_blocks = label(n.num_blocks_label)
        .or_else(|| gauge(n.num_blocks_gauge))
        .filter(|v| *v >= 1.0)
        .map(|v| v as u64);
    Ok(ScrapedLoad {
        queue: queue.max(0.0),
        running: running.max(0.0),
        kv_usage,
        block_size,
        num_blocks,
        at,
    })
}

/// The LoRA adapter state on a metrics page of `engine`, from the gauge named
/// `metric` (see the module doc); `None` when the page has none.
pub fn parse_lora(engine: Engine, text: &str, metric: &str) -> Option<LoraInfo> {
    if metric.is_empty() || !text.contains(metric) {
        return None;
    }
    let running = names(engine).running;
    let mut base = None;
    // (time set, running, waiting, max_lora) of the newest series naming an
    // adapter, and of the newest series at all.
    let mut newest_named: Option<(f64, LabelSet)> = None;
    let mut newest: Option<(f64, LabelSet)> = None;
    for line in text.lines() {
        let name = sample_name(line);
        if base.is_none() && running.contains(&name) {
            base = labeled_sample(line).and_then(|(mut l, _)| l.remove("model_name"));
        }
        if name != metric {
            continue;
        }
        let Some((labels, at)) = labeled_sample(line) else {
            continue;
        };
        let named = ["running_lora_adapters", "waiting_lora_adapters"]
            .iter()
            .any(|k| labels.get(*k).is_some_and(|v| !v.is_empty()));
        for (slot, wanted) in [(&mut newest_named, named), (&mut newest, true)] {
            if wanted && slot.as_ref().is_none_or(|(t, _)| at > *t) {
                *slot = Some((at, labels.clone()));
            }
        }
    }
    let (_, labels) = newest_named.or(newest)?;
    let get = |k: &str| labels.get(k).map(String::as_str).unwrap_or_default();
    let max_lora = get("max_lora").trim().parse::<u32>().unwrap_or(0);
    let adapters = get("running_lora_adapters")
        .split(',')
        .chain(get("waiting_lora_adapters").split(','))
        .map(str::trim);
    Some(LoraInfo::new(adapters, max_lora, base.as_deref()))
}

/// A sample line's labels.
type LabelSet = HashMap<String, String>;

/// The labels and finite value of one sample line `name{k="v",...} value`,
/// label values unescaped (`\\`, `\"`, `\n`); `None` when it does not parse.
/// (`prometheus-parse` splits label values at commas, which adapter lists hold.)
fn labeled_sample(line: &str) -> Option<(LabelSet, f64)> {
    let line = line.trim();
    let open = line.find('{')?;
    let mut rest = &line[open + 1..];
    let mut labels = LabelSet::new();
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(after) = rest.strip_prefix('}') {
            rest = after;
            break;
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        let mut chars = rest[eq + 1..]
            .trim_start()
            .strip_prefix('"')?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => value.push(match chars.next()?.1 {
                    'n' => '\n',
                    c => c,
                }),
                (_, c) => value.push(c),
            }
        };
        let quoted = rest[eq + 1..].trim_start();
        rest = &quoted[1 + end + 1..];
        labels.insert(key, value);
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    value.is_finite().then_some((labels, value))
}

/// HTTP client used for scraping.
pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A keep-alive HTTP/1 client for scraping.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// Fetches `http://addr{path}` and returns the body text, within `timeout`.
pub async fn fetch(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<Bytes, ScrapeError> {
    let uri: http::Uri = format!("http://{addr}{path}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| ScrapeError::Http(e.to_string()))?;
    let work = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status(resp.status().as_u16()));
        }
        let body = Limited::new(resp.into_body(), MAX_PAGE_BYTES)
            .collect()
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        Ok(body.to_bytes())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

/// Scrapes one endpoint once and returns its load and LoRA adapter state.
pub async fn scrape_one(
    client: &HttpClient,
    state: &EndpointState,
    config: &ScrapeConfig,
) -> Result<(ScrapedLoad, Option<LoraInfo>), ScrapeError> {
    let ep = &state.endpoint;
    let addr = SocketAddr::new(ep.address.ip(), config.port.unwrap_or(ep.address.port()));
    let page = fetch(client, addr, &config.path, config.timeout).await?;
    let text = std::str::from_utf8(&page).map_err(|e| ScrapeError::Parse(e.to_string()))?;
    let load = parse_load(ep.engine, text, Instant::now())?;
    let lora = config
        .lora_info_metric
        .as_deref()
        .and_then(|m| parse_lora(ep.engine, text, m));
    Ok((load, lora))
}

/// Per-endpoint bookkeeping: whether a scrape is in flight, and whether the last failed.
#[derive(Debug, Default, Clone, Copy)]
struct Track {
    busy: bool,
    failing: bool,
}

/// Scrapes every endpoint of `table` forever, as `config` says, counting failures in
/// `errors`. The scrapes in flight belong to this future: dropping it cancels them.
pub async fn run(config: ScrapeConfig, table: Arc<EndpointTable>, errors: Arc<ScrapeErrors>) {
    let client = http_client();
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let tracks: Arc<Mutex<HashMap<SocketAddr, Track>>> = Arc::default();
    let config = Arc::new(config);
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    info!(interval = ?config.interval, timeout = ?config.timeout, "scraping endpoint metrics");
    let mut scrapes = tokio::task::JoinSet::new();
    loop {
        tick.tick().await;
        while let Some(done) = scrapes.try_join_next() {
            if let Err(e) = done {
                warn!(error = %ErrorChain(&e), "a metrics scrape task failed");
            }
        }
        let snapshot = table.snapshot();
        {
            // Forget endpoints that left the table (and are not being scraped).
            let mut t = tracks.lock();
            t.retain(|addr, track| {
                track.busy
                    || snapshot
                        .endpoints
                        .iter()
                        .any(|e| e.endpoint.address == *addr)
            });
        }
        for state in &snapshot.endpoints {
            let addr = state.endpoint.address;
            if tracks.lock().get(&addr).is_some_and(|t| t.busy) {
                continue;
            }
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                break;
            };
            tracks.lock().entry(addr).or_default().busy = true;
            let (client, config, tracks, state, errors) = (
                client.clone(),
                Arc::clone(&config),
                Arc::clone(&tracks),
                Arc::clone(state),
                Arc::clone(&errors),
            );
            scrapes.spawn(async move {
                let result = scrape_one(&client, &state, &config).await;
                let mut t = tracks.lock();
                let track = t.entry(addr).or_default();
                track.busy = false;
                match result {
                    Ok((load, lora)) => {
                        state.set_lora(lora);
                        state.set_scraped(load);
                        if track.failing {
                            info!(endpoint = %addr, "metrics scrape recovered");
                        }
                        track.failing = false;
                    }
                    Err(e) => {
                        errors.record(e.reason());
                        state.set_scrape_failed(std::time::Instant::now());
                        if !track.failing {
                            warn!(endpoint = %addr, error = %ErrorChain(&e), "metrics scrape failed");
                        } else {
                            debug!(endpoint = %addr, error = %ErrorChain(&e), "metrics scrape failed");
                        }
                        track.failing = true;
                    }
                }
                drop(permit);
            });
        }
    }
}

/// Renders [`ScrapeErrors`]: kvpick's counter by reason, and llm-d's
/// data-layer poll/extract counters (a failed fetch is a poll error; a page kvpick cannot
/// read is an extract error).
#[derive(Debug)]
pub struct ScrapeMetrics {
    errors: Arc<ScrapeErrors>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabels {
    source_type: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ExtractorLabels {
    source_type: &'static str,
    extractor_type: &'static str,
}

impl Collector for ScrapeMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let count = |f| self.errors.count(f);
        let mut family = encoder.encode_descriptor(
            "kvpick_scrape_errors",
            "Failed endpoint metrics scrapes, by reason (connect, status, timeout, parse, missing_metric)",
            None,
            MetricType::Counter,
        )?;
        for f in ScrapeFailure::ALL {
            ConstCounter::new(count(f))
                .encode(family.encode_family(&ReasonLabels { reason: f.as_str() })?)?;
        }
        let polls = count(ScrapeFailure::Connect)
            + count(ScrapeFailure::Status)
            + count(ScrapeFailure::Timeout);
        let mut family = encoder.encode_descriptor(
            "llm_d_epp_datalayer_poll_errors",
            "Data-source poll errors per source type.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(polls).encode(family.encode_family(&SourceLabels {
            source_type: "metrics",
        })?)?;
        let extracts = count(ScrapeFailure::Parse) + count(ScrapeFailure::MissingMetric);
        let mut family = encoder.encode_descriptor(
            "llm_d_epp_datalayer_extract_errors",
            "Extract errors per source/extractor type.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(extracts).encode(family.encode_family(&ExtractorLabels {
            source_type: "metrics",
            extractor_type: "metrics",
        })?)?;
        Ok(())
    }
}

impl ScrapeMetrics {
    /// Registers the scrape failure counts into kvpick's registry, read at scrape time.
    pub fn register(metrics: &Metrics, errors: Arc<ScrapeErrors>) {
        metrics.register(|r| r.register_collector(Box::new(ScrapeMetrics { errors })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Endpoint;
    use tokio::net::TcpListener;

    const VLLM: &str = include_str!("../../tests/fixtures/vllm_metrics.txt");
    const SGLANG: &str = include_str!("../../tests/fixtures/sglang_metrics.txt");

    #[test]
    fn names_with_colons_are_normalised_for_the_parser() {
        assert_eq!(normalise_line("vllm:x{a=\"b:c\"} 1"), "vllm_x{a=\"b:c\"} 1");
        assert_eq!(normalise_line("vllm:x 1"), "vllm_x 1");
        assert_eq!(normalise_line("# TYPE vllm:x gauge"), "# TYPE vllm_x gauge");
        assert_eq!(normalise_line("# free comment"), "");
    }

    #[test]
    fn parses_vllm_page() {
        let load = parse_load(Engine::Vllm, VLLM, Instant::now()).unwrap();
        assert_eq!((load.queue, load.running), (3.0, 7.0));
        assert_eq!(load.kv_usage, 0.4375);
        assert_eq!(load.block_size, Some(16));
        assert_eq!(load.num_blocks, Some(27648));
    }

    #[test]
    fn parses_vllm_lora_gauge_newest_named_series() {
        use crate::endpoints::{adapter_id, LoraFit};
        let info = parse_lora(Engine::Vllm, VLLM, DEFAULT_LORA_INFO_METRIC).unwrap();
        // The newest series naming adapters; the newer idle one is skipped.
        assert_eq!((info.resident_count(), info.max_lora()), (2, 4));
        assert_eq!(info.fit(adapter_id("sql-lora")), LoraFit::Resident);
        assert_eq!(info.fit(adapter_id("chat-lora")), LoraFit::Resident);
        assert_eq!(info.fit(adapter_id("other")), LoraFit::FreeSlot);
        let base = adapter_id("meta-llama/Llama-3.1-8B-Instruct");
        assert_eq!(info.fit(base), LoraFit::Neutral);
        // Another metric name (GIE's flag), or none: not read.
        assert_eq!(parse_lora(Engine::Vllm, VLLM, "my:lora_info"), None);
        assert_eq!(parse_lora(Engine::Vllm, VLLM, ""), None);
        assert_eq!(
            parse_lora(Engine::Sglang, SGLANG, DEFAULT_LORA_INFO_METRIC),
            None
        );
        // Escapes in label values; a malformed line is skipped.
        let page = "vllm:lora_requests_info{max_lora=\"3\",running_lora_adapters=\"a\\\"b,c\"} 2\n\
            vllm:lora_requests_info{max_lora=\"3\",running_lora_adapters=\"d} 9\n";
        let odd = parse_lora(Engine::Vllm, page, DEFAULT_LORA_INFO_METRIC).unwrap();
        assert_eq!(odd.fit(adapter_id("a\"b")), LoraFit::Resident);
        assert_eq!(odd.fit(adapter_id("c")), LoraFit::Resident);
        assert_eq!(odd.fit(adapter_id("d")), LoraFit::FreeSlot);
        // Only idle series: no adapter resident, every slot free; a full worker.
        let idle = "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 5\n";
        let idle = parse_lora(Engine::Vllm, idle, DEFAULT_LORA_INFO_METRIC).unwrap();
        assert_eq!((idle.resident_count(), idle.max_lora()), (0, 2));
        let full = "my:lora_info{max_lora=\"2\",waiting_lora_adapters=\"c\",running_lora_adapters=\"a,b\"} 5\n";
        let full = parse_lora(Engine::Sglang, full, "my:lora_info").unwrap();
        assert_eq!(full.fit(adapter_id("c")), LoraFit::Resident);
        assert_eq!(full.fit(adapter_id("d")), LoraFit::Full);
    }

    #[test]
    fn parses_sglang_page() {
        let load = parse_load(Engine::Sglang, SGLANG, Instant::now()).unwrap();
        assert_eq!((load.queue, load.running), (2.0, 5.0));
        assert_eq!(load.kv_usage, 0.62);
        assert_eq!(load.block_size, Some(64));
        assert_eq!(load.num_blocks, Some(714));
    }

    #[test]
    fn older_vllm_name_dp_engines_and_trtllm() {
        let old = "# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"1\"} 4\n\
            vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_running{engine=\"1\"} 0\n\
            vllm:gpu_cache_usage_perc{engine=\"0\"} 0.2\nvllm:gpu_cache_usage_perc{engine=\"1\"} 0.6\n";
        let load = parse_load(Engine::Vllm, old, Instant::now()).unwrap();
        assert_eq!((load.queue, load.running), (5.0, 2.0));
        assert!((load.kv_usage - 0.4).abs() < 1e-9);
        assert_eq!((load.block_size, load.num_blocks), (None, None));

        let trt = "trtllm_num_requests_waiting{model_name=\"m\"} 6\n\
            trtllm_num_requests_running{model_name=\"m\"} 9\n\
            trtllm_kv_cache_utilization{model_name=\"m\"} 0.75\n\
            trtllm_kv_cache_tokens_per_block{model_name=\"m\"} 32\n\
            trtllm_kv_cache_max_blocks{model_name=\"m\"} 4096\n";
        let load = parse_load(Engine::Trtllm, trt, Instant::now()).unwrap();
        assert_eq!((load.queue, load.running, load.kv_usage), (6.0, 9.0, 0.75));
        assert_eq!((load.block_size, load.num_blocks), (Some(32), Some(4096)));
    }

    #[test]
    fn wrong_engine_or_missing_metric_is_an_error() {
        assert!(matches!(
            parse_load(Engine::Sglang, VLLM, Instant::now()),
            Err(ScrapeError::Missing("sglang:num_queue_reqs"))
        ));
        let no_kv = "vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n";
        assert!(matches!(
            parse_load(Engine::Vllm, no_kv, Instant::now()),
            Err(ScrapeError::Missing("vllm:kv_cache_usage_perc"))
        ));
    }

    /// Serves `page` at `/metrics` on a loopback port; returns its address.
    async fn serve_page(page: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app =
            axum::Router::new().route("/metrics", axum::routing::get(move || async move { page }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// Accepts connections and never answers.
    async fn serve_nothing() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = listener.accept().await {
                held.push(sock);
            }
        });
        addr
    }

    #[tokio::test]
    async fn scrapes_live_workers_while_one_hangs() {
        let vllm = serve_page(VLLM).await;
        let sglang = serve_page(SGLANG).await;
        let hung = serve_nothing().await;
        let mut sg = Endpoint::new(sglang);
        sg.engine = Engine::Sglang;
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![Endpoint::new(vllm), sg, Endpoint::new(hung)]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            timeout: Duration::from_secs(30),
            concurrency: 8,
            ..Default::default()
        };
        let task = tokio::spawn(run(config, Arc::clone(&table), Arc::default()));
        let snap = table.snapshot();
        let by_addr = |a: SocketAddr| {
            snap.endpoints
                .iter()
                .find(|e| e.endpoint.address == a)
                .unwrap()
        };
        let fresh = |a: SocketAddr| by_addr(a).scraped(Instant::now(), Duration::from_secs(5));
        let mut ok = false;
        for _ in 0..300 {
            if fresh(vllm).is_some() && fresh(sglang).is_some() {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(ok, "live workers were not scraped while another hangs");
        assert_eq!(fresh(vllm).unwrap().running, 7.0);
        let lora = by_addr(vllm)
            .lora()
            .expect("the fixture's adapters were not stored");
        assert_eq!((lora.resident_count(), lora.max_lora()), (2, 4));
        assert_eq!(fresh(sglang).unwrap().kv_usage, 0.62);
        assert!(fresh(hung).is_none());
        // Rounds keep coming for the live workers although the hung scrape is pending.
        let first = fresh(vllm).unwrap().at;
        let mut advanced = false;
        for _ in 0..300 {
            if fresh(vllm).unwrap().at > first {
                advanced = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(advanced, "scraping stalled behind the hung worker");
        task.abort();
    }

    #[tokio::test]
    async fn dropping_the_scrape_loop_cancels_its_scrapes_in_flight() {
        use tokio::io::AsyncReadExt;
        // A worker that accepts the scrape, never answers, and reports when the
        // scraper hangs up.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let hung = listener.local_addr().unwrap();
        let (accepted_tx, accepted) = tokio::sync::oneshot::channel();
        let (closed_tx, closed) = tokio::sync::oneshot::channel();
        let worker = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let _ = accepted_tx.send(());
            let mut buf = [0u8; 1024];
            while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {}
            let _ = closed_tx.send(());
        });
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![Endpoint::new(hung)]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let scraping = tokio::spawn(run(config, table, Arc::default()));
        accepted.await.unwrap();
        scraping.abort();
        let _ = scraping.await;
        // Detached, the scrape would hold its connection until its 60 s timeout.
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("the scrape outlived its loop")
            .unwrap();
        worker.await.unwrap();
    }

    #[tokio::test]
    async fn failed_scrapes_are_counted_by_reason() {
        let live = serve_page(VLLM).await;
        let not_metrics = serve_page("this is not a metrics page {").await;
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![
            Endpoint::new(live),
            Endpoint::new(not_metrics),
            Endpoint::new(closed),
        ]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            ..Default::default()
        };
        let errors = Arc::<ScrapeErrors>::default();
        let task = tokio::spawn(run(config, table, Arc::clone(&errors)));
        let counted = |f| errors.count(f) > 0;
        for _ in 0..500 {
            if counted(ScrapeFailure::Connect)
                && (counted(ScrapeFailure::Parse) || counted(ScrapeFailure::MissingMetric))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert!(
            counted(ScrapeFailure::Connect),
            "refused connection not counted"
        );
        assert!(
            counted(ScrapeFailure::Parse) || counted(ScrapeFailure::MissingMetric),
            "unreadable page not counted"
        );
        assert!(!counted(ScrapeFailure::Status) && !counted(ScrapeFailure::Timeout));
    }

    #[tokio::test]
    async fn fetch_times_out_and_reports_status() {
        let client = http_client();
        let hung = serve_nothing().await;
        let err = fetch(&client, hung, "/metrics", Duration::from_millis(100)).await;
        assert!(matches!(err, Err(ScrapeError::Timeout)));
        let live = serve_page(VLLM).await;
        let err = fetch(&client, live, "/nope", Duration::from_secs(5)).await;
        assert!(matches!(err, Err(ScrapeError::Status(404))));
    }
}

/// Measurements for `docs/discovery.md`; run with
/// `cargo test --release --lib scrape::measure -- --ignored --nocapture`.
#[cfg(test)]
mod measure {
    use super::*;

    const VLLM: &str = include_str!("../../tests/fixtures/vllm_metrics.txt");

    /// CPU time this thread has used, from `/proc/thread-self/schedstat`.
    fn thread_cpu() -> Duration {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        Duration::from_nanos(text.split_whitespace().next().unwrap().parse().unwrap())
    }

    #[test]
    #[ignore = "measurement, not a check"]
    fn scrape_cost_per_endpoint() {
        // The worker runs on its own thread so only the scraper's CPU is counted.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                let app =
                    axum::Router::new().route("/metrics", axum::routing::get(|| async { VLLM }));
                axum::serve(listener, app).await.unwrap();
            });
        });
        let addr = rx.recv().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let table = EndpointTable::new();
        table.replace(vec![crate::endpoints::Endpoint::new(addr)]);
        let state = Arc::clone(&table.snapshot().endpoints[0]);
        let config = ScrapeConfig::default();
        let client = http_client();
        const N: u32 = 2000;
        rt.block_on(async {
            for _ in 0..100 {
                scrape_one(&client, &state, &config).await.unwrap();
            }
            for round in 0..3 {
                let t = thread_cpu();
                for _ in 0..N {
                    fetch(&client, addr, "/metrics", config.timeout).await.unwrap();
                }
                let get = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N {
                    scrape_one(&client, &state, &config).await.unwrap();
                }
                let scrape = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N {
                    parse_load(Engine::Vllm, VLLM, Instant::now()).unwrap();
                }
                let parse = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N / 20 {
                    let lines = VLLM.lines().map(|l| Ok(normalise_line(l)));
                    prometheus_parse::Scrape::parse(lines).unwrap();
                }
                let full = (thread_cpu() - t) / (N / 20);
                println!(
                    "round {round}: page {} bytes; CPU per plain GET {get:?}, per GET+parse {scrape:?}, \
                     parse alone {parse:?}, parsing every line (unfiltered) {full:?}",
                    VLLM.len()
                );
            }
        });
    }
}
