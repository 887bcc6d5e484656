//! Reading a worker's Prometheus `/metrics` page: its load ([`parse_load`]) and
//! its LoRA adapters ([`parse_lora`]), and why a scrape fails ([`ScrapeError`],
//! counted by class in [`ScrapeErrors`]). Pure: text in, figures out (the
//! `kvpick` crate fetches the pages). Metric names follow the engine label:
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
use std::time::Instant;

use prometheus_parse::{Sample, Scrape, Value};

use crate::endpoints::{Engine, LoraInfo, ScrapedLoad};

/// GIE's default `--lora-info-metric`: vLLM's adapter gauge.
pub const DEFAULT_LORA_INFO_METRIC: &str = "vllm:lora_requests_info";

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
pub fn normalise_line(line: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
