//! `max-score-picker`: the best candidate (the least cost), uniformly among
//! equal ones; with `--temperature` above zero, sampled by cost instead.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{Choice, Picker, PickerDecl};
use crate::scheduler::plugin::{decode_params, PluginArgs, PluginError};

/// The declaration: the picker of the default plugin list.
pub static PICKER: PickerDecl = PickerDecl {
    name: "max-score-picker",
    build: |a| Ok(Arc::new(MaxScore::from_config(a)?)),
};

/// Takes the least cost (or samples with a temperature).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxScore {
    /// 0: the least cost; above: softmax sampling.
    pub temperature: f64,
    /// `maxNumOfEndpoints`, when configured.
    pub max_endpoints: Option<usize>,
}

/// llm-d's parameters.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Params {
    /// How many endpoints to return, best first (the rest are fallbacks).
    max_num_of_endpoints: Option<u32>,
}

impl MaxScore {
    /// The picker the registry builds, with `--temperature`.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let p: Params = decode_params(args)?;
        Ok(MaxScore {
            temperature: args.temperature,
            max_endpoints: super::max_num_of_endpoints(args, p.max_num_of_endpoints)?,
        })
    }
}

impl Picker for MaxScore {
    fn name(&self) -> &'static str {
        PICKER.name
    }

    fn choice(&self) -> Choice {
        Choice::with_temperature(self.temperature)
    }

    fn max_endpoints(&self) -> Option<usize> {
        self.max_endpoints
    }
}
