//! KV-event metrics, per worker rank (`kvpick_kv_events_*`): whether each rank
//! is precise, events applied, resets by reason, batches dropped, orphaned or
//! replayed, image blocks by identity, undecodable messages, the ingest queue's
//! bytes and the ingest lag. Registered into kvpick's registry at start-up
//! ([`KvEventMetrics::register`]); a rank's series go when it leaves.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::queue::ResetReason;
use super::ApplyStats;
use crate::endpoints::WorkerKey;
use crate::telemetry::Metrics;

/// `identity` values of `kvpick_kv_events_mm_blocks`.
const MM_IDENTITIES: [&str; 3] = ["issued", "native", "unmapped"];

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WorkerLabels {
    instance_id: u64,
    dp_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MmBlockLabels {
    instance_id: u64,
    dp_rank: u32,
    identity: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResetLabels {
    instance_id: u64,
    dp_rank: u32,
    reason: ResetReason,
}

fn labels(w: WorkerKey) -> WorkerLabels {
    WorkerLabels {
        instance_id: w.instance_id,
        dp_rank: w.dp_rank,
    }
}

/// KV-event metrics, per worker rank.
#[derive(Debug, Clone)]
pub struct KvEventMetrics {
    precise: Family<WorkerLabels, Gauge>,
    events: Family<WorkerLabels, Counter>,
    resets: Family<ResetLabels, Counter>,
    dropped: Family<WorkerLabels, Counter>,
    orphans: Family<WorkerLabels, Counter>,
    replayed: Family<WorkerLabels, Counter>,
    mm_blocks: Family<MmBlockLabels, Counter>,
    decode_errors: Counter,
    ingest_lag: Histogram,
    queued_bytes: Gauge,
}

impl KvEventMetrics {
    /// Creates the metrics and registers them with `metrics`.
    pub fn register(metrics: &Metrics) -> Arc<Self> {
        let m = KvEventMetrics {
            precise: Family::default(),
            events: Family::default(),
            resets: Family::default(),
            dropped: Family::default(),
            orphans: Family::default(),
            replayed: Family::default(),
            mm_blocks: Family::default(),
            decode_errors: Counter::default(),
            queued_bytes: Gauge::default(),
            ingest_lag: Histogram::new([
                0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0,
            ]),
        };
        metrics.register(|r| {
            r.register(
                "kvpick_kv_events_precise",
                "1 while the worker rank has a live KV event stream (precise mode), 0 in approximate mode",
                m.precise.clone(),
            );
            r.register(
                "kvpick_kv_events_ingested",
                "KV events applied to the prefix index",
                m.events.clone(),
            );
            r.register(
                "kvpick_kv_events_resets",
                "Times a worker rank's part of the prefix index was reset, by reason",
                m.resets.clone(),
            );
            r.register(
                "kvpick_kv_events_dropped_batches",
                "Event batches dropped because the ingest queue was full (the rank holding the most bytes loses its queued batches and is reset)",
                m.dropped.clone(),
            );
            r.register(
                "kvpick_kv_events_orphan_blocks",
                "Stored blocks skipped because their parent block is unknown",
                m.orphans.clone(),
            );
            r.register(
                "kvpick_kv_events_replayed_batches",
                "Event batches recovered from the engine's replay socket",
                m.replayed.clone(),
            );
            r.register(
                "kvpick_kv_events_mm_blocks",
                "Stored vLLM blocks with image hashes in extra_keys: identity=issued (hashes kvpick gave the engine, matchable), native (vLLM's own hashes, never matchable: the engine ignored kvpick's UUIDs), unmapped (image tokens not pairable with the hashes)",
                m.mm_blocks.clone(),
            );
            r.register(
                "kvpick_kv_events_decode_errors",
                "KV event messages that could not be decoded",
                m.decode_errors.clone(),
            );
            r.register(
                "kvpick_kv_events_queued_bytes",
                "Bytes of KV event batches waiting for the ingest thread, all worker ranks together (at most --kv-events-max-queued-bytes)",
                m.queued_bytes.clone(),
            );
            r.register(
                "kvpick_kv_events_ingest_lag_seconds",
                "Time from a batch's arrival to its events being visible to lookups",
                m.ingest_lag.clone(),
            );
        });
        Arc::new(m)
    }

    /// Drops every series of a worker rank that left the endpoint set, so the
    /// families do not grow with each pod that ever existed.
    pub(super) fn forget(&self, w: WorkerKey) {
        let l = labels(w);
        for family in [&self.events, &self.dropped, &self.orphans, &self.replayed] {
            family.remove(&l);
        }
        self.precise.remove(&l);
        for reason in ResetReason::ALL {
            self.resets.remove(&ResetLabels {
                instance_id: w.instance_id,
                dp_rank: w.dp_rank,
                reason,
            });
        }
        for identity in MM_IDENTITIES {
            self.mm_blocks.remove(&MmBlockLabels {
                instance_id: w.instance_id,
                dp_rank: w.dp_rank,
                identity,
            });
        }
    }

    /// Counts what applying one batch from `w` did; `received` is when the
    /// batch arrived.
    pub(super) fn applied(&self, w: WorkerKey, stats: &ApplyStats, received: Instant) {
        let l = labels(w);
        self.events.get_or_create(&l).inc_by(stats.events);
        if stats.orphan_blocks > 0 {
            self.orphans.get_or_create(&l).inc_by(stats.orphan_blocks);
        }
        let mm = [
            stats.mm_blocks,
            stats.mm_native_blocks,
            stats.mm_unmapped_blocks,
        ];
        for (identity, n) in MM_IDENTITIES.into_iter().zip(mm) {
            if n > 0 {
                self.mm_blocks
                    .get_or_create(&MmBlockLabels {
                        instance_id: w.instance_id,
                        dp_rank: w.dp_rank,
                        identity,
                    })
                    .inc_by(n);
            }
        }
        for _ in 0..stats.clears {
            self.reset(w, ResetReason::Cleared);
        }
        self.ingest_lag.observe(received.elapsed().as_secs_f64());
    }

    /// `w`'s stream (re)connected (`live`) or was lost: it is precise while
    /// live, and its index part starts over either way.
    pub(super) fn live(&self, w: WorkerKey, live: bool) {
        self.precise.get_or_create(&labels(w)).set(live as i64);
        let reason = if live {
            ResetReason::Connect
        } else {
            ResetReason::Disconnect
        };
        self.reset(w, reason);
    }

    /// Counts a message that could not be decoded.
    pub(super) fn decode_error(&self) {
        self.decode_errors.inc();
    }

    /// Counts `batches` of `w` dropped by a full ingest queue.
    pub(super) fn dropped(&self, w: WorkerKey, batches: u64) {
        self.dropped.get_or_create(&labels(w)).inc_by(batches);
    }

    /// Counts `batches` of `w` recovered from its engine's replay socket.
    pub(super) fn replayed(&self, w: WorkerKey, batches: u64) {
        self.replayed.get_or_create(&labels(w)).inc_by(batches);
    }

    /// The gauge that follows the ingest queue's bytes.
    pub(super) fn queued_bytes(&self) -> Gauge {
        self.queued_bytes.clone()
    }

    /// Counts a reset of `w`'s precise entries.
    pub(crate) fn reset(&self, w: WorkerKey, reason: ResetReason) {
        self.resets
            .get_or_create(&ResetLabels {
                instance_id: w.instance_id,
                dp_rank: w.dp_rank,
                reason,
            })
            .inc();
    }
}
