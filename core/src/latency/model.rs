//! One worker's latency model: a TTFT fit and a decode fit, both
//! [`Rls`] over physical terms, with its observation count and recent error.

use serde::{Deserialize, Serialize};

use super::features::{
    Features, Observed, Rejected, TPOT_RUNNING, TPOT_TERMS, TTFT_PENDING, TTFT_TERMS,
    TTFT_UNCACHED, TTFT_WAITING,
};
use super::rls::{Rls, RlsSnapshot};

/// Weight of the newest observation in the recent-error average.
const ERROR_EWMA: f64 = 0.05;
/// Most observations a shared model may claim (a century at 100k a second
/// is below it); a peer claiming more is refused, so it cannot freeze every
/// other replica's model of a worker.
pub const MAX_SHARED_OBSERVATIONS: u64 = 1 << 48;
/// Largest recent error a shared model may report.
pub const MAX_SHARED_ERROR: f64 = 1.0e6;

/// A worker's fitted model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerModel {
    ttft: Rls<TTFT_TERMS>,
    tpot: Rls<TPOT_TERMS>,
    observations: u64,
    recent_error: f64,
    /// Position in the owner's update order (for eviction).
    pub(crate) touched: u64,
}

/// What the model predicts for a request on one worker, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Time to the first token there.
    pub ttft: f64,
    /// Time per later token there.
    pub tpot: f64,
    /// Time this request's prefill adds, summed over the requests waiting
    /// there: its uncached tokens at the learned wait per pending token, once
    /// per waiting request.
    pub queued_delay: f64,
    /// Per-token time one more running request adds, summed over the
    /// requests running there.
    pub decode_slowdown: f64,
    /// Observations behind the prediction (0: the pool prior).
    pub observations: u64,
    /// Recent mean |error| / actual TTFT on that worker (0 with none).
    pub recent_error: f64,
}

impl Prediction {
    /// Predicted end-to-end time when the request gives `max_tokens`.
    pub fn e2e(&self, features: &Features) -> Option<f64> {
        features
            .max_tokens
            .map(|n| self.ttft + self.tpot * n.saturating_sub(1) as f64)
    }
}

impl WorkerModel {
    /// A model starting at these coefficients with `variance` on each.
    pub fn new(ttft: [f64; TTFT_TERMS], tpot: [f64; TPOT_TERMS], variance: f64) -> Self {
        WorkerModel {
            ttft: Rls::new(ttft, variance),
            tpot: Rls::new(tpot, variance),
            observations: 0,
            recent_error: 0.0,
            touched: 0,
        }
    }

    /// A fresh worker's model: `prior`'s coefficients, its own count and
    /// error from zero.
    pub fn from_prior(prior: &WorkerModel, variance: f64) -> Self {
        WorkerModel {
            ttft: prior.ttft.restart(variance),
            tpot: prior.tpot.restart(variance),
            observations: 0,
            recent_error: 0.0,
            touched: 0,
        }
    }

    /// Observations learned from.
    pub fn observations(&self) -> u64 {
        self.observations
    }

    /// Recent mean |error| / actual TTFT (0 before any observation).
    pub fn recent_error(&self) -> f64 {
        self.recent_error
    }

    /// TTFT coefficients: overhead s, s per uncached kilotoken, s per pending
    /// prefill kilotoken, s per waiting request, s per running request.
    pub fn ttft_coefficients(&self) -> &[f64; TTFT_TERMS] {
        self.ttft.coefficients()
    }

    /// Decode coefficients: base s/token, s/token per running request, per
    /// unit of KV usage, per prompt kilotoken.
    pub fn tpot_coefficients(&self) -> &[f64; TPOT_TERMS] {
        self.tpot.coefficients()
    }

    /// Predicts for `f`: two dot products and two multiplies.
    pub fn predict(&self, f: &Features) -> Prediction {
        let ttft_x = f.ttft_inputs();
        let tpot_x = f.tpot_inputs();
        let wait_per_token = self.ttft.coefficients()[TTFT_PENDING];
        Prediction {
            ttft: self.ttft.predict(&ttft_x),
            tpot: self.tpot.predict(&tpot_x),
            queued_delay: wait_per_token * ttft_x[TTFT_UNCACHED] * ttft_x[TTFT_WAITING],
            decode_slowdown: self.tpot.coefficients()[TPOT_RUNNING] * tpot_x[TPOT_RUNNING],
            observations: self.observations,
            recent_error: self.recent_error,
        }
    }

    /// Learns one checked observation with forgetting factor `lambda`.
    pub(crate) fn learn(&mut self, f: &Features, seen: &Observed, lambda: f64) {
        self.learn_ttft(f, seen.ttft.as_secs_f64(), lambda);
        if let Some(tpot) = seen.tpot {
            self.learn_tpot(f, tpot.as_secs_f64(), lambda);
        }
    }

    /// Learns one checked TTFT, `actual` seconds (an observation: the
    /// count and the recent error move).
    pub(crate) fn learn_ttft(&mut self, f: &Features, actual: f64, lambda: f64) {
        let x = f.ttft_inputs();
        let err = (self.ttft.predict(&x) - actual).abs() / actual;
        self.recent_error = if self.observations == 0 {
            err
        } else {
            self.recent_error + ERROR_EWMA * (err - self.recent_error)
        };
        self.ttft.update(&x, actual, lambda);
        self.observations = self.observations.saturating_add(1);
    }

    /// Learns one checked time per output token, `actual` seconds.
    pub(crate) fn learn_tpot(&mut self, f: &Features, actual: f64, lambda: f64) {
        self.tpot.update(&f.tpot_inputs(), actual, lambda);
    }

    /// The model for sharing between replicas.
    pub fn to_snapshot(&self) -> WorkerSnapshot {
        WorkerSnapshot {
            ttft: self.ttft.to_snapshot(),
            tpot: self.tpot.to_snapshot(),
            observations: self.observations,
            recent_error: self.recent_error,
        }
    }

    /// A model from a peer's snapshot, refused when malformed or absurd.
    pub fn from_snapshot(s: &WorkerSnapshot) -> Result<Self, Rejected> {
        let ttft = Rls::from_snapshot(&s.ttft).ok_or(Rejected::Malformed)?;
        let tpot = Rls::from_snapshot(&s.tpot).ok_or(Rejected::Malformed)?;
        if !(s.recent_error.is_finite() && (0.0..=MAX_SHARED_ERROR).contains(&s.recent_error))
            || s.observations > MAX_SHARED_OBSERVATIONS
        {
            return Err(Rejected::Malformed);
        }
        Ok(WorkerModel {
            ttft,
            tpot,
            observations: s.observations,
            recent_error: s.recent_error,
            touched: 0,
        })
    }
}

/// A worker's model as replicas exchange it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerSnapshot {
    /// The TTFT fit.
    pub ttft: RlsSnapshot,
    /// The decode fit.
    pub tpot: RlsSnapshot,
    /// Observations behind it.
    pub observations: u64,
    /// Recent mean |error| / actual TTFT.
    pub recent_error: f64,
}
