//! Prometheus metrics of multimodal routing: the configured mode, requests and
//! image identities by how they were routed (`kvpick_mm_routing_mode`,
//! `kvpick_mm_requests`, `kvpick_mm_images`) and remote image fetches
//! (`kvpick_mm_fetch`). The core keeps plain counters; these collectors read
//! them at scrape time.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::multimodal::remote::FetchStats;
use crate::multimodal::{MmRouting, MmStats};
use crate::telemetry::Metrics;

/// Renders [`crate::multimodal::MmStats`] and the configured multimodal routing mode.
#[derive(Debug)]
pub struct MultimodalMetrics {
    stats: Arc<MmStats>,
    mode: MmRouting,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MmModeLabels {
    mode: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MmIdentityLabels {
    identity: &'static str,
}

impl Collector for MultimodalMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::multimodal::identity::IdentitySource;
        let modes = [
            MmRouting::Exact,
            MmRouting::Approximate,
            MmRouting::TextOnly,
        ];
        let mut family = encoder.encode_descriptor(
            "kvpick_mm_routing_mode",
            "1 for the multimodal routing mode kvpick's configuration allows: exact (tokenizer and vision model: image blocks equal the engines'), approximate (no tokenizer: images are kvpick-only blocks), text_only (tokenizer without a vision model: nothing after the first image matches)",
            None,
            MetricType::Gauge,
        )?;
        for m in modes {
            ConstGauge::new(i64::from(m == self.mode))
                .encode(family.encode_family(&MmModeLabels { mode: m.as_str() })?)?;
        }
        let mut family = encoder.encode_descriptor(
            "kvpick_mm_requests",
            "Requests with images, by how their images were routed: exact (every image token-exact), approximate (no tokenizer, or an image of unknown size, e.g. a remote URL not fetched), text_only (no vision model)",
            None,
            MetricType::Counter,
        )?;
        for m in modes {
            ConstCounter::new(self.stats.requests(m))
                .encode(family.encode_family(&MmModeLabels { mode: m.as_str() })?)?;
        }
        let mut family = encoder.encode_descriptor(
            "kvpick_mm_images",
            "Image identities computed: content (decoded data: URL or fetched bytes, exact) or url (the URL string)",
            None,
            MetricType::Counter,
        )?;
        for src in [IdentitySource::Content, IdentitySource::Url] {
            ConstCounter::new(self.stats.images(src)).encode(family.encode_family(
                &MmIdentityLabels {
                    identity: src.as_str(),
                },
            )?)?;
        }
        Ok(())
    }
}

impl MultimodalMetrics {
    /// Registers the multimodal counters and the routing mode into kvpick's registry, read at scrape time.
    pub fn register(metrics: &Metrics, stats: Arc<MmStats>, mode: MmRouting) {
        metrics.register(|r| r.register_collector(Box::new(MultimodalMetrics { stats, mode })));
    }
}

/// Renders [`crate::multimodal::remote::FetchStats`].
#[derive(Debug)]
pub struct ImageFetchMetrics {
    stats: Arc<FetchStats>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FetchOutcomeLabels {
    outcome: &'static str,
}

impl Collector for ImageFetchMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::multimodal::remote::FetchOutcome;
        let mut family = encoder.encode_descriptor(
            "kvpick_mm_fetch",
            "Remote images resolved by --mm-fetch, by outcome: ok (fetched, identified by content), cached, or why the image kept its URL identity (timeout, too_large, status, refused, not_image, error, limit)",
            None,
            MetricType::Counter,
        )?;
        for o in FetchOutcome::ALL {
            ConstCounter::new(self.stats.count(o)).encode(family.encode_family(
                &FetchOutcomeLabels {
                    outcome: o.as_str(),
                },
            )?)?;
        }
        Ok(())
    }
}

impl ImageFetchMetrics {
    /// Registers the remote image fetch counts into kvpick's registry, read at scrape time.
    pub fn register(metrics: &Metrics, stats: Arc<FetchStats>) {
        metrics.register(|r| r.register_collector(Box::new(ImageFetchMetrics { stats })));
    }
}
