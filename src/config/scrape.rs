//! Scraping the workers' `/metrics` for load.

use std::time::Duration;

use super::duration;

/// Scraping the workers' `/metrics` for load.
#[derive(Debug, Clone, clap::Args)]
pub struct ScrapeFlags {
    /// How often each endpoint's `/metrics` is scraped, in ms.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_SCRAPE_INTERVAL_MS", default_value = "50", value_parser = duration::millis)]
    pub scrape_interval_ms: Duration,

    /// Scraped load older than this (ms) is ignored.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_SCRAPE_STALENESS_MS", default_value = "2000", value_parser = duration::millis)]
    pub scrape_staleness_ms: Duration,

    /// Timeout of one scrape, in ms (a slow worker never delays the others).
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_SCRAPE_TIMEOUT_MS", default_value = "1000", value_parser = duration::millis)]
    pub scrape_timeout_ms: Duration,

    /// Most scrapes in flight at once.
    #[arg(long, env = "KVPICK_SCRAPE_CONCURRENCY", default_value_t = 64)]
    pub scrape_concurrency: usize,
}
