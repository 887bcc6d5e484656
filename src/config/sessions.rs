//! Session affinity: headers, signed tokens, the session table.

use std::path::PathBuf;
use std::time::Duration;

use super::duration;

/// Session affinity: headers, signed tokens, the session table.
#[derive(Debug, Clone, clap::Args)]
pub struct SessionFlags {
    /// Request header carrying a session id (for clients that cannot edit the body).
    #[arg(long, env = "KVPICK_SESSION_HEADER", default_value = "x-session-id")]
    pub session_header: String,

    /// Header carrying kvpick's signed session token (set on responses, read on requests).
    #[arg(
        long,
        env = "KVPICK_SESSION_TOKEN_HEADER",
        default_value = "x-kvpick-session"
    )]
    pub session_token_header: String,

    /// File holding the HMAC key that signs session tokens (mount a Secret); share
    /// it between replicas so they honour each other's tokens.
    #[arg(long, env = "KVPICK_SESSION_KEY_FILE")]
    pub session_key_file: Option<PathBuf>,

    /// The session token HMAC key itself (prefer --session-key-file). Without
    /// either, a random per-process key is used.
    #[arg(long, env = "KVPICK_SESSION_KEY", hide_env_values = true)]
    pub session_key: Option<String>,

    /// Most sessions held in the session table; past it the least recently used
    /// session is evicted (`kvpick_session_evictions_total`).
    #[arg(long, env = "KVPICK_SESSION_MAX_ENTRIES", default_value_t = 100_000)]
    pub session_max_entries: usize,

    /// Longest a signed session token stays valid after the turn that issued it,
    /// in seconds, whatever timeout the session asked for.
    /// A bare number counts seconds; `90s`, `15m`, `1h` also work.
    #[arg(
        long,
        env = "KVPICK_SESSION_TOKEN_MAX_LIFETIME_SECS",
        default_value = "3600", value_parser = duration::secs
    )]
    pub session_token_max_lifetime_secs: Duration,
}
