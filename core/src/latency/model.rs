//! One worker's latency model: a TTFT fit and a decode fit, both
//! [`Rls`] over physical terms, with its observation count, recent error and
//! learned sequence-slot capacity.
//!
//! The slot capacity ([`SlotCapacity`]) is what vLLM states in no metric
//! (its `max_num_seqs`); the model learns it from the scrape. Past it a new
//! request waits for a running one to finish, a wait no linear term of the
//! loads foresees (it is nothing one request below the capacity and a whole
//! decode's share at it); the TTFT fit prices it per request beyond the slots
//! ([`Features::slot_queue`]), so its coefficient learns the worker's
//! mean decode time over its slots.

use serde::{Deserialize, Serialize};

use super::features::{
    Features, Observed, Rejected, TPOT_RUNNING, TPOT_TERMS, TTFT_TERMS, TTFT_UNCACHED,
};
use super::rls::{Rls, RlsSnapshot};
use super::slots::SlotCapacity;

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
    /// The requests the worker runs at once, as the scrape showed them.
    slots: SlotCapacity,
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
    /// Time this request's prefill adds to the others' first tokens there:
    /// its uncached tokens at the pool's learned prefill rate, once per
    /// request it stalls ([`WorkerModel::stalled`]).
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
            slots: SlotCapacity::default(),
            touched: 0,
        }
    }

    /// A fresh worker's model: `prior`'s coefficients; its own count, error
    /// and slot capacity from zero (a pool may mix engine configurations).
    pub fn from_prior(prior: &WorkerModel, variance: f64) -> Self {
        WorkerModel {
            ttft: prior.ttft.restart(variance),
            tpot: prior.tpot.restart(variance),
            observations: 0,
            recent_error: 0.0,
            slots: SlotCapacity::default(),
            touched: 0,
        }
    }

    /// The learned sequence-slot capacity (0: not known yet).
    pub fn slots(&self) -> f64 {
        self.slots.slots()
    }

    /// Keeps the larger of this model's slot capacity and `other`'s (a
    /// peer's snapshot replacing a local model keeps what the local one saw).
    pub(crate) fn keep_slots(&mut self, other: Option<&WorkerModel>) {
        if let Some(o) = other {
            self.slots.merge(&o.slots);
        }
    }

    /// Follows `f`'s scrape in the slot capacity.
    fn note_slots(&mut self, f: &Features) {
        self.slots.note(f.running, f.waiting);
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
    /// prefill kilotoken, s per waiting request, s per running request, s per
    /// request beyond the slots.
    pub fn ttft_coefficients(&self) -> &[f64; TTFT_TERMS] {
        self.ttft.coefficients()
    }

    /// Decode coefficients: base s/token, s/token per running request, per
    /// unit of KV usage, per prompt kilotoken.
    pub fn tpot_coefficients(&self) -> &[f64; TPOT_TERMS] {
        self.tpot.coefficients()
    }

    /// Predicts for `f`, its prefill's delay on the others priced at this
    /// model's own prefill rate and slot capacity.
    pub fn predict(&self, f: &Features) -> Prediction {
        self.predict_with(f, self.prefill_rate(), self.slots())
    }

    /// The requests there a prefill there delays, in expectation, on a
    /// worker that runs at most `slots` at once: those that run beside it in
    /// the engine's steps (a step that carries a prefill chunk holds every
    /// decode in it), so at most the slots: a request queued beyond them is
    /// admitted after the ones ahead of it leave, whatever this prefill
    /// costs. They count by the squared share of the slots taken once this
    /// request is in (a quarter at half of them, all at a full worker), as
    /// the stall reaches the first tokens of the requests waiting for a slot
    /// only as the slots run out. Nothing while no capacity is known.
    pub fn stalled(f: &Features, slots: f64) -> f64 {
        if slots < 1.0 {
            return 0.0;
        }
        let there = f.occupancy();
        there.min(slots) * ((there + 1.0) / slots).min(1.0).powi(2)
    }

    /// Seconds per uncached kilotoken of prefill.
    pub fn prefill_rate(&self) -> f64 {
        self.ttft.coefficients()[TTFT_UNCACHED]
    }

    /// Predicts for `f`, its prefill's delay on the others priced at
    /// `prefill_rate` seconds per uncached kilotoken, counted over the
    /// requests it stalls ([`WorkerModel::stalled`]) at this worker's slot
    /// capacity or, while that is not known, at `pool_slots` (a worker not
    /// yet seen at its limit would otherwise price a prefill there as
    /// delaying nobody, beside peers that price it): two dot products and a
    /// few multiplies.
    pub fn predict_with(&self, f: &Features, prefill_rate: f64, pool_slots: f64) -> Prediction {
        let slots = self.slots();
        let ttft_x = f.ttft_inputs(slots);
        let tpot_x = f.tpot_inputs();
        let stall_slots = if slots >= 1.0 { slots } else { pool_slots };
        Prediction {
            ttft: self.ttft.predict(&ttft_x),
            tpot: self.tpot.predict(&tpot_x),
            queued_delay: prefill_rate
                * ttft_x[TTFT_UNCACHED]
                * WorkerModel::stalled(f, stall_slots),
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
        self.note_slots(f);
        let x = f.ttft_inputs(self.slots());
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
            slots: self.slots(),
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
        let slots = SlotCapacity::shared(s.slots).ok_or(Rejected::Malformed)?;
        Ok(WorkerModel {
            ttft,
            tpot,
            observations: s.observations,
            recent_error: s.recent_error,
            slots,
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
    /// The learned sequence-slot capacity (0: none yet).
    #[serde(default)]
    pub slots: f64,
}
