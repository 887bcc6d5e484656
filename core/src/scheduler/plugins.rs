//! The plugin list one scheduler runs: its filters (the built-in ones, then
//! configured ones), its cost terms in summing order, and its picker.

use std::sync::Arc;

use super::filters::{body::PrefillNeedsBody, ejected::Ejected, subset::Subset, Filter};
use super::pickers::{max_score::MaxScore, Choice, Picker};
use super::terms::predicted::Predicted;
use super::terms::Scorer;
use super::terms::{
    failures::FailedResponses, kv_usage::KvUsage, load::ActiveLoad, lora::LoraAffinity,
    prefix::PrefixCache, queue::Queue,
};
use super::Weights;
use crate::latency::Learner;

/// Filters, terms and picker of a scheduler.
#[derive(Debug, Clone)]
pub struct Plugins {
    /// Built-in filters first, then configured ones, in the order asked.
    pub filters: Vec<Arc<dyn Filter>>,
    /// Cost terms, in summing order.
    pub scorers: Vec<Arc<dyn Scorer>>,
    /// How the pick chooses among costs.
    pub picker: Arc<dyn Picker>,
}

impl Plugins {
    /// The filters every scheduler runs (the Inference Extension's contract).
    pub fn builtin_filters() -> Vec<Arc<dyn Filter>> {
        vec![
            Arc::new(Subset),
            Arc::new(PrefillNeedsBody),
            Arc::new(Ejected),
        ]
    }

    /// The terms every scheduler sums after its own: failed responses (passive
    /// health's cost, whatever the load weights).
    pub fn builtin_scorers() -> Vec<Arc<dyn Scorer>> {
        vec![Arc::new(FailedResponses::default())]
    }

    /// The default list: every weighted term at `weights` (in the order
    /// prefill, active load, queue, KV usage), LoRA affinity at its default
    /// weight (it costs nothing until workers export adapter state), the
    /// built-in terms, the max-score picker at `temperature`.
    pub fn from_weights(weights: Weights, temperature: f64) -> Self {
        let mut scorers: Vec<Arc<dyn Scorer>> = vec![
            Arc::new(PrefixCache {
                weight: weights.prefill,
                prefill_weight: weights.prefill_overlap,
            }),
            Arc::new(ActiveLoad {
                weight: weights.decode,
            }),
            Arc::new(Queue {
                weight: weights.queue,
            }),
            Arc::new(KvUsage {
                weight: weights.kv_usage,
            }),
            Arc::new(LoraAffinity {
                weight: super::terms::lora::DEFAULT_WEIGHT,
            }),
        ];
        scorers.extend(Self::builtin_scorers());
        Plugins {
            filters: Self::builtin_filters(),
            scorers,
            picker: Arc::new(MaxScore {
                temperature,
                max_endpoints: None,
            }),
        }
    }

    /// The list with its weighted terms wrapped in one [`Predicted`] term
    /// reading `learner` (the built-in terms still summed after it).
    pub fn predicted(mut self, learner: Arc<Learner>) -> Self {
        let builtin: Vec<&'static str> = Self::builtin_scorers().iter().map(|s| s.name()).collect();
        let (kept, fallback) = self
            .scorers
            .into_iter()
            .partition(|s| builtin.contains(&s.name()));
        let mut scorers: Vec<Arc<dyn Scorer>> = vec![Arc::new(Predicted { learner, fallback })];
        scorers.extend::<Vec<_>>(kept);
        self.scorers = scorers;
        self
    }

    /// How the picker chooses.
    pub fn choice(&self) -> Choice {
        self.picker.choice()
    }
}
