//! Logs, Prometheus metrics and gRPC health.
//!
//! Metric names follow the GIE EPP where one exists
//! (`inference_extension_scheduler_e2e_duration_seconds`, `inference_pool_ready_pods`);
//! kvpick's own carry the `kvpick_` prefix.
//!
//! [`Metrics`] owns the registry, serves it, and holds the request, decision
//! and GIE-named pool and endpoint families. Other subsystems register their
//! own families into it at start-up through [`Metrics::register`]
//! (`scheduler_metrics`, `multimodal_metrics`, `admission_metrics`,
//! `scrape::ScrapeMetrics`, `tls::TlsMetrics`).

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::endpoints::EndpointTable;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BuildLabels {
    commit: &'static str,
    build_ref: &'static str,
}

/// The build's commit (set `KVPICK_GIT_COMMIT` when compiling) and version.
fn build_labels() -> BuildLabels {
    BuildLabels {
        commit: option_env!("KVPICK_GIT_COMMIT").unwrap_or("unknown"),
        build_ref: env!("CARGO_PKG_VERSION"),
    }
}

/// How a request ended at kvpick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestResult {
    /// Routed to an endpoint.
    Routed,
    /// 400: body unusable.
    BadRequest,
    /// 503: no endpoint could serve.
    NoEndpoint,
    /// 503: the subset hint matched nothing.
    SubsetEmpty,
}

impl RequestResult {
    /// The `result` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestResult::Routed => "routed",
            RequestResult::BadRequest => "bad_request",
            RequestResult::NoEndpoint => "no_endpoint",
            RequestResult::SubsetEmpty => "subset_empty",
        }
    }
}

impl EncodeLabelValue for RequestResult {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: RequestResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: String,
    dp_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PodLabels {
    name: String,
    model_server_pod: String,
}

/// llm-d's per-endpoint labels: the pool and the pod name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolEndpointLabels {
    name: String,
    model_server_endpoint: String,
}

/// A gauge holding an `f64`.
type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// All of kvpick's Prometheus metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: parking_lot::Mutex<Registry>,
    pool_name: String,
    requests: Family<ResultLabels, Counter>,
    decision_seconds: Histogram,
    in_flight: Family<EndpointLabels, Gauge>,
    ready_pods: Family<PoolLabels, Gauge>,
    average_kv: Family<PoolLabels, FloatGauge>,
    average_queue: Family<PoolLabels, FloatGauge>,
    per_pod_queue: Family<PodLabels, FloatGauge>,
    average_running: Family<PoolLabels, FloatGauge>,
    per_endpoint_queue: Family<PoolEndpointLabels, FloatGauge>,
    scrape_staleness: parking_lot::Mutex<Duration>,
}

