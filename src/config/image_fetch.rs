//! Fetching remote images to identify them by content.

use std::time::Duration;

use clap::ArgAction;

use super::duration;
use crate::multimodal::fetch::FetchPolicy;
use crate::multimodal::remote::FetchLimits;

/// Fetching remote images to identify them by content.
#[derive(Debug, Clone, clap::Args)]
pub struct ImageFetchFlags {
    /// Fetch remote (`https`) images to identify them by content and size them
    /// from their header, as `data:` URLs are (exact mode only: needs
    /// `--tokenizer-dir` and `--mm-model-family`). Off: remote images keep their
    /// URL identity. A failed fetch keeps it too, and is counted.
    #[arg(long, env = "KVPICK_MM_FETCH", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch: bool,

    /// The longest one image fetch may take, in milliseconds.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_MM_FETCH_TIMEOUT_MS", default_value = "500", value_parser = duration::millis)]
    pub mm_fetch_timeout_ms: Duration,

    /// The largest image fetched, in bytes.
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_BYTES", default_value_t = 8 << 20)]
    pub mm_fetch_max_bytes: usize,

    /// Image fetches running at once.
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_CONCURRENT", default_value_t = 16)]
    pub mm_fetch_max_concurrent: usize,

    /// Distinct image URLs fetched per request (the rest keep URL identities).
    #[arg(long, env = "KVPICK_MM_FETCH_MAX_PER_REQUEST", default_value_t = 8)]
    pub mm_fetch_max_per_request: usize,

    /// Fetched image identities kept (URL -> hash and size, never the bytes).
    #[arg(long, env = "KVPICK_MM_FETCH_CACHE_ENTRIES", default_value_t = 1024)]
    pub mm_fetch_cache_entries: usize,

    /// How long a fetched identity is reused, in seconds.
    /// A bare number counts seconds; `90s`, `15m`, `1h` also work.
    #[arg(long, env = "KVPICK_MM_FETCH_CACHE_TTL_SECS", default_value = "600", value_parser = duration::secs)]
    pub mm_fetch_cache_ttl_secs: Duration,

    /// A host images may be fetched from (repeatable; exact names). None: any
    /// host with only public addresses.
    #[arg(
        long = "mm-fetch-allow-host",
        env = "KVPICK_MM_FETCH_ALLOW_HOSTS",
        value_delimiter = ','
    )]
    pub mm_fetch_allow_hosts: Vec<String>,

    /// Also fetch plain `http` image URLs (off: `https` only).
    #[arg(long, env = "KVPICK_MM_FETCH_ALLOW_HTTP", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch_allow_http: bool,

    /// Also fetch from loopback, private and link-local addresses (off: a URL
    /// whose host resolves to any such address is refused). For tests and
    /// trusted in-cluster image servers only.
    #[arg(long, env = "KVPICK_MM_FETCH_ALLOW_PRIVATE", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub mm_fetch_allow_private: bool,
}

impl ImageFetchFlags {
    /// Remote image fetching as the `--mm-fetch*` flags set it, or `None` when off.
    pub fn config(&self) -> Option<(FetchPolicy, FetchLimits)> {
        self.mm_fetch.then(|| {
            let policy = FetchPolicy {
                allow_http: self.mm_fetch_allow_http,
                allow_private: self.mm_fetch_allow_private,
                allow_hosts: self
                    .mm_fetch_allow_hosts
                    .iter()
                    .map(|h| h.trim().to_ascii_lowercase())
                    .filter(|h| !h.is_empty())
                    .collect(),
                max_bytes: self.mm_fetch_max_bytes,
            };
            let limits = FetchLimits {
                timeout: self.mm_fetch_timeout_ms,
                max_concurrent: self.mm_fetch_max_concurrent,
                max_per_request: self.mm_fetch_max_per_request,
                cache_entries: self.mm_fetch_cache_entries,
                cache_ttl: self.mm_fetch_cache_ttl_secs,
            };
            (policy, limits)
        })
    }
}
