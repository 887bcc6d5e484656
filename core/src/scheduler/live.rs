//! The plugin list a scheduler runs now, swapped whole when its
//! `EndpointPickerConfig` changes.
//!
//! Invariants: a pick loads the list once and runs on that one to its end, so
//! it never mixes two lists; the per-term decision cost sums live beside the
//! scorers they are indexed by, so a swap never files one term's cost under
//! another's name. A swap carries each term's sum (by name) and the decision
//! count over, so the counters built on them never go down.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::plugins::Plugins;
use super::stats::CostSums;

/// One plugin list and the decision cost sums of its scorers.
#[derive(Debug)]
pub struct LivePlugins {
    /// The filters, terms and picker a pick runs.
    pub plugins: Plugins,
    /// The chosen decode ranks' cost, one sum per scorer of `plugins`.
    pub decision_cost: CostSums,
}

/// The scheduler's current [`LivePlugins`], replaced atomically.
#[derive(Debug)]
pub(super) struct Live(ArcSwap<LivePlugins>);

impl Live {
    /// `plugins` with zeroed sums.
    pub(super) fn new(plugins: Plugins) -> Self {
        let decision_cost = CostSums::new(plugins.scorers.len());
        Live(ArcSwap::from_pointee(LivePlugins {
            plugins,
            decision_cost,
        }))
    }

    /// The current list.
    pub(super) fn load(&self) -> Arc<LivePlugins> {
        self.0.load_full()
    }

    /// Makes `plugins` the list later picks run; picks under way finish on
    /// the old one. Sums of terms both lists have are carried over.
    pub(super) fn swap(&self, plugins: Plugins) {
        self.0.rcu(|old| {
            let names: Vec<&str> = plugins.scorers.iter().map(|s| s.name()).collect();
            let old_names: Vec<&str> = old.plugins.scorers.iter().map(|s| s.name()).collect();
            LivePlugins {
                decision_cost: old.decision_cost.carried_to(&old_names, &names),
                plugins: plugins.clone(),
            }
        });
    }
}
