//! Prometheus metrics of the learned latency models (`--scoring predicted`):
//! the prediction error as a histogram of |error| / actual TTFT per pool
//! (`kvpick_latency_prediction_error_ratio`), the decisions the heuristic made
//! while the models were cold (`kvpick_latency_fallback_decisions`), the
//! sheddable requests refused for their TTFT objective
//! (`kvpick_latency_slo_shed`), peers' models refused
//! (`kvpick_latency_shared_models_refused`), and the workers with a model of
//! their own. The core keeps the counts; this
//! collector reads them at scrape time.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::latency::Learner;
use crate::telemetry::Metrics;

/// Renders a [`Learner`]'s counts on each scrape.
#[derive(Debug)]
pub struct LatencyMetrics {
    pool: String,
    learner: Arc<Learner>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

impl Collector for LatencyMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let labels = PoolLabels {
            pool: self.pool.clone(),
        };
        let (buckets, sum) = self.learner.errors();
        let count = buckets.iter().map(|(_, c)| c).sum();
        encoder
            .encode_descriptor(
                "kvpick_latency_prediction_error_ratio",
                "Predicted TTFT's |error| / actual TTFT of each learned request, per pool",
                None,
                MetricType::Histogram,
            )?
            .encode_family(&labels)?
            .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        let fallbacks = ConstCounter::new(self.learner.fallbacks());
        fallbacks.encode(
            encoder
                .encode_descriptor(
                    "kvpick_latency_fallback_decisions",
                    "Decisions scored by the heuristic because the latency models were cold",
                    None,
                    fallbacks.metric_type(),
                )?
                .encode_family(&labels)?,
        )?;
        let sheds = ConstCounter::new(self.learner.slo_sheds());
        sheds.encode(
            encoder
                .encode_descriptor(
                    "kvpick_latency_slo_shed",
                    "Sheddable requests refused (429) because no warm worker was predicted to meet their TTFT objective",
                    None,
                    sheds.metric_type(),
                )?
                .encode_family(&labels)?,
        )?;
        let refused = ConstCounter::new(self.learner.refused_shared());
        refused.encode(
            encoder
                .encode_descriptor(
                    "kvpick_latency_shared_models_refused",
                    "Latency models from peer replicas refused as malformed or absurd",
                    None,
                    refused.metric_type(),
                )?
                .encode_family(&labels)?,
        )?;
        let workers = ConstGauge::new(self.learner.workers() as i64);
        workers.encode(
            encoder
                .encode_descriptor(
                    "kvpick_latency_models",
                    "Worker ranks with a latency model of their own",
                    None,
                    workers.metric_type(),
                )?
                .encode_family(&labels)?,
        )?;
        Ok(())
    }
}

impl LatencyMetrics {
    /// Registers the families of `learner`, the models of pool `pool`.
    pub fn register(metrics: &Metrics, pool: &str, learner: Arc<Learner>) {
        let pool = pool.to_string();
        metrics.register(|r| r.register_collector(Box::new(LatencyMetrics { pool, learner })));
    }
}
