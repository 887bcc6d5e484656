//! kvpick's Prometheus registry ([`Metrics`]) and the families it owns: requests
//! by result, decision latency, in-flight per endpoint, and the GIE-named pool
//! and endpoint gauges, refreshed from the endpoint table at each scrape.
//! Subsystems register their own families into it ([`Metrics::register`]).

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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
