//! The llm-d Router's (and GIE's) `EndpointPickerConfig`, read from
//! `--config-file` / `--config-text`, built into the scheduler's plugin list.
//!
//! The format is llm-d Router v0.10.0's `apix/config/v1alpha1`
//! (`apiVersion: llm-d.ai/v1alpha1`; GIE's `inference.networking.x-k8s.io/v1alpha1`
//! has the same shape): a list of `plugins` (type, optional name and
//! parameters) and `schedulingProfiles` whose `pluginRef`s give scorers a
//! weight (1 when unset). Each plugin type is looked up in the scheduler's
//! registry ([`crate::scheduler::registry`]); its declaration builds it from
//! its parameters, decoded strictly: a wrong type or value is an error, a
//! parameter the plugin does not read is a warning.
//!
//! llm-d adds up weighted scores in [0, 1]; kvpick adds up weighted costs in
//! KV blocks, so weights map as ratios: each cost term kvpick has an
//! equivalent scorer for gets its flag weight (1 for a term without a flag)
//! times the scorer's weight over the unit term's (the prefix-cache
//! scorer's; without one, the largest mapped weight). A term's prefill-side
//! weight is its flag's, times its weight in a `prefill` profile over the
//! main profile's. The profile's scorers are the terms summed, in the
//! registry's order, then the built-in terms at their own weights; a term
//! whose scorers the profile lacks is left out, as an absent scorer has no
//! say in llm-d. Its picker chooses (max-score by
//! default) and its configured filters run after the built-in ones. Plugins
//! kvpick does by itself (parsers, metrics sources, role filters, P/D profile
//! handlers) are accepted silently; every other plugin, and their parameters,
//! is reported as a warning and ignored. The mapping is a pure function of the
//! text and the flags.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use crate::scheduler::filters::Filter;
use crate::scheduler::pickers::Picker;
use crate::scheduler::plugin::{PluginArgs, PluginError, Weight};
use crate::scheduler::registry::{self, Plugin};
use crate::scheduler::terms::{Scorer, TermDecl};
use crate::scheduler::{default_picker, Plugins, TermWeight, TermWeights};

#[cfg(test)]
mod tests;

/// API versions whose `EndpointPickerConfig` kvpick reads.
pub const API_VERSIONS: [&str; 2] = [
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
];

/// Why an `EndpointPickerConfig` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum EndpointPickerConfigError {
    /// `--config-file` could not be read.
    #[error("--config-file {path}: cannot read")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not YAML of the expected shape.
    #[error("EndpointPickerConfig is not valid")]
    Yaml(#[source] serde_yaml::Error),
    /// Another kind or API version.
    #[error(
        "expected kind EndpointPickerConfig of {API_VERSIONS:?}, got {kind:?} of {api_version:?}"
    )]
    Kind {
        /// The document's apiVersion.
        api_version: String,
        /// The document's kind.
        kind: String,
    },
    /// A profile refers to a plugin the `plugins` list does not define.
    #[error("scheduling profile {profile:?} refers to undefined plugin {plugin_ref:?}")]
    UndefinedPlugin {
        /// The profile.
        profile: String,
        /// The reference.
        plugin_ref: String,
    },
    /// A plugin's parameters were refused.
    #[error("EndpointPickerConfig")]
    Plugin(#[source] PluginError),
    /// A profile refers to more than one picker.
    #[error("scheduling profile {profile:?} has more than one picker")]
    Pickers {
        /// The profile.
        profile: String,
    },
    /// Both `--config-file` and `--config-text` were given.
    #[error("give --config-file or --config-text, not both")]
    Both,
}

/// The document, with the fields kvpick reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    plugins: Vec<PluginSpec>,
    #[serde(default)]
    scheduling_profiles: Vec<SchedulingProfile>,
    /// The other top-level sections (dataLayer, flowControl, ...).
    #[serde(flatten)]
    rest: BTreeMap<String, serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
struct PluginSpec {
    #[serde(default)]
    name: String,
    #[serde(rename = "type")]
    type_: String,
    #[serde(default)]
    parameters: Option<serde_yaml::Value>,
}

