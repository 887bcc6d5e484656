//! Prometheus metrics of admission, under the names the GIE EPP and the llm-d
//! Router (v0.10) use: `inference_extension_flow_control_*` (and the same under
//! `llm_d_epp_flow_control_*`) and `inference_objective_*`, labelled by objective.
//!
//! [`AdmissionMetrics::register`] adds them to kvpick's registry; the queue gauges
//! and the saturation are read from the [`Gate`] at scrape time.

use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::admission::{AdmissionObserver, Gate, Outcome, RequestClass};
use crate::request::usage::Usage;
use crate::telemetry::Metrics;

/// Flow-control queue wait buckets (llm-d's).
const QUEUE_BUCKETS: [f64; 16] = [
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Request duration buckets, 5 ms to an hour (the GIE `generalLatencyBuckets`).
const DURATION_BUCKETS: [f64; 35] = [
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0,
    1200.0, 1800.0, 2700.0, 3600.0,
];

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct QueueDurationLabels {
    fairness_id: Arc<str>,
    priority: i32,
    outcome: &'static str,
    inference_pool: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct QueueLabels {
    fairness_id: String,
    priority: String,
    inference_pool: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SaturationLabels {
    inference_pool: String,
    stage: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ObjectiveLabels {
    objective: Arc<str>,
    model_name: Arc<str>,
    target_model_name: Arc<str>,
    priority: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ObjectiveErrorLabels {
    objective: Arc<str>,
    model_name: Arc<str>,
    target_model_name: Arc<str>,
    error_code: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ObjectiveDurationLabels {
    objective: Arc<str>,
    model_name: Arc<str>,
    target_model_name: Arc<str>,
}

/// Reads one figure of a queue level.
type LevelValue = fn(&crate::admission::QueueLevel) -> i64;

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn queue_histogram() -> Histogram {
    Histogram::new(QUEUE_BUCKETS)
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// GIE's size buckets: 64 B to 1 GiB, doubling.
fn size_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        64.0, 2.0, 25,
    ))
}

/// GIE's token buckets: 1 to 1 M tokens, doubling.
fn token_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1.0, 2.0, 21,
    ))
}

/// The admission metrics; also the gate's [`AdmissionObserver`].
#[derive(Debug)]
pub struct AdmissionMetrics {
    pool: Arc<str>,
    queue_duration: HistogramFamily<QueueDurationLabels>,
    requests: Family<ObjectiveLabels, Counter>,
    errors: Family<ObjectiveErrorLabels, Counter>,
    durations: HistogramFamily<ObjectiveDurationLabels>,
    request_sizes: HistogramFamily<ObjectiveDurationLabels>,
    response_sizes: HistogramFamily<ObjectiveDurationLabels>,
    input_tokens: HistogramFamily<ObjectiveDurationLabels>,
    output_tokens: HistogramFamily<ObjectiveDurationLabels>,
    gate: Arc<Mutex<Option<Gate>>>,
}

/// Renders the gate's queue levels and saturation on each scrape.
#[derive(Debug)]
struct GateCollector {
    pool: String,
    gate: Arc<Mutex<Option<Gate>>>,
}

impl Collector for GateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let gate = self.gate.lock().clone();
        let levels = gate.as_ref().map(Gate::levels).unwrap_or_default();
        for prefix in ["inference_extension", "llm_d_epp"] {
            let metrics: [(&str, &str, LevelValue); 2] = [
                (
                    "flow_control_queue_size",
                    "Current number of requests actively held in the Flow Control queue.",
                    |l| l.requests as i64,
                ),
                (
                    "flow_control_queue_bytes",
                    "Current total size in bytes of requests actively held in the Flow Control queue.",
                    |l| l.bytes as i64,
                ),
            ];
            for (name, help, value) in metrics {
                let name = format!("{prefix}_{name}");
                let mut family = encoder.encode_descriptor(
                    &name,
                    help,
                    None,
                    prometheus_client::metrics::MetricType::Gauge,
                )?;
                for l in &levels {
                    let labels = QueueLabels {
                        fairness_id: l.flow.clone(),
                        priority: l.priority.to_string(),
                        inference_pool: self.pool.clone(),
                    };
                    ConstGauge::new(value(l)).encode(family.encode_family(&labels)?)?;
                }
                if levels.is_empty() {
                    // An empty queue reads 0, not "no data" (one series, so a
                    // dashboard's sums and derivatives have a value).
                    let labels = QueueLabels {
                        fairness_id: String::new(),
                        priority: "0".into(),
                        inference_pool: self.pool.clone(),
                    };
                    ConstGauge::new(0i64).encode(family.encode_family(&labels)?)?;
                }
            }
            let Some(gate) = &gate else {
                continue;
            };
            let g = ConstGauge::new(gate.last_saturation());
            let name = format!("{prefix}_flow_control_pool_saturation");
            let mut family = encoder.encode_descriptor(
                &name,
                "Pool saturation signal gating Flow Control dispatch; 1.0 is the gating set point.",
                None,
                g.metric_type(),
            )?;
            g.encode(family.encode_family(&SaturationLabels {
                inference_pool: self.pool.clone(),
                stage: "effective",
            })?)?;
        }
        Ok(())
    }
}

