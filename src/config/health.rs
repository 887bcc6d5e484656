//! Passive health: ejecting endpoints whose responses fail.

use std::time::Duration;

use super::duration;

/// Passive health: ejecting endpoints whose responses fail.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthFlags {
    /// Passive health: consecutive failing responses (5xx, or Envoy's 503 when it
    /// cannot connect) that take an endpoint out of the candidate set.
    #[arg(long, env = "KVPICK_EJECT_AFTER_FAILURES", default_value_t = 3)]
    pub eject_after_failures: u32,

    /// Passive health: how long the first ejection lasts; each one in a row doubles it.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_EJECT_BASE_MS", default_value = "1000", value_parser = duration::millis)]
    pub eject_base_ms: Duration,

    /// Passive health: the longest ejection.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_EJECT_MAX_MS", default_value = "60000", value_parser = duration::millis)]
    pub eject_max_ms: Duration,
}

impl HealthFlags {
    /// The passive health settings these flags describe.
    pub fn config(&self) -> crate::health::HealthConfig {
        crate::health::HealthConfig {
            failures: self.eject_after_failures.max(1),
            base_ejection: self.eject_base_ms,
            max_ejection: self.eject_max_ms.max(self.eject_base_ms),
        }
    }
}
