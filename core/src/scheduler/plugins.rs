//! The plugin list one scheduler runs: its filters (the built-in ones, then
//! configured ones), its cost terms in summing order, and its picker. Every
//! plugin is built from its declaration ([`super::registry`]), with the
//! weights of [`TermWeights`] or those an `EndpointPickerConfig` maps.

use std::sync::Arc;

use super::filters::Filter;
use super::pickers::{Choice, Picker, PickerDecl};
use super::plugin::{PluginArgs, PluginError};
use super::registry;
use super::terms::predicted::Predicted;
use super::terms::{Scorer, TermDecl};
use super::weights::{TermWeight, TermWeights};
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

/// The default list at the declared default weights.
impl Default for Plugins {
    fn default() -> Self {
        Self::with_weights(&TermWeights::default(), 0.0)
    }
}

impl Plugins {
    /// The filters every scheduler runs (the Inference Extension's contract).
    pub fn builtin_filters() -> Vec<Arc<dyn Filter>> {
        registry::filters()
            .filter(|f| f.builtin())
            .map(|f| unconfigured((f.build)(&mut Unconfigured::default().args())))
            .collect()
    }

    /// The terms every scheduler sums after its own (failed responses:
    /// passive health's cost, whatever the load weights), at `weights`.
    pub fn builtin_scorers(weights: &TermWeights) -> Vec<Arc<dyn Scorer>> {
        registry::terms()
            .filter(|t| t.builtin())
            .map(|t| build_term(t, weights.get(t)))
            .collect()
    }

    /// The default list: every term at `weights`, in summing order, the
    /// built-in filters, the default picker at `temperature`.
    pub fn with_weights(weights: &TermWeights, temperature: f64) -> Self {
        Plugins {
            filters: Self::builtin_filters(),
            scorers: weights.iter().map(|(t, w)| build_term(t, w)).collect(),
            picker: default_picker(temperature),
        }
    }

    /// The list with its weighted terms wrapped in one [`Predicted`] term
    /// reading `learner` (the built-in terms still summed after it).
    pub fn predicted(mut self, learner: Arc<Learner>) -> Self {
        let builtin = |name: &str| registry::terms().any(|t| t.builtin() && t.name == name);
        let (kept, fallback) = self.scorers.into_iter().partition(|s| builtin(s.name()));
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

/// The default picker ([`registry::DEFAULT_PICKER`]) at `temperature`.
pub fn default_picker(temperature: f64) -> Arc<dyn Picker> {
    build_picker(registry::DEFAULT_PICKER, temperature)
}

/// `picker` without parameters, at `temperature`.
fn build_picker(picker: &PickerDecl, temperature: f64) -> Arc<dyn Picker> {
    let mut u = Unconfigured {
        temperature,
        ..Unconfigured::default()
    };
    unconfigured((picker.build)(&mut u.args()))
}

/// `term` without parameters, at `weights`.
fn build_term(term: &TermDecl, weights: TermWeight) -> Arc<dyn Scorer> {
    let mut u = Unconfigured {
        weight: weights.weight,
        prefill_weight: weights.prefill_side(),
        ..Unconfigured::default()
    };
    unconfigured((term.build)(&mut u.args()))
}

/// What a plugin the default list holds is built from: no parameters.
#[derive(Default)]
struct Unconfigured {
    weight: f64,
    prefill_weight: f64,
    temperature: f64,
    warnings: Vec<String>,
}

impl Unconfigured {
    fn args(&mut self) -> PluginArgs<'_> {
        PluginArgs {
            reference: "",
            weight: self.weight,
            prefill_weight: self.prefill_weight,
            temperature: self.temperature,
            params: None,
            warnings: &mut self.warnings,
        }
    }
}

/// A plugin built without parameters: only parameters are ever refused (the
/// registry's tests build every declaration so).
fn unconfigured<T: ?Sized>(built: Result<Arc<T>, PluginError>) -> Arc<T> {
    built.expect("a plugin without parameters builds")
}
