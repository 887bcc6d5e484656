//! Counters and stage latencies the scheduler keeps; telemetry reads them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A timed stage of a pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Session binding and token check.
    Session,
    /// Prefix block hashing.
    Hash,
    /// Prefix index lookup.
    Lookup,
    /// Cost scoring and choice.
    Score,
}

impl Stage {
    /// All stages, in pick order.
    pub const ALL: [Stage; 4] = [Stage::Session, Stage::Hash, Stage::Lookup, Stage::Score];

    /// The `stage` label value.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Session => "session",
            Stage::Hash => "hash",
            Stage::Lookup => "lookup",
            Stage::Score => "score",
        }
    }
}

/// Upper bounds (seconds) of the stage latency histogram buckets.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
    0.002_5, 0.01, 0.05,
];

/// A lock-free latency histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Per-bucket counts; the last slot is +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// A histogram's state: sum in seconds, count, and cumulative bucket counts.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Sum of observations in seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
    /// (upper bound, count in this bucket alone) per bucket; the last bound is
    /// `f64::MAX` (+Inf), as the Prometheus text encoder expects.
    pub buckets: Vec<(f64, u64)>,
}

impl LatencyHistogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    /// The current state.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let buckets: Vec<(f64, u64)> = LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(&self.buckets)
            .map(|(b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        HistogramSnapshot {
            sum: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            count: buckets.iter().map(|(_, c)| c).sum(),
            buckets,
        }
    }
}

/// Plain counters the scheduler keeps; telemetry renders them.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Prompt prefix blocks looked up.
    pub blocks_queried: AtomicU64,
    /// Of those, blocks the chosen decode rank already held.
    pub blocks_matched: AtomicU64,
    /// Session requests whose bound worker was gone and were re-picked.
    pub session_repicks: AtomicU64,
    /// Of those, turns forwarded to the new worker as an `open` (re-homed).
    pub session_rehomes: AtomicU64,
    stages: [LatencyHistogram; 4],
}

/// The routing decisions' chosen decode cost, summed per term (in the scorers'
/// summing order, one sum per term), and how many decisions were summed: the
/// average cost of a decision, term by term.
#[derive(Debug)]
pub struct CostSums {
    /// `f64` sums, stored as bits; one per term.
    sums: Box<[AtomicU64]>,
    decisions: AtomicU64,
}

impl CostSums {
    /// Sums of `terms` terms, all zero.
    pub fn new(terms: usize) -> Self {
        CostSums {
            sums: (0..terms).map(|_| AtomicU64::new(0)).collect(),
            decisions: AtomicU64::new(0),
        }
    }

    /// How many terms are summed.
    pub fn len(&self) -> usize {
        self.sums.len()
    }

    /// Whether no term is summed.
    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }

    /// Adds one decision's term costs (in the scorers' summing order).
    pub fn add(&self, terms: &[f64]) {
        for (sum, cost) in self.sums.iter().zip(terms) {
            let _ = sum.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + cost).to_bits())
            });
        }
        self.decisions.fetch_add(1, Ordering::Relaxed);
    }

    /// The sum of the `i`-th term.
    pub fn sum(&self, i: usize) -> f64 {
        self.sums
            .get(i)
            .map_or(0.0, |s| f64::from_bits(s.load(Ordering::Relaxed)))
    }

    /// Decisions summed.
    pub fn decisions(&self) -> u64 {
        self.decisions.load(Ordering::Relaxed)
    }

    /// Sums for the terms named `to`, each starting at the sum of the term of
    /// the same name in `from` (these sums' names), and this decision count.
    pub fn carried_to(&self, from: &[&str], to: &[&str]) -> CostSums {
        let sums = to.iter().map(|name| {
            let i = from.iter().position(|n| n == name);
            AtomicU64::new(i.map_or(0.0, |i| self.sum(i)).to_bits())
        });
        CostSums {
            sums: sums.collect(),
            decisions: AtomicU64::new(self.decisions()),
        }
    }
}

impl SchedulerStats {
    /// The latency histogram of one stage.
    pub fn stage(&self, stage: Stage) -> &LatencyHistogram {
        &self.stages[stage as usize]
    }
}

impl SchedulerStats {
    /// Times `stage` until the returned guard drops.
    pub fn time(&self, stage: Stage) -> StageTimer<'_> {
        StageTimer {
            histogram: self.stage(stage),
            start: Instant::now(),
        }
    }
}

/// Observes the time from its creation to its drop in one stage's histogram.
#[must_use = "the stage is timed until the guard drops"]
pub struct StageTimer<'a> {
    histogram: &'a LatencyHistogram,
    start: Instant,
}

impl Drop for StageTimer<'_> {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed());
    }
}
