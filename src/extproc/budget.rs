//! The process-wide budget for buffered request-body bytes.
//!
//! Every stream that buffers a request body holds a [`Reservation`] that grows
//! with each chunk and is returned when the body is handed on (or the stream
//! ends). A chunk that does not fit is refused: that request gets a 429 and no
//! other stream is disturbed.
//!
//! The default budget ([`default_budget_bytes`]) is a quarter of the container's
//! memory limit (cgroup v2 `memory.max`, else cgroup v1
//! `memory.limit_in_bytes`), leaving the rest for the prefix index, sessions,
//! gRPC buffers and the copies a body makes on its way back to Envoy; without
//! a limit it is [`UNLIMITED_DEFAULT_BYTES`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Budget without a container memory limit: 1 GiB.
pub const UNLIMITED_DEFAULT_BYTES: usize = 1 << 30;

/// Share of the container memory limit given to buffered bodies (1/4).
pub const MEMORY_LIMIT_DIVISOR: usize = 4;

/// Bytes of buffered request bodies allowed across all streams.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        BodyBudget {
            used: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes reserved right now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty reservation.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.clone(),
            held: 0,
        }
    }
}

/// Bytes one stream holds against the budget; returned on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: BodyBudget,
    held: usize,
}

impl Reservation {
    /// Reserves `n` more bytes; false (and nothing reserved) if they do not fit.
    pub fn grow(&mut self, n: usize) -> bool {
        let limit = self.budget.limit;
        let ok = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= limit)
            })
            .is_ok();
        if ok {
            self.held += n;
        }
        ok
    }

    /// The budget it holds against.
    pub fn budget(&self) -> &BodyBudget {
        &self.budget
    }

    /// Bytes held.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Returns everything held.
    pub fn release(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

/// The container's memory limit in bytes, if it has one.
pub fn container_memory_limit() -> Option<usize> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let parse = |s: String| s.trim().parse::<u64>().ok();
    // cgroup v1 reports "no limit" as a huge page-rounded number.
    let v1_unlimited = |n: u64| n >= (1 << 62);
    read("/sys/fs/cgroup/memory.max")
        .and_then(parse)
        .or_else(|| {
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
                .and_then(parse)
                .filter(|n| !v1_unlimited(*n))
        })
        .and_then(|n| usize::try_from(n).ok())
}

/// The default budget: a quarter of the container memory limit, else 1 GiB.
pub fn default_budget_bytes() -> usize {
    container_memory_limit().map_or(UNLIMITED_DEFAULT_BYTES, |m| m / MEMORY_LIMIT_DIVISOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_the_limit_and_return_it_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.grow(60));
        assert!(!b.grow(41), "does not fit next to a");
        assert_eq!(b.held(), 0);
        assert!(b.grow(40));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        assert!(b.grow(60));
        b.release();
        assert_eq!(budget.used(), 0);
    }
}
