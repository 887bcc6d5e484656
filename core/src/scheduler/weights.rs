//! The weight of every declared cost term: what the weight flags set (each
//! term's declared default otherwise), or what an `EndpointPickerConfig`
//! maps them to. The default plugin list is built from it
//! ([`Plugins::with_weights`](super::Plugins::with_weights)).
//!
//! Invariant: one entry per term of [`registry::terms`], in that order.

use std::fmt;

use super::plugin::Weight;
use super::registry;
use super::terms::TermDecl;

/// One term's weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TermWeight {
    /// Its weight.
    pub weight: f64,
    /// Its weight when a prefill worker is picked, for a term that has one of
    /// its own ([`TermDecl::prefill_weight`]).
    pub prefill: Option<f64>,
}

impl TermWeight {
    /// The declared defaults of `term`.
    pub fn default_of(term: &TermDecl) -> Self {
        TermWeight {
            weight: term.weight.default_value(),
            prefill: term.prefill_weight.map(|k| k.default),
        }
    }

    /// Its weight when a prefill worker is picked.
    pub fn prefill_side(&self) -> f64 {
        self.prefill.unwrap_or(self.weight)
    }
}

/// The weights of every declared term.
#[derive(Debug, Clone, PartialEq)]
pub struct TermWeights(Vec<TermWeight>);

impl Default for TermWeights {
    fn default() -> Self {
        TermWeights(registry::terms().map(TermWeight::default_of).collect())
    }
}

impl TermWeights {
    /// The weights of `term` (its declared defaults for a term the registry
    /// does not list).
    pub fn get(&self, term: &TermDecl) -> TermWeight {
        registry::term_index(term)
            .and_then(|i| self.0.get(i).copied())
            .unwrap_or_else(|| TermWeight::default_of(term))
    }

    /// Sets the weights of `term`, a term the registry lists (else nothing
    /// changes).
    pub fn set(&mut self, term: &TermDecl, weights: TermWeight) {
        if let Some(w) = registry::term_index(term).and_then(|i| self.0.get_mut(i)) {
            *w = weights;
        }
    }

    /// These weights with `term` weighing `weight` (its prefill-side weight
    /// kept).
    pub fn with(mut self, term: &TermDecl, weight: f64) -> Self {
        let prefill = self.get(term).prefill;
        self.set(term, TermWeight { weight, prefill });
        self
    }

    /// Sets the weight the flag `flag` names; false when no declaration has
    /// that flag.
    pub fn set_flag(&mut self, flag: &str, value: f64) -> bool {
        for (t, w) in registry::terms().zip(self.0.iter_mut()) {
            if matches!(t.weight, Weight::Flag(k) if k.flag == flag) {
                w.weight = value;
                return true;
            }
            if t.prefill_weight.is_some_and(|k| k.flag == flag) {
                w.prefill = Some(value);
                return true;
            }
        }
        false
    }

    /// Every term with its weights, in summing order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static TermDecl, TermWeight)> + '_ {
        registry::terms().zip(self.0.iter().copied())
    }
}

/// `name=weight` per term, then `prefill-side name=weight` for terms with a
/// prefill-side weight.
impl fmt::Display for TermWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        for (t, w) in self.iter() {
            write!(f, "{sep}{}={}", t.name, w.weight)?;
            sep = " ";
        }
        for (t, w) in self.iter() {
            if let Some(p) = w.prefill {
                write!(f, "{sep}prefill-side {}={p}", t.name)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::terms::{load, prefix};

    #[test]
    fn flags_set_their_terms_weights() {
        let mut w = TermWeights::default();
        assert_eq!(w.get(&load::TERM).weight, 0.1);
        assert!(w.set_flag("weight-decode", 0.5));
        assert!(w.set_flag("weight-prefill-overlap", 3.0));
        assert!(!w.set_flag("weight-nothing", 1.0));
        assert_eq!(w.get(&load::TERM).weight, 0.5);
        assert_eq!(w.get(&prefix::TERM).prefill_side(), 3.0);
        assert_eq!(w.get(&load::TERM).prefill_side(), 0.5);
        let w = w.with(&prefix::TERM, 2.0);
        assert_eq!(
            w.get(&prefix::TERM),
            TermWeight {
                weight: 2.0,
                prefill: Some(3.0)
            }
        );
    }
}
