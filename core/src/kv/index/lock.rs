//! The index lock's manners: writers and lookups spin briefly before yielding,
//! and a writer hands the lock to waiting readers when it lets go.

use std::time::{Duration, Instant};

use parking_lot::RwLockWriteGuard;

use super::state::Inner;

/// How long a writer or a lookup spins for the lock before yielding the core
/// between polls: a writer holds it for one chunk and a lookup or a plan for
/// one walk, microseconds all, while a thread descheduled holding it is away
/// for milliseconds.
pub(super) const SPIN: Duration = Duration::from_micros(50);

/// How long a writer waits for a lookup spinning for the lock to take it: a
/// running lookup takes it within nanoseconds of the writer's last chunk.
pub(super) const YIELD: Duration = Duration::from_micros(5);

/// Polls `f` until it yields or `limit` has passed.
pub(super) fn spin_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    if let Some(t) = f() {
        return Some(t);
    }
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if let Some(t) = f() {
                return Some(t);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= limit {
            return None;
        }
    }
}

/// A write guard that hands the lock to waiting readers when dropped (parking_lot
/// otherwise lets a writer that releases and re-locks at once barge ahead of
/// them).
pub(super) struct FairWrite<'a>(pub(super) Option<RwLockWriteGuard<'a, Inner>>);

impl std::ops::Deref for FairWrite<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for FairWrite<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.0.as_mut().expect("held until drop")
    }
}

impl Drop for FairWrite<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            RwLockWriteGuard::unlock_fair(g);
        }
    }
}
