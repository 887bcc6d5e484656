//! Pool saturation from what kvpick already knows about each worker rank.
//!
//! Follows the llm-d Router (v0.10) utilization detector's roofline, with kvpick's
//! own booked load as a third, synchronous term (the llm-d concurrency detector):
//!
//! ```text
//! rank score = max((queue + pending / ranks) / queue_depth_threshold,
//!                  kv_usage / kv_cache_util_threshold,
//!                  (in_flight + pending / ranks) / max_in_flight_per_rank)
//! pool saturation = mean of the rank scores over decode-serving ranks
//! ```
//!
//! `queue` and `kv_usage` are the worker's scraped figures, used only while younger
//! than the scrape staleness; `in_flight` is what kvpick has routed to the rank and
//! not seen finish; `pending` counts requests admitted but not yet routed, spread
//! evenly (so one dispatch pass cannot release a whole queue at once). A pool
//! is saturated at 1.0 and above. Unlike llm-d, a worker with stale metrics is not
//! counted as fully saturated: its booked load still bounds it, and a lost scrape
//! path then degrades to concurrency-only admission instead of halting dispatch.

use std::time::{Duration, Instant};

use crate::endpoints::Snapshot;

/// Thresholds of the detector (flags `--flow-control-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Engine queue length at which a worker counts as full (llm-d `queueDepthThreshold`, 5).
    pub queue_depth_threshold: f64,
    /// KV-cache usage (0..1) at which a worker counts as full (llm-d `kvCacheUtilThreshold`, 0.8).
    pub kv_cache_util_threshold: f64,
    /// Requests in flight on one rank at which it counts as full (llm-d
    /// `maxConcurrency`, 100); 0 leaves booked load out.
    pub max_in_flight_per_rank: u32,
    /// Scraped figures older than this are ignored.
    pub metrics_staleness: Duration,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_depth_threshold: 5.0,
            kv_cache_util_threshold: 0.8,
            max_in_flight_per_rank: 100,
            metrics_staleness: Duration::from_secs(2),
        }
    }
}

/// The detector's reading of one pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saturation {
    /// Mean rank score; saturated at 1.0 and above.
    pub value: f64,
    /// Ranks scored.
    pub ranks: usize,
    /// Workers whose scraped figures were missing or stale.
    pub stale: usize,
}

impl Saturation {
    /// Whether new work should wait.
    pub fn is_saturated(&self) -> bool {
        self.value >= 1.0
    }
}

/// Scores the pool in `snapshot` at `now`; `None` when it has no decode-serving
/// worker (the scheduler answers 503 for those, never flow control).
pub fn measure(
    config: &SaturationConfig,
    snapshot: &Snapshot,
    now: Instant,
    pending: usize,
) -> Option<Saturation> {
    let serving = || snapshot.endpoints.iter().filter(|e| e.serves_decode());
    let ranks: usize = serving().map(|e| e.ranks() as usize).sum();
    if ranks == 0 {
        return None;
    }
    let pending_per_rank = pending as f64 / ranks as f64;
    let (mut sum, mut stale) = (0.0, 0);
    for e in serving() {
        let scraped = match e.scraped(now, config.metrics_staleness) {
            Some(load) => ratio(load.queue + pending_per_rank, config.queue_depth_threshold)
                .max(ratio(load.kv_usage, config.kv_cache_util_threshold)),
            None => {
                stale += 1;
                0.0
            }
        };
        for rank in 0..e.ranks() {
            let booked = if config.max_in_flight_per_rank == 0 {
                0.0
            } else {
                (f64::from(e.in_flight(rank)) + pending_per_rank)
                    / f64::from(config.max_in_flight_per_rank)
            };
            sum += scraped.max(booked);
        }
    }
    Some(Saturation {
        value: sum / ranks as f64,
        ranks,
        stale,
    })
}

fn ratio(value: f64, threshold: f64) -> f64 {
    if threshold > 0.0 && value.is_finite() {
        (value / threshold).max(0.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Endpoint, EndpointTable, Role, ScrapedLoad};

    fn table(n: usize) -> EndpointTable {
        crate::fixtures::pool(n, 8000)
    }

    fn load(queue: f64, kv: f64, at: Instant) -> ScrapedLoad {
        ScrapedLoad {
            queue,
            running: 0.0,
            kv_usage: kv,
            block_size: None,
            num_blocks: None,
            at,
        }
    }

    #[test]
    fn roofline_of_fresh_metrics_and_booked_load_averaged_over_ranks() {
        let cfg = SaturationConfig {
            max_in_flight_per_rank: 4,
            ..SaturationConfig::default()
        };
        let t = table(2);
        let snap = t.snapshot();
        let now = Instant::now();
        // Queue 5 of 5 on one worker, KV 0.4 of 0.8 on the other: (1.0 + 0.5) / 2.
        snap.endpoints[0].set_scraped(load(5.0, 0.1, now));
        snap.endpoints[1].set_scraped(load(0.0, 0.4, now));
        let s = measure(&cfg, &snap, now, 0).unwrap();
        assert!((s.value - 0.75).abs() < 1e-9, "{s:?}");
        assert!(!s.is_saturated());
        // Booked load: 4 of 4 in flight on worker 1 makes it 1.0 too.
        let _g: Vec<_> = (0..4).map(|_| snap.endpoints[1].begin_request(0)).collect();
        assert!(measure(&cfg, &snap, now, 0).unwrap().is_saturated());
        // Stale metrics are ignored, booked load still counts; pending spreads evenly.
        let later = now + Duration::from_secs(10);
        let s = measure(&cfg, &snap, later, 2).unwrap();
        assert_eq!(s.stale, 2);
        assert!((s.value - (0.25 + 1.25) / 2.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn a_pool_without_decode_workers_has_no_reading() {
        let cfg = SaturationConfig::default();
        assert!(measure(&cfg, &Snapshot::default(), Instant::now(), 3).is_none());
        let t = EndpointTable::new();
        let mut e = Endpoint::new("10.0.0.1:8000".parse().unwrap());
        e.role = Role::Prefill;
        t.replace(vec![e]);
        assert!(measure(&cfg, &t.snapshot(), Instant::now(), 0).is_none());
    }
}
