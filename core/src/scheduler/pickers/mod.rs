//! Pickers: how the pick chooses among the scored candidates (the llm-d
//! Router's `Picker`). Every picker is a [`Choice`] the pruned argmin in
//! `pick.rs` knows how to make, so a picker adds no work per candidate.
//!
//! Adding a picker: one file here with a type implementing [`Picker`], its
//! `from_config` and its [`PickerDecl`], and one line in
//! [`super::registry::REGISTRY`].

pub mod max_score;
pub mod random;

use std::fmt;
use std::sync::Arc;

use super::plugin::{PluginArgs, PluginError};

/// A picker as its file declares it; the registry lists the declarations.
#[derive(Debug)]
pub struct PickerDecl {
    /// Its plugin type ([`Picker::name`]).
    pub name: &'static str,
    /// Builds it.
    pub build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Picker>, PluginError>,
}

/// How the candidates' costs become a choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// The least cost, uniformly among equal ones (pruned argmin).
    Least,
    /// Candidate i with probability ∝ exp(−c′ᵢ / temperature), c′ the costs
    /// scaled to [0, 1]; an infinite temperature picks uniformly.
    Sample {
        /// Above zero.
        temperature: f64,
    },
}

impl Choice {
    /// [`Choice::Least`] for a temperature of zero (or below, or NaN), else sampling.
    pub fn with_temperature(temperature: f64) -> Self {
        match temperature > 0.0 {
            true => Choice::Sample { temperature },
            false => Choice::Least,
        }
    }
}

/// One picker.
pub trait Picker: Send + Sync + fmt::Debug {
    /// The plugin type name.
    fn name(&self) -> &'static str;

    /// How it chooses.
    fn choice(&self) -> Choice;

    /// How many endpoints a decision names, best first (the primary, then
    /// fallbacks for the gateway's retries), when its configuration says
    /// (`maxNumOfEndpoints`); `None` leaves it to `--max-endpoints`.
    fn max_endpoints(&self) -> Option<usize> {
        None
    }
}

/// `maxNumOfEndpoints`, checked: at least 1 when given.
pub(crate) fn max_num_of_endpoints(
    args: &PluginArgs<'_>,
    given: Option<u32>,
) -> Result<Option<usize>, PluginError> {
    match given {
        Some(0) => Err(args.invalid("maxNumOfEndpoints must be at least 1")),
        n => Ok(n.map(|n| n as usize)),
    }
}
