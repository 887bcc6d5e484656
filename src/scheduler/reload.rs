//! Live `EndpointPickerConfig`: the `--config-file` is polled while kvpick
//! serves, and a changed one replaces the scheduler's plugin list.
//!
//! Invariants: the file is re-read when its modification time or length
//! changes, and mapped when its content hash did; a valid text is mapped onto the same command-line weights
//! and `--temperature` as at start (so flags keep their precedence) and
//! swapped in whole ([`Scheduler::set_plugins`]): picks under way finish on
//! the old list, no stream or request is dropped. An invalid text (or an
//! unreadable file) keeps the list in force, is logged with its error chain
//! and counted; the same text is not retried until it changes again.
//! `kvpick_config_reloads_total{result="applied|invalid"}` counts both.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tracing::{info, warn};

use crate::endpoint_picker_config::{self, EndpointPickerConfigError};
use crate::error_chain::ErrorChain;
use crate::scheduler::{Scheduler, TermWeights};
use crate::telemetry::Metrics;

/// How often the file is looked at.
pub const RELOAD_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// What became of a changed config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum Outcome {
    /// Mapped and swapped in.
    applied,
    /// Refused: the old list stays.
    invalid,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    result: Outcome,
}

/// `kvpick_config_reloads_total`, by result.
#[derive(Debug, Clone, Default)]
pub struct ReloadMetrics {
    reloads: Family<OutcomeLabels, Counter>,
}

impl ReloadMetrics {
    /// Creates the counter and registers it with `metrics`.
    pub fn register(metrics: &Metrics) -> ReloadMetrics {
        let m = ReloadMetrics::default();
        metrics.register(|r| {
            r.register(
                "kvpick_config_reloads",
                "Changes of the EndpointPickerConfig file seen while serving, by result (applied, or invalid and ignored)",
                m.reloads.clone(),
            )
        });
        m
    }

    fn count(&self, result: Outcome) {
        self.reloads.get_or_create(&OutcomeLabels { result }).inc();
    }
}

/// The file the scheduler's plugins come from, and what its text is mapped onto.
#[derive(Debug, Clone)]
pub struct ConfigSource {
    /// `--config-file`.
    pub path: PathBuf,
    /// The weights the command line gives (the `--weight-*` flags).
    pub weights: TermWeights,
    /// `--temperature`.
    pub temperature: f64,
}

/// A version of the file: its modification time and length (looked at every
/// poll), and its content hash (read when either of them changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    modified: Option<SystemTime>,
    len: u64,
    hash: u64,
}

/// Polls `source` every `every` until dropped, swapping each valid change
/// into `scheduler`. The text read at start counts as seen.
pub async fn watch(
    source: ConfigSource,
    scheduler: Arc<Scheduler>,
    metrics: ReloadMetrics,
    every: Duration,
) {
    let mut seen = read(&source, None).await.ok().flatten().map(|(s, _)| s);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (now, text) = match read(&source, seen).await {
            Ok(Some(read)) => read,
            // Unchanged.
            Ok(None) => continue,
            Err(e) => {
                // A missing file is noted once, not per poll.
                if seen.take().is_some() {
                    metrics.count(Outcome::invalid);
                    warn!(error = %ErrorChain(&e), "EndpointPickerConfig not reloaded; the config in force stays");
                }
                continue;
            }
        };
        let changed = seen.is_none_or(|s| s.hash != now.hash);
        seen = Some(now);
        if !changed {
            continue;
        }
        match endpoint_picker_config::map(&text, &source.weights, source.temperature) {
            Ok(mapping) => {
                scheduler.set_plugins(mapping.plugins);
                metrics.count(Outcome::applied);
                for warning in &mapping.warnings {
                    warn!("{warning}");
                }
                info!(path = %source.path.display(), scorers = ?mapping.mapped, weights = %mapping.weights, "EndpointPickerConfig reloaded");
            }
            Err(e) => {
                metrics.count(Outcome::invalid);
                warn!(path = %source.path.display(), error = %ErrorChain(&e), "EndpointPickerConfig not reloaded; the config in force stays");
            }
        }
    }
}

/// The file's version and text, unless its modification time and length
/// are those of `last` (then `None`: not read).
async fn read(
    source: &ConfigSource,
    last: Option<Seen>,
) -> Result<Option<(Seen, String)>, EndpointPickerConfigError> {
    let io = |e| EndpointPickerConfigError::Read {
        path: source.path.clone(),
        source: e,
    };
    let meta = tokio::fs::metadata(&source.path).await.map_err(io)?;
    let (modified, len) = (meta.modified().ok(), meta.len());
    if last.is_some_and(|l| (l.modified, l.len) == (modified, len) && modified.is_some()) {
        return Ok(None);
    }
    let text = tokio::fs::read_to_string(&source.path).await.map_err(io)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    let seen = Seen {
        modified,
        len,
        hash: h.finish(),
    };
    Ok(Some((seen, text)))
}
