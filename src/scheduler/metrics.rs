//! Prometheus metrics of the scheduler: prefix hit ratio, index size, sessions,
//! re-picks and per-stage latency (`kvpick_prefix_*`, `kvpick_session_*`,
//! `kvpick_scheduler_stage_duration_seconds`). The core keeps plain counters;
//! this collector reads them at scrape time.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::scheduler::{Scheduler, Stage};
use crate::telemetry::Metrics;

/// Renders [`SchedulerStats`](crate::scheduler::SchedulerStats), the prefix index and
/// the session table on each scrape.
#[derive(Debug)]
pub struct SchedulerMetrics {
    scheduler: Arc<Scheduler>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TermLabels {
    term: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StageLabels {
    stage: &'static str,
}

impl Collector for SchedulerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.scheduler.stats();
        let counters = [
            (
                "kvpick_prefix_blocks_queried",
                "Prompt prefix blocks looked up in the prefix index",
                s.blocks_queried.load(Ordering::Relaxed),
            ),
            (
                "kvpick_prefix_blocks_matched",
                "Prompt prefix blocks the chosen worker rank already held (hit ratio = matched / queried)",
                s.blocks_matched.load(Ordering::Relaxed),
            ),
            (
                "kvpick_session_repicks",
                "Session requests re-picked because their bound worker was gone",
                s.session_repicks.load(Ordering::Relaxed),
            ),
            (
                "kvpick_session_rehomes",
                "Session turns whose worker was gone, forwarded to a new worker as an `open`",
                s.session_rehomes.load(Ordering::Relaxed),
            ),
            (
                "kvpick_session_evictions",
                "Sessions evicted (least recently used) because the session table was full",
                self.scheduler.sessions().evictions(),
            ),
            (
                "kvpick_prefix_precise_dropped_blocks",
                "KV-event stored blocks dropped because the worker rank was at its precise-entry cap",
                self.scheduler.index().precise_dropped(),
            ),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let gauges = [
            (
                "kvpick_prefix_index_entries",
                "Indexed (prefix block, worker rank) entries",
                self.scheduler.index().len() as i64,
            ),
            (
                "kvpick_session_bindings",
                "Sessions bound to a worker rank",
                self.scheduler.sessions().len() as i64,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let live = self.scheduler.plugins();
        let costs = &live.decision_cost;
        let decisions = ConstCounter::new(costs.decisions());
        decisions.encode(encoder.encode_descriptor(
            "kvpick_decisions",
            "Routing decisions (the denominator of the per-decision averages)",
            None,
            decisions.metric_type(),
        )?)?;
        {
            let mut family = encoder.encode_descriptor(
                "kvpick_decision_cost_blocks",
                "The chosen decode rank's cost summed over decisions, per cost term (average = this / kvpick_decisions)",
                None,
                MetricType::Counter,
            )?;
            let scorers = &live.plugins.scorers;
            for (i, scorer) in scorers.iter().enumerate() {
                ConstCounter::new(costs.sum(i)).encode(family.encode_family(&TermLabels {
                    term: scorer.name(),
                })?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "kvpick_scheduler_stage_duration_seconds",
            "Time spent in each stage of a routing decision",
            None,
            MetricType::Histogram,
        )?;
        for stage in Stage::ALL {
            let h = s.stage(stage).snapshot();
            family
                .encode_family(&StageLabels {
                    stage: stage.name(),
                })?
                .encode_histogram::<NoLabelSet>(h.sum, h.count, &h.buckets, None)?;
        }
        Ok(())
    }
}

impl SchedulerMetrics {
    /// Registers the scheduler's families into kvpick's registry, read at scrape time.
    pub fn register(metrics: &Metrics, scheduler: Arc<Scheduler>) {
        metrics.register(|r| r.register_collector(Box::new(SchedulerMetrics { scheduler })));
    }
}
