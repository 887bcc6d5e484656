//! Replica-sync metrics (`kvpick_replica_sync_*`): deltas published, dropped
//! and applied, errors, reconnects, the connection and peers, warm starts and
//! propagation delay. Registered into kvpick's registry at start-up
//! ([`SyncMetrics::register`]); benchmarks read the counters back.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::telemetry::Metrics;

/// Replica-sync metrics.
#[derive(Debug, Default)]
pub struct SyncMetrics {
    pub(super) published: Counter,
    pub(super) dropped: Counter,
    pub(super) errors: Counter,
    pub(super) reconnects: Counter,
    pub(super) applied: Counter,
    pub(super) decode_errors: Counter,
    pub(super) connected: Gauge,
    pub(super) peers: Gauge,
    pub(super) warm_start_timeouts: Counter,
    pub(super) warm_start_entries: Counter,
    pub(super) published_bytes: Counter,
    pub(super) propagation: Option<Histogram>,
    /// Exact propagation samples in seconds, at most `samples_cap`: kept only
    /// when made by [`SyncMetrics::recording`] (benchmarks read percentiles
    /// the histogram's buckets cannot give).
    pub(super) samples: std::sync::Mutex<Vec<f64>>,
    pub(super) samples_cap: usize,
}

impl SyncMetrics {
    /// Creates the metrics and registers them with `metrics`.
    pub fn register(metrics: &Metrics) -> Arc<SyncMetrics> {
        let m = Arc::new(SyncMetrics {
            propagation: Some(Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.000_1, 2.0, 16),
            )),
            ..Default::default()
        });
        metrics.register(|r| {
            let r = r.sub_registry_with_prefix("kvpick_replica_sync");
            r.register(
                "published_deltas",
                "Deltas this replica published",
                m.published.clone(),
            );
            r.register(
                "published_bytes",
                "Bytes of batches this replica published",
                m.published_bytes.clone(),
            );
            r.register(
                "dropped_deltas",
                "Deltas dropped: the queue was full or the server unreachable",
                m.dropped.clone(),
            );
            r.register(
                "errors",
                "Failed commands (server down, slow or refusing)",
                m.errors.clone(),
            );
            r.register(
                "reconnects",
                "Connections opened after a failure",
                m.reconnects.clone(),
            );
            r.register(
                "applied_deltas",
                "Peers' deltas applied here",
                m.applied.clone(),
            );
            r.register(
                "decode_errors",
                "Stream entries that could not be decoded",
                m.decode_errors.clone(),
            );
            r.register(
                "connected",
                "1 while the subscriber is connected",
                m.connected.clone(),
            );
            r.register("peers", "Peers holding a booking lease", m.peers.clone());
            r.register(
                "warm_start_timeouts",
                "Warm starts that reached their bound before loading the state",
                m.warm_start_timeouts.clone(),
            );
            r.register(
                "warm_start_entries",
                "Stream entries replayed at warm start",
                m.warm_start_entries.clone(),
            );
            if let Some(h) = &m.propagation {
                r.register(
                    "propagation_seconds",
                    "From a peer's publish to applying its batch here (wall clocks)",
                    h.clone(),
                );
            }
        });
        m
    }
}

impl SyncMetrics {
    /// Like [`SyncMetrics::register`], and keeps the first `cap` propagation
    /// samples exactly (one per peer batch applied live).
    pub fn recording(metrics: &Metrics, cap: usize) -> Arc<SyncMetrics> {
        let mut m = SyncMetrics::register(metrics);
        Arc::get_mut(&mut m).expect("not shared yet").samples_cap = cap;
        m
    }

    /// Takes the recorded propagation samples (seconds), in arrival order.
    pub fn take_propagation_samples(&self) -> Vec<f64> {
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Deltas this replica published.
    pub fn published_deltas(&self) -> u64 {
        self.published.get()
    }

    /// Bytes of the batches this replica published.
    pub fn published_bytes(&self) -> u64 {
        self.published_bytes.get()
    }

    /// Peers' deltas applied here.
    pub fn applied_deltas(&self) -> u64 {
        self.applied.get()
    }

    /// Deltas dropped (queue full or server unreachable).
    pub fn dropped_deltas(&self) -> u64 {
        self.dropped.get()
    }

    /// Failed commands.
    pub fn errors(&self) -> u64 {
        self.errors.get()
    }

    pub(super) fn observe_propagation(&self, seconds: f64) {
        if let Some(h) = &self.propagation {
            h.observe(seconds);
        }
        if self.samples_cap > 0 {
            let mut s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
            if s.len() < self.samples_cap {
                s.push(seconds);
            }
        }
    }

    /// Stream entries replayed at warm start so far.
    pub fn warm_start_entries(&self) -> u64 {
        self.warm_start_entries.get()
    }

    /// Warm starts that reached their bound before loading the state.
    pub fn warm_start_timeouts(&self) -> u64 {
        self.warm_start_timeouts.get()
    }
}
