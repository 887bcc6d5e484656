//! Checked clock arithmetic: an instant plus a duration that would overflow the
//! clock's range saturates instead of panicking (client-supplied and configured
//! durations can be anything).

use std::sync::OnceLock;
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

/// Instants as signed nanoseconds from an origin, so they fit an atomic. The code
/// is monotone (a later instant never codes smaller), saturates at the ends, and
/// [`Epoch::NONE`] stands for no instant.
#[derive(Debug, Clone, Copy)]
pub struct Epoch {
    origin: Instant,
}

impl Epoch {
    /// The code of no instant (below every instant's code).
    pub const NONE: i64 = i64::MIN;

    /// The process-wide epoch. Every cell codes its instants with it, so codes
    /// compare across cells: a decision codes its instant once and compares
    /// integers per endpoint instead of doing clock arithmetic per endpoint.
    pub fn process() -> Epoch {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        Epoch {
            origin: *ORIGIN.get_or_init(Instant::now),
        }
    }

    /// A code `d` after `code` (saturating).
    pub fn after(code: i64, d: Duration) -> i64 {
        code.saturating_add(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }

    /// The code of `t`.
    pub fn encode(&self, t: Instant) -> i64 {
        let nanos = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
        match t.checked_duration_since(self.origin) {
            Some(after) => nanos(after),
            None => nanos(self.origin - t).saturating_neg().max(Self::NONE + 1),
        }
    }

    /// The code of `t`, or [`Epoch::NONE`].
    pub fn encode_opt(&self, t: Option<Instant>) -> i64 {
        t.map_or(Self::NONE, |t| self.encode(t))
    }

    /// The instant a code stands for.
    pub fn decode(&self, code: i64) -> Option<Instant> {
        match code {
            Self::NONE => None,
            c if c >= 0 => Some(saturating_add(self.origin, Duration::from_nanos(c as u64))),
            c => Some(
                self.origin
                    .checked_sub(Duration::from_nanos(c.unsigned_abs()))
                    .unwrap_or(self.origin),
            ),
        }
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

    #[test]
    fn epoch_codes_round_trip_either_side_of_the_origin_and_keep_order() {
        let before = Instant::now() - Duration::from_secs(1);
        let epoch = Epoch::process();
        let after = Instant::now() + Duration::from_secs(3);
        for t in [before, after] {
            assert_eq!(epoch.decode(epoch.encode(t)), Some(t));
        }
        assert!(epoch.encode(before) < epoch.encode(after));
        assert_eq!(epoch.decode(epoch.encode_opt(None)), None);
        assert!(Epoch::NONE < epoch.encode(before));
        let d = Duration::from_millis(1500);
        assert_eq!(
            Epoch::after(epoch.encode(before), d),
            epoch.encode(before + d)
        );
        assert_eq!(Epoch::after(i64::MAX - 1, d), i64::MAX);
    }
}
