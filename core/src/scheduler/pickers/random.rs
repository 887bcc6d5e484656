//! `random-picker`: a candidate uniformly at random, whatever its cost (llm-d's
//! random picker; filters still apply). As sampling with an infinite
//! temperature, every finite cost weighs the same.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use super::{Choice, Picker, PickerDecl};
use crate::scheduler::plugin::{decode_params, PluginArgs, PluginError};

/// The declaration.
pub static PICKER: PickerDecl = PickerDecl {
    name: "random-picker",
    build: |a| Ok(Arc::new(Random::from_config(a)?)),
};

/// Picks uniformly among the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Random {
    /// `maxNumOfEndpoints`, when configured.
    pub max_endpoints: Option<usize>,
}

/// llm-d's parameters.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Params {
    /// How many endpoints to return (the rest are fallbacks).
    max_num_of_endpoints: Option<u32>,
}

impl Random {
    /// The picker the registry builds.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let p: Params = decode_params(args)?;
        Ok(Random {
            max_endpoints: super::max_num_of_endpoints(args, p.max_num_of_endpoints)?,
        })
    }
}

impl Picker for Random {
    fn name(&self) -> &'static str {
        PICKER.name
    }

    fn choice(&self) -> Choice {
        Choice::Sample {
            temperature: f64::INFINITY,
        }
    }

    fn max_endpoints(&self) -> Option<usize> {
        self.max_endpoints
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Arc;

    use super::*;
    use crate::scheduler::tests::{both, prompt, with_body};
    use crate::scheduler::{Plugins, Scheduler, SchedulerConfig};

    #[test]
    fn it_spreads_a_repeated_prompt_over_every_worker() {
        let plugins = Plugins {
            picker: Arc::new(Random::default()),
            ..Plugins::default()
        };
        let s = Scheduler::new(SchedulerConfig {
            plugins,
            ..SchedulerConfig::default()
        });
        let t = both(4);
        let snap = t.snapshot();
        // The max-score picker would send every repeat to the first holder.
        let p = prompt(&"the same prompt, over and over. ".repeat(16));
        let workers: HashSet<_> = (0..200)
            .map(|_| {
                let d = s.pick(&with_body(&p), &snap).unwrap();
                s.finish(&d, Some(200));
                d.decode.key()
            })
            .collect();
        assert_eq!(workers.len(), 4);
    }
}