impl Metrics {
    /// Creates and registers the metrics; `pool_name` labels the pool gauges.
    pub fn new(pool_name: &str) -> Self {
        let mut registry = Registry::default();
        let requests = Family::<ResultLabels, Counter>::default();
        registry.register(
            "kvpick_requests",
            "Inference requests by how kvpick answered them",
            requests.clone(),
        );
        let decision_seconds = Histogram::new([
            0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01,
            0.025, 0.05, 0.1,
        ]);
        registry.register(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time to pick an endpoint for a request",
            decision_seconds.clone(),
        );
        let in_flight = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "kvpick_endpoint_in_flight_requests",
            "Requests routed by kvpick and not yet finished, per endpoint rank",
            in_flight.clone(),
        );
        let ready_pods = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "inference_pool_ready_pods",
            "Ready pods in the pool",
            ready_pods.clone(),
        );
        let average_kv = Family::<PoolLabels, FloatGauge>::default();
        registry.register(
            "inference_pool_average_kv_cache_utilization",
            "Average KV-cache utilization (0-1) of the pool's ready endpoints with fresh metrics",
            average_kv.clone(),
        );
        let average_queue = Family::<PoolLabels, FloatGauge>::default();
        registry.register(
            "inference_pool_average_queue_size",
            "Average engine queue length of the pool's ready endpoints with fresh metrics",
            average_queue.clone(),
        );
        let per_pod_queue = Family::<PodLabels, FloatGauge>::default();
        registry.register(
            "inference_pool_per_pod_queue_size",
            "Engine queue length per ready pod (summed over its target ports), fresh metrics only",
            per_pod_queue.clone(),
        );
        // llm-d Router v0.10.0's names for the same pool figures (`poolLabels`).
        registry.register(
            "llm_d_epp_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool.",
            average_kv.clone(),
        );
        registry.register(
            "llm_d_epp_average_queue_size",
            "The average number of requests pending in the model server queue.",
            average_queue.clone(),
        );
        let average_running = Family::<PoolLabels, FloatGauge>::default();
        registry.register(
            "llm_d_epp_average_running_requests",
            "The average number of running requests across model servers in the pool.",
            average_running.clone(),
        );
        let per_endpoint_queue = Family::<PoolEndpointLabels, FloatGauge>::default();
        registry.register(
            "llm_d_epp_per_endpoint_queue_size",
            "The total number of requests pending in the model server queue for each underlying endpoint.",
            per_endpoint_queue.clone(),
        );
        for name in ["inference_extension_info", "llm_d_epp_info"] {
            let info = Family::<BuildLabels, Gauge>::default();
            info.get_or_create(&build_labels()).set(1);
            registry.register(
                name,
                "General information of the current build of Inference Extension.",
                info,
            );
        }
        Metrics {
            registry: parking_lot::Mutex::new(registry),
            pool_name: pool_name.to_string(),
            requests,
            decision_seconds,
            in_flight,
            ready_pods,
            average_kv,
            average_queue,
            per_pod_queue,
            average_running,
            per_endpoint_queue,
            scrape_staleness: parking_lot::Mutex::new(Duration::from_secs(2)),
        }
    }

    /// Sets how old scraped load may be to count in the pool gauges (default 2 s).
    pub fn set_scrape_staleness(&self, staleness: Duration) {
        *self.scrape_staleness.lock() = staleness;
    }

    /// Registers more metrics (other modules call this at start-up).
    pub fn register(&self, f: impl FnOnce(&mut Registry)) {
        f(&mut self.registry.lock());
    }

    /// Counts one request outcome.
    pub fn record_result(&self, result: RequestResult) {
        self.requests.get_or_create(&ResultLabels { result }).inc();
    }

    /// Records one decision's latency.
    pub fn record_decision(&self, took: Duration) {
        self.decision_seconds.observe(took.as_secs_f64());
    }

    /// Renders the text exposition, refreshing the endpoint gauges from `table`.
    pub fn render(&self, table: &EndpointTable) -> String {
        let snapshot = table.snapshot();
        self.in_flight.clear();
        for e in &snapshot.endpoints {
            for rank in 0..e.ranks() {
                self.in_flight
                    .get_or_create(&EndpointLabels {
                        endpoint: e.endpoint.address_string(),
                        dp_rank: rank,
                    })
                    .set(i64::from(e.in_flight(rank)));
            }
        }
        let pool = PoolLabels {
            name: self.pool_name.clone(),
        };
        let mut pods: Vec<&str> = snapshot
            .endpoints
            .iter()
            .map(|e| e.endpoint.name.as_str())
            .collect();
        pods.sort_unstable();
        pods.dedup();
        self.ready_pods.get_or_create(&pool).set(pods.len() as i64);
        let now = std::time::Instant::now();
        let staleness = *self.scrape_staleness.lock();
        let (mut kv_sum, mut queue_sum, mut running_sum, mut fresh) = (0.0, 0.0, 0.0, 0usize);
        let mut per_pod: std::collections::BTreeMap<String, f64> = Default::default();
        for e in &snapshot.endpoints {
            if let Some(load) = e.scraped(now, staleness) {
                kv_sum += load.kv_usage;
                queue_sum += load.queue;
                running_sum += load.running;
                fresh += 1;
                let pod = e.endpoint.name.rsplit('/').next().unwrap_or_default();
                *per_pod.entry(pod.to_string()).or_default() += load.queue;
            }
        }
        let avg = |sum: f64| if fresh == 0 { 0.0 } else { sum / fresh as f64 };
        self.average_kv.get_or_create(&pool).set(avg(kv_sum));
        self.average_queue.get_or_create(&pool).set(avg(queue_sum));
        self.average_running
            .get_or_create(&pool)
            .set(avg(running_sum));
        self.per_pod_queue.clear();
        self.per_endpoint_queue.clear();
        for (pod, queue) in per_pod {
            self.per_endpoint_queue
                .get_or_create(&PoolEndpointLabels {
                    name: self.pool_name.clone(),
                    model_server_endpoint: pod.clone(),
                })
                .set(queue);
            self.per_pod_queue
                .get_or_create(&PodLabels {
                    name: self.pool_name.clone(),
                    model_server_pod: pod,
                })
                .set(queue);
        }
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }
}

