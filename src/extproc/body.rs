//! The request body one stream buffers until it is complete.
//!
//! Invariants: a buffer never holds more than its cap, and every byte it holds
//! is reserved against the process-wide budget ([`super::budget`]) until the
//! answer carrying the body releases it, or the buffer is dropped.

use super::budget::{BodyBudget, Reservation};

/// Why a chunk was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Overflow {
    /// The body would exceed the cap (413).
    #[error("request body exceeds the {cap} byte limit")]
    TooLarge {
        /// The cap in bytes.
        cap: usize,
    },
    /// The chunk does not fit in the process-wide budget (429).
    #[error(
        "kvpick is buffering {used} of its {limit} byte request-body budget; this body does not fit, retry later"
    )]
    OverBudget {
        /// Bytes the budget holds now.
        used: usize,
        /// The budget in bytes.
        limit: usize,
    },
}

/// A request body on its way in, bounded by a cap and the shared budget.
#[derive(Debug)]
pub struct RequestBuffer {
    bytes: Vec<u8>,
    reservation: Reservation,
    cap: usize,
}

impl RequestBuffer {
    /// An empty buffer of at most `cap` bytes, reserving against `budget`.
    pub fn new(budget: &BodyBudget, cap: usize) -> Self {
        RequestBuffer {
            bytes: Vec::new(),
            reservation: budget.reservation(),
            cap,
        }
    }

    /// Bytes buffered.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Appends `chunk`, or refuses it (nothing appended). The first chunk
    /// allocates the `announced` size (`content-length`) at once when it is
    /// within the cap, instead of growing by doubling.
    pub fn push(&mut self, chunk: &[u8], announced: Option<usize>) -> Result<(), Overflow> {
        if self.bytes.len() + chunk.len() > self.cap {
            return Err(Overflow::TooLarge { cap: self.cap });
        }
        if !self.reservation.grow(chunk.len()) {
            let budget = self.reservation.budget();
            let (used, limit) = (budget.used(), budget.limit());
            return Err(Overflow::OverBudget { used, limit });
        }
        if self.bytes.is_empty() {
            if let Some(n) = announced.filter(|n| *n <= self.cap) {
                self.bytes.reserve_exact(n);
            }
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    /// The complete body; it stays reserved until [`RequestBuffer::release`].
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.bytes)
    }

    /// Returns the reservation: the body left with an answer, or was refused.
    pub fn release(&mut self) {
        self.bytes = Vec::new();
        self.reservation.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_over_the_cap_or_the_budget_is_refused_whole() {
        let budget = BodyBudget::new(10);
        let mut buffer = RequestBuffer::new(&budget, 8);
        buffer.push(b"12345", Some(100)).unwrap();
        assert_eq!(
            buffer.push(b"6789", None),
            Err(Overflow::TooLarge { cap: 8 })
        );
        let mut other = RequestBuffer::new(&budget, 8);
        assert_eq!(
            other.push(b"123456", None),
            Err(Overflow::OverBudget { used: 5, limit: 10 })
        );
        assert_eq!((buffer.len(), other.len(), budget.used()), (5, 0, 5));
        assert_eq!(buffer.take(), b"12345");
        assert_eq!(budget.used(), 5, "held until the answer releases it");
        buffer.release();
        assert_eq!(budget.used(), 0);
    }
}
