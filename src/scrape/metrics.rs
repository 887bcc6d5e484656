//! The scrape failures as Prometheus counters: kvpick's by reason, and llm-d's
//! data-layer poll/extract counters, read from [`ScrapeErrors`] at scrape time.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use crate::telemetry::Metrics;
use kvpick_core::scrape::{ScrapeErrors, ScrapeFailure};

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