impl PluginSpec {
    /// The name profiles refer to it by: its name, else its type.
    fn reference(&self) -> &str {
        if self.name.is_empty() {
            &self.type_
        } else {
            &self.name
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchedulingProfile {
    name: String,
    #[serde(default)]
    plugins: Vec<SchedulingPlugin>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchedulingPlugin {
    plugin_ref: String,
    weight: Option<f64>,
}

/// Top-level sections kvpick does its own way (no warning).
const BUILTIN_SECTIONS: [&str; 3] = ["dataLayer", "requestHandler", "parser"];

/// Weights and plugins read from a config, and what was ignored.
#[derive(Debug, Clone)]
pub struct Mapping {
    /// The weights the profile's scorers map to (0 for a term it lacks; the
    /// flag weights when it maps no scorer).
    pub weights: TermWeights,
    /// The plugin list to schedule with (the default list at the flag
    /// weights when the config maps no scorer).
    pub plugins: Plugins,
    /// One line per plugin, parameter or section that has no effect.
    pub warnings: Vec<String>,
    /// `(pluginRef, weight)` of the scorers that set a weight, for the log.
    pub mapped: Vec<(String, f64)>,
}

/// Parses `text` and builds its plugins onto `base` (the weights the flags
/// give) and `temperature` (`--temperature`, for the max-score picker).
pub fn map(
    text: &str,
    base: &TermWeights,
    temperature: f64,
) -> Result<Mapping, EndpointPickerConfigError> {
    let doc: Document = serde_yaml::from_str(text).map_err(EndpointPickerConfigError::Yaml)?;
    if doc.kind != "EndpointPickerConfig" || !API_VERSIONS.contains(&doc.api_version.as_str()) {
        return Err(EndpointPickerConfigError::Kind {
            api_version: doc.api_version,
            kind: doc.kind,
        });
    }
    let mut warnings = Vec::new();
    for section in doc.rest.keys() {
        if !BUILTIN_SECTIONS.contains(&section.as_str()) {
            warnings.push(format!(
                "EndpointPickerConfig section {section:?} has no effect in kvpick; ignored"
            ));
        }
    }
    let by_ref: BTreeMap<&str, &PluginSpec> =
        doc.plugins.iter().map(|p| (p.reference(), p)).collect();
    for profile in &doc.scheduling_profiles {
        for r in &profile.plugins {
            if !by_ref.contains_key(r.plugin_ref.as_str()) {
                return Err(EndpointPickerConfigError::UndefinedPlugin {
                    profile: profile.name.clone(),
                    plugin_ref: r.plugin_ref.clone(),
                });
            }
        }
    }
    // The profile decode workers are picked with: `default`, `decode`, or the only one.
    let main = doc
        .scheduling_profiles
        .iter()
        .find(|p| p.name == "default" || p.name == "decode")
        .or_else(|| doc.scheduling_profiles.first());
    for other in &doc.scheduling_profiles {
        if main.is_some_and(|m| other.name != m.name) && other.name != "prefill" {
            warnings.push(format!(
                "EndpointPickerConfig scheduling profile {:?} is not used by kvpick (it picks with {:?})",
                other.name,
                main.map_or("", |m| m.name.as_str())
            ));
        }
    }
    let terms = main.map(|m| ProfileTerms::of(m, &by_ref));
    let weights = match (main, &terms) {
        (None, _) => {
            warnings
                .push("EndpointPickerConfig has no scheduling profile; weights unchanged".into());
            base.clone()
        }
        (Some(m), Some(t)) if t.is_empty() => {
            warnings.push(format!(
                "EndpointPickerConfig profile {:?} has no scorer kvpick maps; weights unchanged",
                m.name
            ));
            base.clone()
        }
        (Some(_), Some(t)) => mapped_weights(t, base, &doc, &by_ref),
        (Some(_), None) => base.clone(),
    };
    // Every plugin is built (its parameters checked) whether a profile uses it or not.
    let mut built = BTreeMap::new();
    for p in &doc.plugins {
        let Some(entry) = registry::lookup(&p.type_) else {
            warnings.push(format!(
                "EndpointPickerConfig plugin {:?} (type {}) has no equivalent in kvpick; ignored",
                p.reference(),
                p.type_
            ));
            continue;
        };
        let params = p
            .parameters
            .as_ref()
            .map(serde_json::to_value)
            .transpose()
            .map_err(|e| {
                EndpointPickerConfigError::Plugin(PluginError::Params {
                    plugin: p.reference().to_string(),
                    source: e,
                })
            })?;
        let w = match entry {
            Plugin::Term(t) => weights.get(t),
            _ => TermWeight {
                weight: 0.0,
                prefill: None,
            },
        };
        let mut args = PluginArgs {
            reference: p.reference(),
            weight: w.weight,
            prefill_weight: w.prefill_side(),
            temperature,
            params: params.as_ref(),
            warnings: &mut warnings,
        };
        let plugin = match entry {
            Plugin::Term(t) => (t.build)(&mut args).map(|s| Built::Scorer(t, s)),
            Plugin::Filter(f) => (f.build)(&mut args).map(Built::Filter),
            Plugin::Picker(k) => (k.build)(&mut args).map(Built::Picker),
            Plugin::Builtin(_) => {
                if p.parameters.is_some() {
                    args.warn("its parameters are not read by kvpick");
                }
                continue;
            }
        };
        built.insert(
            p.reference(),
            plugin.map_err(EndpointPickerConfigError::Plugin)?,
        );
    }
    let plugins = match main {
        Some(m) if terms.as_ref().is_some_and(|t| !t.is_empty()) => {
            profile_plugins(m, &built, &weights, temperature)?
        }
        _ => Plugins::with_weights(base, temperature),
    };
    let mapped = main
        .iter()
        .flat_map(|m| &m.plugins)
        .filter(|r| matches!(built.get(r.plugin_ref.as_str()), Some(Built::Scorer(..))))
        .map(|r| (r.plugin_ref.clone(), r.weight.unwrap_or(1.0)))
        .collect();
    Ok(Mapping {
        weights,
        plugins,
        warnings,
        mapped,
    })
}

/// A plugin built from its spec.
enum Built {
    /// A cost term, with its declaration.
    Scorer(&'static TermDecl, Arc<dyn Scorer>),
    /// A filter.
    Filter(Arc<dyn Filter>),
    /// A picker.
    Picker(Arc<dyn Picker>),
}

/// The plugin list of `profile`: the built-in filters and its own, one
/// scorer per term in the registry's order then the built-in terms at
/// `weights`, its picker (the default one at `temperature` when it names none).
fn profile_plugins(
    profile: &SchedulingProfile,
    built: &BTreeMap<&str, Built>,
    weights: &TermWeights,
    temperature: f64,
) -> Result<Plugins, EndpointPickerConfigError> {
    let mut filters = Plugins::builtin_filters();
    let mut scorers: Vec<(usize, Arc<dyn Scorer>)> = Vec::new();
    let mut picker: Option<Arc<dyn Picker>> = None;
    for r in &profile.plugins {
        match built.get(r.plugin_ref.as_str()) {
            Some(Built::Scorer(term, s)) => {
                let place = registry::term_index(term).unwrap_or(usize::MAX);
                if !scorers.iter().any(|(p, _)| *p == place) {
                    scorers.push((place, Arc::clone(s)));
                }
            }
            Some(Built::Filter(f)) => filters.push(Arc::clone(f)),
            Some(Built::Picker(_)) if picker.is_some() => {
                return Err(EndpointPickerConfigError::Pickers {
                    profile: profile.name.clone(),
                });
            }
            Some(Built::Picker(p)) => picker = Some(Arc::clone(p)),
            None => {}
        }
    }
    scorers.sort_by_key(|(place, _)| *place);
    Ok(Plugins {
        filters,
        scorers: (scorers.into_iter().map(|(_, s)| s))
            .chain(Plugins::builtin_scorers(weights))
            .collect(),
        picker: picker.unwrap_or_else(|| default_picker(temperature)),
    })
}

/// The summed weight of a profile's scorers per cost term (by the term's
/// place in the summing order; `None` for a term none of them stands for).
struct ProfileTerms(Vec<Option<f64>>);

impl ProfileTerms {
    /// The terms of `profile`'s scorers.
    fn of(profile: &SchedulingProfile, by_ref: &BTreeMap<&str, &PluginSpec>) -> Self {
        let mut terms = vec![None; registry::terms().count()];
        for r in &profile.plugins {
            let entry = registry::lookup(&by_ref[r.plugin_ref.as_str()].type_);
            if let Some(Plugin::Term(t)) = entry {
                if let Some(sum) = registry::term_index(t).and_then(|i| terms.get_mut(i)) {
                    *sum.get_or_insert(0.0) += r.weight.unwrap_or(1.0).max(0.0);
                }
            }
        }
        ProfileTerms(terms)
    }

    /// Whether no scorer of the profile stands for a term.
    fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// The summed weight of `term`'s scorers.
    fn get(&self, term: &TermDecl) -> Option<f64> {
        registry::term_index(term).and_then(|i| self.0.get(i).copied().flatten())
    }

    /// The weight the others are ratios to: the unit term's, else the largest.
    fn unit(&self) -> f64 {
        registry::terms()
            .find(|t| t.unit)
            .and_then(|t| self.get(t))
            .unwrap_or_else(|| self.0.iter().flatten().copied().fold(0.0, f64::max))
    }

    /// `flag` times `term`'s weight over the unit; 0 for a term the profile
    /// lacks.
    fn scale(&self, term: &TermDecl, flag: f64) -> f64 {
        let unit = self.unit();
        self.get(term)
            .map_or(0.0, |w| if unit > 0.0 { flag * w / unit } else { 0.0 })
    }
}

/// The flag weights scaled by the main profile's `terms` (and a term's
/// prefill-side weight by the `prefill` profile's weight of it over the main
/// profile's); the built-in terms keep theirs.
fn mapped_weights(
    terms: &ProfileTerms,
    base: &TermWeights,
    doc: &Document,
    by_ref: &BTreeMap<&str, &PluginSpec>,
) -> TermWeights {
    let prefill_terms = doc
        .scheduling_profiles
        .iter()
        .find(|p| p.name == "prefill")
        .map(|p| ProfileTerms::of(p, by_ref));
    let mut weights = base.clone();
    for (t, flags) in base.iter().filter(|(t, _)| !t.builtin()) {
        let flag = match t.weight {
            Weight::Flag(_) => flags.weight,
            Weight::Fixed(_) => 1.0,
        };
        let mut prefill = flags.prefill;
        if let (Some(p), Some(pt), Some(main_w)) = (
            prefill.as_mut(),
            &prefill_terms,
            terms.get(t).filter(|w| *w > 0.0),
        ) {
            if let Some(w) = pt.get(t) {
                *p = *p * w / main_w;
            }
        }
        weights.set(
            t,
            TermWeight {
                weight: terms.scale(t, flag),
                prefill,
            },
        );
    }
    weights
}
