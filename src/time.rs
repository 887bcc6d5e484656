//! Checked clock arithmetic: an instant plus a duration that would overflow the
//! clock's range saturates instead of panicking (client-supplied and configured
//! durations can be anything).

use std::time::{Duration, Instant, SystemTime};

/// `t + d`, or the latest instant reachable from `t` when that overflows.
pub fn saturating_add(t: Instant, d: Duration) -> Instant {
    let mut d = d;
    loop {
        if let Some(later) = t.checked_add(d) {
            return later;
        }
        d /= 2;
    }
}

/// `t + d` on the system clock, saturating like [`saturating_add`].
pub fn saturating_add_system(t: SystemTime, d: Duration) -> SystemTime {
    let mut d = d;
    loop {
        if let Some(later) = t.checked_add(d) {
            return later;
        }
        d /= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_durations_saturate_instead_of_panicking() {
        let now = Instant::now();
        assert_eq!(
            saturating_add(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        assert!(saturating_add(now, Duration::MAX) > now + Duration::from_secs(1 << 40));
        let sys = SystemTime::now();
        assert!(saturating_add_system(sys, Duration::MAX) > sys);
        assert_eq!(saturating_add_system(sys, Duration::ZERO), sys);
    }
}