impl AdmissionMetrics {
    /// Creates the metrics and registers them with `metrics` (pool label from it).
    pub fn register(metrics: &Metrics, pool: &str) -> Arc<Self> {
        let m = AdmissionMetrics {
            pool: pool.into(),
            queue_duration: Family::new_with_constructor(queue_histogram),
            requests: Family::default(),
            errors: Family::default(),
            durations: Family::new_with_constructor(duration_histogram),
            request_sizes: Family::new_with_constructor(size_histogram),
            response_sizes: Family::new_with_constructor(size_histogram),
            input_tokens: Family::new_with_constructor(token_histogram),
            output_tokens: Family::new_with_constructor(token_histogram),
            gate: Arc::default(),
        };
        metrics.register(|r| {
            for prefix in ["inference_extension", "llm_d_epp"] {
                r.register(
                    format!("{prefix}_flow_control_request_queue_duration_seconds"),
                    "Distribution of total time requests spend in the Flow Control layer (from enqueue to final outcome).",
                    m.queue_duration.clone(),
                );
            }
            r.register(
                "inference_objective_request",
                "Counter of inference objective requests broken out for each model and target model.",
                m.requests.clone(),
            );
            r.register(
                "inference_objective_request_error",
                "Counter of inference objective requests errors broken out for each model and target model.",
                m.errors.clone(),
            );
            r.register(
                "inference_objective_request_duration_seconds",
                "Inference objective response latency distribution in seconds for each model and target model.",
                m.durations.clone(),
            );
            r.register(
                "inference_objective_request_sizes",
                "Inference objective requests size distribution in bytes for each model and target model.",
                m.request_sizes.clone(),
            );
            r.register(
                "inference_objective_response_sizes",
                "Inference objective responses size distribution in bytes for each model and target model.",
                m.response_sizes.clone(),
            );
            r.register(
                "inference_objective_input_tokens",
                "Inference objective input token count distribution for requests in each model.",
                m.input_tokens.clone(),
            );
            r.register(
                "inference_objective_output_tokens",
                "Inference objective output token count distribution for requests in each model.",
                m.output_tokens.clone(),
            );
            r.register_collector(Box::new(GateCollector {
                pool: pool.to_string(),
                gate: Arc::clone(&m.gate),
            }));
        });
        Arc::new(m)
    }

    /// Reads queue levels and saturation from `gate` on each scrape.
    pub fn watch(&self, gate: &Gate) {
        *self.gate.lock() = Some(gate.clone());
    }

    /// Counts a request answered with an error (`error_code` as GIE names them:
    /// `ResourceExhausted`, `ServiceUnavailable`, `BadRequest`).
    pub fn error(&self, class: &RequestClass, error_code: &'static str) {
        self.errors
            .get_or_create(&ObjectiveErrorLabels {
                objective: class.objective.clone(),
                model_name: class.model.clone(),
                target_model_name: class.model.clone(),
                error_code,
            })
            .inc();
    }

    /// Records the size of a request body kvpick read.
    pub fn request_size(&self, class: &RequestClass, bytes: usize) {
        self.request_sizes
            .get_or_create(&Self::model_labels(class))
            .observe(bytes as f64);
    }

    /// Records a routed request's end: its duration (request to end of response),
    /// the response's size, and the engine's token counts when it reported them.
    pub fn finished(
        &self,
        class: &RequestClass,
        took: Duration,
        response_bytes: u64,
        usage: Option<Usage>,
    ) {
        let labels = Self::model_labels(class);
        self.durations
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        self.response_sizes
            .get_or_create(&labels)
            .observe(response_bytes as f64);
        if let Some(usage) = usage {
            self.input_tokens
                .get_or_create(&labels)
                .observe(usage.prompt_tokens as f64);
            self.output_tokens
                .get_or_create(&labels)
                .observe(usage.completion_tokens as f64);
        }
    }

    fn model_labels(class: &RequestClass) -> ObjectiveDurationLabels {
        ObjectiveDurationLabels {
            objective: class.objective.clone(),
            model_name: class.model.clone(),
            target_model_name: class.model.clone(),
        }
    }
}

impl AdmissionObserver for AdmissionMetrics {
    /// Counts the request, and records its body's size when it has one.
    fn classified(&self, class: &RequestClass) {
        self.requests
            .get_or_create(&ObjectiveLabels {
                objective: class.objective.clone(),
                model_name: class.model.clone(),
                target_model_name: class.model.clone(),
                priority: class.priority,
            })
            .inc();
        if class.bytes > 0 {
            self.request_size(class, class.bytes);
        }
    }

    fn left(&self, class: &RequestClass, outcome: Outcome, waited: Duration) {
        self.queue_duration
            .get_or_create(&QueueDurationLabels {
                fairness_id: class.flow.clone(),
                priority: class.priority,
                outcome: outcome.as_str(),
                inference_pool: self.pool.clone(),
            })
            .observe(waited.as_secs_f64());
    }
}
