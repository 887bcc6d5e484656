//! Request bodies on the ext_proc stream: sizes, waits, budgets, test hooks.

use std::time::Duration;

use super::duration;
use crate::extproc::ExtProcConfig;

/// Request bodies on the ext_proc stream: sizes, waits, budgets, test hooks.
#[derive(Debug, Clone, clap::Args)]
pub struct RequestFlags {
    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, env = "KVPICK_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,

    /// Without Envoy's protocol_config, how long (ms) to hold request headers
    /// waiting for a body before assuming a buffered body mode.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_BODY_WAIT_MS", default_value = "200", value_parser = duration::millis)]
    pub body_wait_ms: Duration,

    /// Bytes of request bodies all streams together may buffer; a body that does
    /// not fit gets a 429. Default: a quarter of the container memory limit
    /// (cgroup `memory.max`), 1 GiB without one.
    #[arg(long, env = "KVPICK_BODY_BUDGET_BYTES")]
    pub body_budget_bytes: Option<usize>,

    /// How long (ms) after the request headers the body must be complete; a body
    /// still arriving then gets a 408.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_BODY_DEADLINE_MS", default_value = "60000", value_parser = duration::millis)]
    pub body_deadline_ms: Duration,

    /// GIE conformance-test hooks, as GIE's reference picker has them: the
    /// `test-epp-endpoint-selection` request header (comma-separated pod IPs or
    /// `ip:port`s) restricts the candidates, and responses carry the gateway's
    /// served endpoint in `x-conformance-test-served-endpoint`. Test only: any
    /// client could steer its own requests.
    #[arg(long, env = "KVPICK_CONFORMANCE_TEST_HOOKS")]
    pub conformance_test_hooks: bool,
}

impl RequestFlags {
    /// The ext_proc handler settings these flags describe; the session
    /// header names come from [`SessionFlags`](super::sessions::SessionFlags).
    pub fn ext_proc(&self, sessions: &super::sessions::SessionFlags) -> ExtProcConfig {
        ExtProcConfig {
            max_body_bytes: self.max_body_bytes,
            body_wait: self.body_wait_ms,
            body_budget_bytes: self
                .body_budget_bytes
                .unwrap_or_else(crate::extproc::budget::default_budget_bytes),
            body_deadline: self.body_deadline_ms.max(Duration::from_millis(1)),
            session_header: sessions.session_header.to_ascii_lowercase(),
            session_token_header: sessions.session_token_header.to_ascii_lowercase(),
            conformance_test_hooks: self.conformance_test_hooks,
        }
    }
}
