//! A worker's sequence-slot capacity, learned from the scrape: the most
//! requests its engine runs at once (vLLM's `max_num_seqs`, SGLang's
//! `--max-running-requests`), which vLLM publishes in no metric.
//!
//! The capacity is the largest running count seen, once requests have been
//! seen waiting beside it [`CONFIRMATIONS`] times: an engine at its slot limit
//! shows the same running count with a queue again and again, while one with
//! slots to spare shows a queue only in passing (a request that arrived during
//! a step waits for the next), at whatever running count it had then.
//! Invariants: fixed size; the capacity is 0 (unknown) or a running count
//! that was the largest seen when confirmed; it never decreases.

use serde::{Deserialize, Serialize};

use super::features::MAX_REQUESTS;

/// Observations of a queue beside the largest running count that confirm it
/// as the capacity.
pub const CONFIRMATIONS: u32 = 8;

/// What the scrape showed of a worker's slot capacity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotCapacity {
    /// The confirmed capacity (0: none yet).
    confirmed: f64,
    /// The largest running count seen.
    top: f64,
    /// Observations with requests waiting beside `top` running ones.
    queued_at_top: u32,
}

impl SlotCapacity {
    /// The confirmed capacity, 0 while unknown.
    pub fn slots(&self) -> f64 {
        self.confirmed
    }

    /// Follows one scrape of `running` and `waiting` requests (checked
    /// figures: finite, non-negative).
    pub fn note(&mut self, running: f64, waiting: f64) {
        let running = running.min(MAX_REQUESTS);
        if running > self.top {
            self.top = running;
            self.queued_at_top = 0;
        }
        if running == self.top && waiting >= 1.0 {
            self.queued_at_top = self.queued_at_top.saturating_add(1);
            if self.queued_at_top >= CONFIRMATIONS {
                self.confirmed = self.confirmed.max(self.top);
            }
        }
    }

    /// Keeps the larger confirmed capacity of this and `other`.
    pub fn merge(&mut self, other: &SlotCapacity) {
        if other.confirmed > self.confirmed {
            self.confirmed = other.confirmed;
            if self.top < other.confirmed {
                self.top = other.confirmed;
                self.queued_at_top = CONFIRMATIONS;
            }
        }
    }

    /// A capacity as a peer states it: confirmed, with nothing else seen.
    /// `None` when it is not a count.
    pub fn shared(slots: f64) -> Option<SlotCapacity> {
        (slots.is_finite() && (0.0..=MAX_REQUESTS).contains(&slots)).then_some(SlotCapacity {
            confirmed: slots,
            top: slots,
            queued_at_top: if slots > 0.0 { CONFIRMATIONS } else { 0 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_seen_again_and_again_at_the_top_count_confirms_it() {
        let mut c = SlotCapacity::default();
        // A queue in passing at 30 running, then more running without one.
        c.note(30.0, 1.0);
        c.note(45.0, 0.0);
        for _ in 0..CONFIRMATIONS - 1 {
            c.note(45.0, 2.0);
        }
        assert_eq!(c.slots(), 0.0);
        c.note(45.0, 1.0);
        assert_eq!(c.slots(), 45.0);
        // Lower counts with a queue (a full KV pool) change nothing.
        c.note(20.0, 5.0);
        assert_eq!(c.slots(), 45.0);
        let mut other = SlotCapacity::default();
        other.merge(&c);
        assert_eq!(other.slots(), 45.0);
        assert_eq!(SlotCapacity::shared(f64::NAN), None);
        assert_eq!(SlotCapacity::shared(16.0).map(|c| c.slots()), Some(16.0));
    }
}
