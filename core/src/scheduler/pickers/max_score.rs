//! `max-score-picker`: the best candidate (the least cost), uniformly among
//! equal ones; with `--temperature` above zero, sampled by cost instead.

use serde::{Deserialize, Serialize};

use super::{Choice, Picker};
use crate::scheduler::registry::{decode_params, PluginArgs, PluginError};

/// Takes the least cost (or samples with a temperature).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaxScore {
    /// 0: the least cost; above: softmax sampling.
    pub temperature: f64,
}

/// llm-d's parameters.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Params {
    /// How many endpoints to return, best first (kvpick routes to one).
    max_num_of_endpoints: Option<u32>,
}

impl MaxScore {
    /// The picker the registry builds, with `--temperature`.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let p: Params = decode_params(args)?;
        match p.max_num_of_endpoints {
            Some(0) => return Err(args.invalid("maxNumOfEndpoints must be at least 1")),
            Some(n) if n > 1 => args.warn(format!(
                "maxNumOfEndpoints {n}: kvpick routes each request to one endpoint"
            )),
            _ => {}
        }
        Ok(MaxScore {
            temperature: args.temperature,
        })
    }
}

impl Picker for MaxScore {
    fn name(&self) -> &'static str {
        "max-score-picker"
    }

    fn choice(&self) -> Choice {
        Choice::with_temperature(self.temperature)
    }
}
