//! Scraping the workers: the core's page parsers ([`kvpick_core::scrape`],
//! re-exported here) fed by a poll loop over every endpoint's `/metrics`
//! ([`poll`]), whose failures are exposed by [`metrics`].

pub use kvpick_core::scrape::*;

pub mod metrics;
pub mod poll;

pub use metrics::ScrapeMetrics;
pub use poll::{fetch, http_client, run, scrape_one, HttpClient, ScrapeConfig};