/// Content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type of the Prometheus text format, as GIE's Go EPP serves it.
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper's `Accept` header prefers OpenMetrics to the Prometheus
/// text format (Prometheus itself lists OpenMetrics first). Without the
/// header, or without OpenMetrics in it, the text format is served, as Go's
/// `promhttp` does.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
    for range in accept.unwrap_or_default().split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default().to_ascii_lowercase();
        let q = parts
            .find_map(|p| p.strip_prefix("q="))
            .and_then(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" => text = text.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

/// An OpenMetrics page in the Prometheus text format (0.0.4) as Go's client
/// writes it: a counter family `x` (samples `x_total`) is named `x_total` in
/// its `# HELP` and `# TYPE` lines, `unknown` types are `untyped`, and the
/// `# UNIT` and `# EOF` lines go.
pub fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len() + 256);
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, "counter")) = rest.split_once(' ') {
                counters.insert(name);
            }
        }
    }
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta.and_then(|(p, rest)| Some((p, rest.split_once(' ')?))) {
            Some((p, (name, tail))) if counters.contains(name) => {
                out.push_str(&format!("{p}{name}_total {tail}\n"));
            }
            Some(("# TYPE ", (name, "unknown"))) => {
                out.push_str(&format!("# TYPE {name} untyped\n"));
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Serves `/metrics` on `listener` until the task is dropped: OpenMetrics when
/// the scraper's `Accept` prefers it, else the Prometheus text format
/// ([`wants_openmetrics`]).
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    table: Arc<EndpointTable>,
) -> std::io::Result<()> {
    let app = Router::new().route(
        "/metrics",
        get(move |headers: http::HeaderMap| {
            let page = metrics.render(&table);
            let accept = headers
                .get(http::header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            let (content_type, body) = if wants_openmetrics(accept) {
                (OPENMETRICS_CONTENT_TYPE, page)
            } else {
                (PROMETHEUS_TEXT_CONTENT_TYPE, prometheus_text(&page))
            };
            async move { ([(http::header::CONTENT_TYPE, content_type)], body) }
        }),
    );
    axum::serve(listener, app).await
}

/// Health service names kvpick answers for.
pub const HEALTH_SERVICES: &[&str] = &[
    "",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Drives gRPC health: `liveness` is SERVING from the start (the process works);
/// `""`, `readiness` and the ext_proc service turn SERVING once the endpoint set
/// is known and stay so (a lost API server keeps serving from the last state),
/// and NOT_SERVING for good once `draining` turns true (shutdown). Returns never.
pub async fn drive_health(
    reporter: HealthReporter,
    table: Arc<EndpointTable>,
    mut draining: tokio::sync::watch::Receiver<bool>,
) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    for svc in HEALTH_SERVICES {
        reporter
            .set_service_status(*svc, ServingStatus::NotServing)
            .await;
    }
    let mut synced = table.subscribe_synced();
    tokio::select! {
        synced_ok = async { synced.wait_for(|s| *s).await.is_ok() } => {
            if synced_ok {
                for svc in HEALTH_SERVICES {
                    reporter
                        .set_service_status(*svc, ServingStatus::Serving)
                        .await;
                }
            }
        }
        _ = async { draining.wait_for(|d| *d).await.is_ok() } => {}
    }
    // Err: the sender is gone, so no shutdown will ever be announced.
    let drained = draining.wait_for(|d| *d).await.is_ok();
    if drained {
        for svc in HEALTH_SERVICES {
            reporter
                .set_service_status(*svc, ServingStatus::NotServing)
                .await;
        }
    }
    std::future::pending().await
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global tracing subscriber (`RUST_LOG` filters; default
/// `default_level`), with the OpenTelemetry span layer of `traces` when tracing
/// is on. Logs leave request spans out (they are for the exporter).
pub fn init_logging(
    format: LogFormat,
    default_level: &str,
    traces: Option<&crate::tracing_export::Exporter>,
) {
    use tracing_subscriber::filter::{filter_fn, FilterExt};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let env = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let logs = env.and(filter_fn(|m| {
        m.target() != crate::tracing_export::SPAN_TARGET
    }));
    let fmt = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer().boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(logs))
        .with(traces.map(|t| t.layer()))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Endpoint, ScrapedLoad};
    use crate::scheduler::{PickRequest, Scheduler, SchedulerConfig};

    #[test]
    fn renders_scheduler_metrics() {
        let metrics = Metrics::new("pool");
        let scheduler = Arc::new(Scheduler::new(SchedulerConfig::default()));
        crate::scheduler_metrics::SchedulerMetrics::register(&metrics, Arc::clone(&scheduler));
        let table = EndpointTable::new();
        table.replace(vec![crate::endpoints::Endpoint::new(
            "10.0.0.1:80".parse().unwrap(),
        )]);
        let body = crate::request::parse(
            format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(64 * 3)).as_bytes(),
            None,
        )
        .unwrap();
        let req = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        for _ in 0..2 {
            let d = scheduler.pick(&req, &table.snapshot()).unwrap();
            scheduler.finish(&d, Some(200));
        }
        let text = metrics.render(&table);
        for line in [
            "kvpick_prefix_blocks_queried_total 6",
            "kvpick_prefix_blocks_matched_total 3",
            "kvpick_session_repicks_total 0",
            "kvpick_session_rehomes_total 0",
            "kvpick_session_evictions_total 0",
            "kvpick_prefix_precise_dropped_blocks_total 0",
            "kvpick_prefix_index_entries 3",
            "kvpick_session_bindings 0",
            "kvpick_scheduler_stage_duration_seconds_count{stage=\"lookup\"} 2",
            "kvpick_scheduler_stage_duration_seconds_bucket{le=\"+Inf\",stage=\"hash\"} 2",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    fn ep(addr: &str, pod: &str) -> Endpoint {
        let mut e = Endpoint::new(addr.parse().unwrap());
        e.name = pod.to_string();
        e
    }

    fn gauge_line<'a>(text: &'a str, prefix: &str) -> &'a str {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    }

    #[test]
    fn pool_gauges_use_fresh_scrapes_only() {
        let table = EndpointTable::new();
        table.replace(vec![
            ep("10.0.0.1:8000", "ns/a"),
            ep("10.0.0.1:8001", "ns/a"),
            ep("10.0.0.2:8000", "ns/b"),
            ep("10.0.0.3:8000", "ns/c"),
        ]);
        let snap = table.snapshot();
        let now = std::time::Instant::now();
        let load = |queue: f64, kv: f64, at| ScrapedLoad {
            queue,
            running: 0.0,
            kv_usage: kv,
            block_size: None,
            num_blocks: None,
            at,
        };
        snap.endpoints[0].set_scraped(load(2.0, 0.2, now));
        snap.endpoints[1].set_scraped(load(4.0, 0.4, now));
        snap.endpoints[2].set_scraped(load(6.0, 0.6, now));
        // Stale: ignored.
        snap.endpoints[3].set_scraped(load(100.0, 1.0, now - Duration::from_secs(10)));
        let metrics = Metrics::new("pool");
        let text = metrics.render(&table);
        assert!(gauge_line(&text, "inference_pool_ready_pods{").ends_with(" 3"));
        let kv: f64 = gauge_line(&text, "inference_pool_average_kv_cache_utilization{")
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((kv - 0.4).abs() < 1e-9, "{kv}");
        assert!(gauge_line(&text, "inference_pool_average_queue_size{").ends_with(" 4.0"));
        assert!(gauge_line(
            &text,
            "inference_pool_per_pod_queue_size{name=\"pool\",model_server_pod=\"a\"}"
        )
        .ends_with(" 6.0"));
        assert!(!text.contains("model_server_pod=\"c\""));
    }

    /// llm-d Router v0.10.0's pool gauges carry the same figures under its names.
    #[test]
    fn llm_d_pool_gauges_follow_fresh_scrapes() {
        let table = EndpointTable::new();
        table.replace(vec![
            ep("10.0.0.1:8000", "ns/a"),
            ep("10.0.0.2:8000", "ns/b"),
            ep("10.0.0.3:8000", "ns/c"),
        ]);
        let snap = table.snapshot();
        let now = std::time::Instant::now();
        let load = |queue: f64, running: f64, kv: f64, at| ScrapedLoad {
            queue,
            running,
            kv_usage: kv,
            block_size: None,
            num_blocks: None,
            at,
        };
        snap.endpoints[0].set_scraped(load(2.0, 1.0, 0.25, now));
        snap.endpoints[1].set_scraped(load(6.0, 5.0, 0.75, now));
        snap.endpoints[2].set_scraped(load(100.0, 100.0, 1.0, now - Duration::from_secs(10)));
        let metrics = Metrics::new("pool");
        let text = metrics.render(&table);
        let value = |prefix: &str| -> f64 {
            gauge_line(&text, prefix)
                .rsplit(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        assert_eq!(
            value("llm_d_epp_average_kv_cache_utilization{name=\"pool\"}"),
            0.5
        );
        assert_eq!(value("llm_d_epp_average_queue_size{name=\"pool\"}"), 4.0);
        assert_eq!(
            value("llm_d_epp_average_running_requests{name=\"pool\"}"),
            3.0
        );
        assert_eq!(
            value("llm_d_epp_per_endpoint_queue_size{name=\"pool\",model_server_endpoint=\"b\"}"),
            6.0
        );
        assert!(!text.contains("model_server_endpoint=\"c\""));
        // An endpoint that leaves the pool leaves the per-endpoint family.
        table.replace(vec![ep("10.0.0.1:8000", "ns/a")]);
        table.snapshot().endpoints[0].set_scraped(load(2.0, 1.0, 0.25, now));
        let text = metrics.render(&table);
        assert!(!text.contains("model_server_endpoint=\"b\""), "{text}");
    }
}

/// Names GIE's own Grafana dashboard reads (v1.5.0, vendored), held against what kvpick
/// serves.
#[cfg(test)]
mod dashboard_tests {
    /// Metric family names in the dashboard's queries (`_bucket`, `_count`, `_sum` and
    /// `_total` stripped, the bare `inference_pool` prefix of a regex skipped).
    fn dashboard_families(dashboard: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = dashboard;
        while let Some(at) = rest.find("inference_") {
            let tail = &rest[at..];
            let len = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            let mut name = &tail[..len];
            for suffix in ["_bucket", "_count", "_sum", "_total"] {
                name = name.strip_suffix(suffix).unwrap_or(name);
            }
            if name != "inference_pool" {
                names.insert(name.to_string());
            }
            rest = &tail[len..];
        }
        names
    }

    /// Flow-control families the dashboard reads that kvpick does not measure yet.
    const NOT_YET: [&str; 2] = [
        "inference_extension_flow_control_dispatch_cycle_duration_seconds",
        "inference_extension_flow_control_request_enqueue_duration_seconds",
    ];

    #[test]
    fn serves_every_family_gies_dashboard_reads() {
        use crate::admission::{AdmissionObserver, Outcome, RequestClass};
        use crate::endpoints::{Endpoint, ScrapedLoad};
        let dashboard = include_str!("../tests/fixtures/gie-v1.5.0/inference_gateway.json");
        let wanted = dashboard_families(dashboard);
        assert!(wanted.len() >= 16, "{wanted:?}");
        // One request's worth of every recorder, so each family has a sample.
        let app = crate::server::App::new("pool");
        app.endpoints
            .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
        app.endpoints.snapshot().endpoints[0].set_scraped(ScrapedLoad {
            queue: 1.0,
            running: 1.0,
            kv_usage: 0.5,
            block_size: None,
            num_blocks: None,
            at: std::time::Instant::now(),
        });
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        let m = &app.admission_metrics;
        m.classified(&class);
        m.left(&class, Outcome::Dispatched, std::time::Duration::ZERO);
        m.error(&class, "BadRequest");
        m.request_size(&class, 10);
        let usage = crate::request::usage::Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
        };
        m.finished(&class, std::time::Duration::from_millis(5), 20, Some(usage));
        let text = app.metrics.render(&app.endpoints);
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|name| !NOT_YET.contains(&name.as_str()))
            .filter(|name| !text.contains(&format!("# TYPE {name} ")))
            .collect();
        assert!(missing.is_empty(), "not served: {missing:?}\n{text}");
        for name in NOT_YET {
            assert!(
                wanted.contains(name),
                "{name} left the dashboard: drop it here"
            );
        }
    }

    /// GIE's dashboard reads counters as `x_total` and flow-control queues
    /// that must read 0 when empty: scraped in the Prometheus text format (as
    /// GIE's Go EPP serves it), with nothing queued.
    #[test]
    fn an_empty_queue_scrapes_as_zero_and_counters_as_gies_epp_names_them() {
        use crate::admission::{AdmissionObserver, RequestClass};
        let dashboard = include_str!("../tests/fixtures/gie-v1.5.0/inference_gateway.json");
        let app = crate::server::App::new("pool");
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        app.admission_metrics.classified(&class);
        app.admission_metrics.error(&class, "BadRequest");
        let text = super::prometheus_text(&app.metrics.render(&app.endpoints));
        for family in [
            "inference_extension_flow_control_queue_size",
            "inference_extension_flow_control_queue_bytes",
        ] {
            assert!(dashboard.contains(family));
            let line =
                format!("{family}{{fairness_id=\"\",priority=\"0\",inference_pool=\"pool\"}} 0");
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        for counter in [
            "inference_objective_request_total",
            "inference_objective_request_error_total",
        ] {
            assert!(dashboard.contains(counter));
            assert!(
                text.contains(&format!("# TYPE {counter} counter\n")),
                "{counter}\n{text}"
            );
            assert!(text.contains(&format!("# HELP {counter} ")), "{counter}");
            assert!(text.contains(&format!("\n{counter}{{")), "{counter}");
        }
        assert!(!text.contains("# EOF") && !text.contains(" unknown\n"));
        // Every family keeps its samples: only HELP and TYPE lines are renamed.
        let page = app.metrics.render(&app.endpoints);
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples(&text), samples(&page));
    }

    #[test]
    fn the_accept_header_picks_the_exposition_format() {
        use super::wants_openmetrics;
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(wants_openmetrics(Some("application/openmetrics-text")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.3,text/plain;q=0.9"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }

    #[test]
    fn serves_build_info_and_llm_d_core_names() {
        let app = crate::server::App::new("pool");
        let text = app.metrics.render(&app.endpoints);
        for name in [
            "inference_extension_info",
            "llm_d_epp_info",
            "kvpick_scrape_errors",
            "llm_d_epp_datalayer_poll_errors",
            "llm_d_epp_datalayer_extract_errors",
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} not served"
            );
        }
        assert!(text.contains(&format!(
            "inference_extension_info{{commit=\"{}\",build_ref=\"{}\"}} 1",
            option_env!("KVPICK_GIT_COMMIT").unwrap_or("unknown"),
            env!("CARGO_PKG_VERSION")
        )));
    }
}

/// kvpick's own Grafana dashboard (`charts/kvpick/dashboards/kvpick.json`) held
/// against a live scrape: every series name and label its PromQL reads is one
/// kvpick serves, so the dashboard cannot rot.
#[cfg(test)]
mod kvpick_dashboard_tests {
    use std::collections::BTreeSet;

    const DASHBOARD: &str = include_str!("../charts/kvpick/dashboards/kvpick.json");

    /// Every panel query of the dashboard.
    fn queries() -> Vec<String> {
        let d: serde_json::Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
        d["panels"]
            .as_array()
            .expect("panels")
            .iter()
            .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
            .map(|t| {
                t["expr"]
                    .as_str()
                    .expect("every target has an expr")
                    .to_string()
            })
            .collect()
    }

    /// Series names a query reads and the labels it names (in matchers and in
    /// `by`/`ignoring`/`without`/`on`). A series name is an identifier outside
    /// matchers, ranges and groupings that is neither a call nor a keyword.
    fn names_and_labels(q: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let ident = regex::Regex::new(r"[a-zA-Z_][a-zA-Z0-9_:]*").unwrap();
        let grouping = regex::Regex::new(r"\b(?:by|ignoring|without|on)\s*\(([^)]*)\)").unwrap();
        let matcher = regex::Regex::new(r"\{([^}]*)\}").unwrap();
        let range = regex::Regex::new(r"\[[^\]]*\]").unwrap();
        let label = regex::Regex::new(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)").unwrap();
        let mut labels = BTreeSet::new();
        for c in grouping.captures_iter(q) {
            labels.extend(ident.find_iter(&c[1]).map(|m| m.as_str().to_string()));
        }
        for c in matcher.captures_iter(q) {
            labels.extend(label.captures_iter(&c[1]).map(|l| l[1].to_string()));
        }
        let bare = grouping.replace_all(q, " ");
        let bare = matcher.replace_all(&bare, " ");
        let bare = range.replace_all(&bare, " ");
        const KEYWORDS: [&str; 7] = [
            "group_left",
            "group_right",
            "bool",
            "offset",
            "and",
            "or",
            "unless",
        ];
        let names = ident
            .find_iter(&bare)
            .filter(|m| !bare[m.end()..].trim_start().starts_with('('))
            .map(|m| m.as_str())
            .filter(|n| !KEYWORDS.contains(n))
            .map(str::to_string)
            .collect();
        (names, labels)
    }

    /// A scrape (the Prometheus text format, as Prometheus reads it) with a
    /// sample in every family the dashboard reads: one endpoint routed to,
    /// KV-event and replica-sync metrics registered, a flow-control outcome
    /// and a KV-event reset counted.
    fn live_scrape() -> String {
        use crate::admission::{AdmissionObserver, Outcome, RequestClass};
        use crate::endpoints::Endpoint;
        use crate::scheduler::PickRequest;
        let app = crate::server::App::new("pool");
        app.endpoints
            .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
        let decision = app
            .scheduler
            .pick(&PickRequest::default(), &app.endpoints.snapshot())
            .unwrap();
        let _in_flight = decision.begin();
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        app.admission_metrics.classified(&class);
        app.admission_metrics
            .left(&class, Outcome::Dispatched, std::time::Duration::ZERO);
        let kv = crate::kvevents::subscriber::KvEventMetrics::register(&app.metrics);
        kv.reset(
            crate::keys::WorkerKey {
                instance_id: 1,
                dp_rank: 0,
            },
            crate::kvevents::subscriber::ResetReason::Gap,
        );
        crate::replica_sync::SyncMetrics::register(&app.metrics);
        super::prometheus_text(&app.metrics.render(&app.endpoints))
    }

    /// What `q` reads that `text` does not serve: series names, and labels on
    /// none of the query's series; and the series it reads.
    fn unserved(q: &str, text: &str) -> (Vec<String>, BTreeSet<String>) {
        let (names, labels) = names_and_labels(q);
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                names.iter().any(|n| {
                    l.strip_prefix(n.as_str())
                        .is_some_and(|rest| rest.starts_with(['{', ' ']))
                })
            })
            .collect();
        let mut missing: Vec<String> = names
            .iter()
            .filter(|n| !samples.iter().any(|l| l.starts_with(n.as_str())))
            .map(|n| format!("series {n}"))
            .collect();
        missing.extend(
            labels
                .iter()
                .filter(|l| !samples.iter().any(|s| s.contains(&format!("{l}=\""))))
                .map(|l| format!("label {l}")),
        );
        (missing, names)
    }

    #[test]
    fn every_series_and_label_the_kvpick_dashboard_reads_is_served() {
        let text = live_scrape();
        let queries = queries();
        assert!(queries.len() >= 12, "{queries:?}");
        let mut read = BTreeSet::new();
        for q in &queries {
            let (missing, names) = unserved(q, &text);
            assert!(!names.is_empty(), "no series in {q}");
            assert!(
                missing.is_empty(),
                "{q} reads {missing:?}, not served:\n{text}"
            );
            read.extend(names);
        }
        // The figures the dashboard exists for.
        for family in [
            "kvpick_prefix_blocks_matched_total",
            "kvpick_decision_cost_blocks_total",
            "kvpick_endpoint_in_flight_requests",
            "kvpick_session_repicks_total",
            "kvpick_kv_events_ingest_lag_seconds_bucket",
            "kvpick_kv_events_resets_total",
            "inference_extension_flow_control_request_queue_duration_seconds_count",
            "kvpick_replica_sync_applied_deltas_total",
        ] {
            assert!(read.contains(family), "no panel reads {family}");
        }
    }

    #[test]
    fn the_check_catches_a_name_or_label_kvpick_does_not_serve() {
        let text = live_scrape();
        let q = "sum by (pod) (rate(kvpick_prefix_blocks_hit_total[5m])) + sum(kvpick_decisions_total{tenant=\"a\"})";
        let (missing, _) = unserved(q, &text);
        assert_eq!(
            missing,
            [
                "series kvpick_prefix_blocks_hit_total",
                "label pod",
                "label tenant"
            ]
        );
        let (missing, _) = unserved("sum by (term) (kvpick_decision_cost_blocks_total)", &text);
        assert!(missing.is_empty(), "{missing:?}");
    }
}
