//! Sharing routing state between kvpick replicas.

use std::time::Duration;

use super::duration;
use crate::replica_sync::resp::RespError;
use crate::replica_sync::SyncConfig;

/// Sharing routing state between kvpick replicas.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaSyncFlags {
    /// Share routing state with the pool's other kvpick replicas through this
    /// Redis/Valkey server (`redis://[:password@]host[:port][/db]`; see
    /// docs/replicas.md): replicas on one server with the same pool name
    /// (`--pool-name`; `standalone` with `--endpoints-file` and no name) are
    /// one pool. Unset: a single replica, nothing shared.
    #[arg(long, env = "KVPICK_REPLICA_SYNC")]
    pub replica_sync: Option<String>,

    /// Longest a replica's warm start (loading the shared state) holds
    /// readiness back; past it the replica is Ready on its local state.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(
        long,
        env = "KVPICK_REPLICA_SYNC_WARM_START_MS",
        default_value = "10000", value_parser = duration::millis
    )]
    pub replica_sync_warm_start_ms: Duration,

    /// Silence after which a peer replica's bookings are released.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_REPLICA_SYNC_LEASE_MS", default_value = "5000", value_parser = duration::millis)]
    pub replica_sync_lease_ms: Duration,
}

impl ReplicaSyncFlags {
    /// Replica sync settings, when `--replica-sync` is set; the stream is
    /// keyed by `pool`.
    pub fn config(&self, pool: &str) -> Result<Option<SyncConfig>, RespError> {
        let Some(url) = &self.replica_sync else {
            return Ok(None);
        };
        let mut c = SyncConfig::new(url, pool)?;
        c.warm_start_timeout = self.replica_sync_warm_start_ms;
        c.lease = self.replica_sync_lease_ms.max(Duration::from_millis(1));
        Ok(Some(c))
    }
}
