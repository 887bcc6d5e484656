//! Passive health: what the responses of routed requests say about an endpoint.
//!
//! The ext_proc response path reports each response's HTTP status
//! ([`PassiveHealth::record`]). A 5xx counts as a failure: an upstream error, and
//! also Envoy's own local reply when it cannot connect to the pod (a 503 that comes
//! back through the ext_proc filter's response path like an upstream response;
//! such replies carry no `x-envoy-upstream-service-time`, but either way the pod
//! did not serve the request). Anything below 500 is a success and clears the
//! record.
//!
//! After `failures` consecutive failures the endpoint is ejected: the scheduler
//! leaves it out of the candidate set until the ejection ends. Each ejection in a
//! row lasts twice as long as the one before (from `base_ejection` up to
//! `max_ejection`); when one ends the endpoint is back on probation, and its next
//! failure ejects it again at once. While it keeps a failure record (ejected or
//! not) each recent failure also counts in its cost (the scheduler's `failures`
//! term), so failed requests, which release their load immediately, never make
//! it look idle.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::time::Epoch;

/// Passive health settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failures that eject an endpoint (at least 1).
    pub failures: u32,
    /// How long the first ejection lasts.
    pub base_ejection: Duration,
    /// The longest an ejection lasts, however long the endpoint keeps failing.
    pub max_ejection: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            failures: 3,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(60),
        }
    }
}

impl HealthConfig {
    /// How long the `n`th ejection in a row lasts (n ≥ 1): doubling from the base, capped.
    pub fn ejection(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
        self.base_ejection
            .checked_mul(factor)
            .unwrap_or(Duration::MAX)
            .min(self.max_ejection)
    }
}

/// What one response said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The pod answered below 500.
    Success,
    /// The pod answered 5xx, or Envoy could not reach it (local 5xx reply).
    Failure,
}

impl Outcome {
    /// The outcome of a response with HTTP status `status`.
    pub fn of_status(status: u16) -> Outcome {
        if (500..600).contains(&status) {
            Outcome::Failure
        } else {
            Outcome::Success
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Record {
    /// Failures since the last success.
    consecutive: u32,
    /// Ejections since the last success.
    ejections: u32,
    /// End of the current (or last) ejection.
    ejected_until: Option<Instant>,
}

/// The passive health record of one endpoint. Responses update it under a lock;
/// every pick reads it lock-free (two atomics).
#[derive(Debug)]
#[repr(C)]
pub struct PassiveHealth {
    /// End of the current (or last) ejection, coded by [`Epoch::process`].
    ejected_until: AtomicI64,
    /// `record.consecutive`, for readers.
    failures: AtomicU32,
    /// Read by the response path only: after what every pick reads.
    record: Mutex<Record>,
}

impl Default for PassiveHealth {
    fn default() -> Self {
        PassiveHealth {
            record: Mutex::default(),
            failures: AtomicU32::new(0),
            ejected_until: AtomicI64::new(Epoch::NONE),
        }
    }
}

impl PassiveHealth {
    /// Records one response's outcome at `now`. Returns true when this failure
    /// ejected the endpoint.
    pub fn record(&self, outcome: Outcome, now: Instant, config: &HealthConfig) -> bool {
        let mut r = self.record.lock();
        let ejected = match outcome {
            Outcome::Success => {
                *r = Record::default();
                false
            }
            Outcome::Failure => {
                r.consecutive = r.consecutive.saturating_add(1);
                let ejected = r.ejected_until.is_some_and(|t| now < t);
                // On probation after an ejection, one more failure is enough.
                let due = r.consecutive >= config.failures.max(1) || r.ejections > 0;
                if !ejected && due {
                    r.ejections = r.ejections.saturating_add(1);
                    r.ejected_until = Some(crate::time::saturating_add(
                        now,
                        config.ejection(r.ejections),
                    ));
                    true
                } else {
                    false
                }
            }
        };
        self.failures.store(r.consecutive, Ordering::Relaxed);
        self.ejected_until.store(
            Epoch::process().encode_opt(r.ejected_until),
            Ordering::Relaxed,
        );
        ejected
    }

    /// Whether the endpoint may take requests at `now` (not ejected).
    pub fn available(&self, now: Instant) -> bool {
        self.available_at(Epoch::process().encode(now))
    }

    /// [`PassiveHealth::available`] at an instant coded by [`Epoch::process`].
    pub fn available_at(&self, now: i64) -> bool {
        now >= self.ejected_until.load(Ordering::Relaxed)
    }

    /// Failures since the last success (counted as load by the scheduler).
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: HealthConfig = HealthConfig {
        failures: 2,
        base_ejection: Duration::from_secs(1),
        max_ejection: Duration::from_secs(5),
    };

    #[test]
    fn five_hundreds_and_local_replies_fail_the_rest_succeed() {
        assert_eq!(Outcome::of_status(503), Outcome::Failure);
        assert_eq!(Outcome::of_status(500), Outcome::Failure);
        assert_eq!(Outcome::of_status(200), Outcome::Success);
        assert_eq!(Outcome::of_status(429), Outcome::Success);
        assert_eq!(Outcome::of_status(404), Outcome::Success);
    }

    #[test]
    fn ejection_backoff_doubles_while_failing_and_a_success_clears_it() {
        let h = PassiveHealth::default();
        let t0 = Instant::now();
        assert!(!h.record(Outcome::Failure, t0, &CFG));
        assert!(h.available(t0));
        assert!(h.record(Outcome::Failure, t0, &CFG));
        assert!(!h.available(t0));
        assert!(!h.available(t0 + Duration::from_millis(999)));
        // Failures while ejected (requests already in flight) do not extend it.
        assert!(!h.record(Outcome::Failure, t0, &CFG));
        let t1 = t0 + Duration::from_secs(1);
        assert!(h.available(t1));
        // On probation: one failure ejects again, for twice as long.
        assert!(h.record(Outcome::Failure, t1, &CFG));
        assert!(!h.available(t1 + Duration::from_millis(1999)));
        let t2 = t1 + Duration::from_secs(2);
        assert!(h.available(t2));
        assert!(h.record(Outcome::Failure, t2, &CFG));
        let t3 = t2 + Duration::from_secs(4);
        assert!(h.record(Outcome::Failure, t3, &CFG));
        // Capped at max_ejection.
        assert!(h.available(t3 + Duration::from_secs(5)));
        assert_eq!(h.failures(), 6);
        h.record(Outcome::Success, t3, &CFG);
        assert!(h.available(t3));
        assert_eq!(h.failures(), 0);
        assert!(!h.record(Outcome::Failure, t3, &CFG));
    }

    #[test]
    fn ejection_lengths_never_overflow() {
        let huge = HealthConfig {
            failures: 1,
            base_ejection: Duration::MAX,
            max_ejection: Duration::MAX,
        };
        assert_eq!(CFG.ejection(1), Duration::from_secs(1));
        assert_eq!(CFG.ejection(3), Duration::from_secs(4));
        assert_eq!(CFG.ejection(200), Duration::from_secs(5));
        assert_eq!(huge.ejection(40), Duration::MAX);
        let h = PassiveHealth::default();
        let now = Instant::now();
        // `now + Duration::MAX` overflows: still ejected, no panic.
        assert!(h.record(Outcome::Failure, now, &huge));
        assert!(!h.available(now + Duration::from_secs(3600)));
    }
}
