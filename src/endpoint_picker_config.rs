//! The llm-d Router's (and GIE's) `EndpointPickerConfig`, read from
//! `--config-file` / `--config-text`, built into the scheduler's plugin list.
//!
//! The format is llm-d Router v0.10.0's `apix/config/v1alpha1`
//! (`apiVersion: llm-d.ai/v1alpha1`; GIE's `inference.networking.x-k8s.io/v1alpha1`
//! has the same shape): a list of `plugins` (type, optional name and
//! parameters) and `schedulingProfiles` whose `pluginRef`s give scorers a
//! weight (1 when unset). Each plugin type is looked up in the scheduler's
//! registry ([`crate::scheduler::registry`]), which builds it from its
//! parameters, decoded strictly: a wrong type or value is an error, a
//! parameter the plugin does not read is a warning.
//!
//! llm-d adds up weighted scores in [0, 1]; kvpick adds up weighted costs in
//! KV blocks, so weights map as ratios: each cost term kvpick has an
//! equivalent scorer for gets its flag weight (1 for a term without a flag)
//! times the scorer's weight over the prefix-cache scorer's (or, without one,
//! the largest mapped weight). The profile's scorers are the terms summed, in
//! the registry's order; a term whose scorers the profile lacks is left out,
//! as an absent scorer has no say in llm-d. Its picker chooses (max-score by
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
use crate::scheduler::pickers::{max_score::MaxScore, Picker};
use crate::scheduler::registry::{self, Kind, PluginArgs, PluginError};
use crate::scheduler::terms::Scorer;
use crate::scheduler::{Plugins, Weights};

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
    /// The cost weights the profile's scorers map to (0 for a term it lacks).
    pub weights: Weights,
    /// The plugin list to schedule with (`None`: the default list at `weights`).
    pub plugins: Option<Plugins>,
    /// One line per plugin, parameter or section that has no effect.
    pub warnings: Vec<String>,
    /// `(pluginRef, weight)` of the scorers that set a weight, for the log.
    pub mapped: Vec<(String, f64)>,
}

/// Parses `text` and builds its plugins onto `base` (the weights the flags
/// give) and `temperature` (`--temperature`, for the max-score picker).
pub fn map(
    text: &str,
    base: Weights,
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
    let terms = main.map(|m| profile_terms(m, &by_ref)).unwrap_or_default();
    let weights = match main {
        None => {
            warnings
                .push("EndpointPickerConfig has no scheduling profile; weights unchanged".into());
            base
        }
        Some(m) if terms.is_empty() => {
            warnings.push(format!(
                "EndpointPickerConfig profile {:?} has no scorer kvpick maps; weights unchanged",
                m.name
            ));
            base
        }
        Some(_) => mapped_weights(&terms, base, &doc, &by_ref),
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
        let weight = match entry.kind {
            Kind::Scorer { term, .. } => term_weight(&weights, term, &terms, base),
            _ => 0.0,
        };
        let mut args = PluginArgs {
            reference: p.reference(),
            weight,
            weights,
            temperature,
            params: params.as_ref(),
            warnings: &mut warnings,
        };
        let plugin = match entry.kind {
            Kind::Scorer { term, build } => Built::Scorer(term, build(&mut args)),
            Kind::Filter(build) => Built::Filter(build(&mut args)),
            Kind::Picker(build) => Built::Picker(build(&mut args)),
            Kind::Builtin => {
                if p.parameters.is_some() {
                    args.warn("its parameters are not read by kvpick");
                }
                continue;
            }
        };
        built.insert(
            p.reference(),
            plugin.ok().map_err(EndpointPickerConfigError::Plugin)?,
        );
    }
    let plugins = match main {
        Some(m) if !terms.is_empty() => Some(profile_plugins(m, &built, temperature)?),
        _ => None,
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
enum Built<S, F, P> {
    /// A cost term, with the term's name.
    Scorer(&'static str, S),
    /// A filter.
    Filter(F),
    /// A picker.
    Picker(P),
}

impl<E> Built<Result<Arc<dyn Scorer>, E>, Result<Arc<dyn Filter>, E>, Result<Arc<dyn Picker>, E>> {
    /// The plugin, or why it could not be built.
    fn ok(self) -> Result<BuiltPlugin, E> {
        Ok(match self {
            Built::Scorer(t, s) => Built::Scorer(t, s?),
            Built::Filter(f) => Built::Filter(f?),
            Built::Picker(p) => Built::Picker(p?),
        })
    }
}

type BuiltPlugin = Built<Arc<dyn Scorer>, Arc<dyn Filter>, Arc<dyn Picker>>;

/// The plugin list of `profile`: the built-in filters and its own, one
/// scorer per term in the registry's order then the built-in terms, its picker
/// (max-score by default).
fn profile_plugins(
    profile: &SchedulingProfile,
    built: &BTreeMap<&str, BuiltPlugin>,
    temperature: f64,
) -> Result<Plugins, EndpointPickerConfigError> {
    let mut filters = Plugins::builtin_filters();
    let mut scorers: Vec<(usize, Arc<dyn Scorer>)> = Vec::new();
    let mut picker: Option<Arc<dyn Picker>> = None;
    for r in &profile.plugins {
        match built.get(r.plugin_ref.as_str()) {
            Some(Built::Scorer(term, s)) => {
                let place = registry::REGISTRY
                    .iter()
                    .position(|e| matches!(e.kind, Kind::Scorer { term: t, .. } if t == *term))
                    .unwrap_or(usize::MAX);
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
            .chain(Plugins::builtin_scorers())
            .collect(),
        picker: picker.unwrap_or_else(|| {
            Arc::new(MaxScore {
                temperature,
                max_endpoints: None,
            })
        }),
    })
}

/// The flag weight of a term (1 for a term without a flag).
fn flag_weight(base: Weights, term: &str) -> f64 {
    match term {
        "prefill" => base.prefill,
        "decode_load" => base.decode,
        "queue" => base.queue,
        "kv_usage" => base.kv_usage,
        _ => 1.0,
    }
}

/// The weight a term is built with: the mapped one (see the module doc).
fn term_weight(weights: &Weights, term: &str, terms: &BTreeMap<&str, f64>, base: Weights) -> f64 {
    match term {
        "prefill" => weights.prefill,
        "decode_load" => weights.decode,
        "queue" => weights.queue,
        "kv_usage" => weights.kv_usage,
        other => scale(terms, other, flag_weight(base, other)),
    }
}

/// `flag` times the term's profile weight over the unit (the prefix-cache
/// scorer's weight, else the largest one); 0 for a term the profile lacks.
fn scale(terms: &BTreeMap<&str, f64>, term: &str, flag: f64) -> f64 {
    let unit = terms
        .get("prefill")
        .copied()
        .unwrap_or_else(|| terms.values().copied().fold(0.0, f64::max));
    terms
        .get(term)
        .map_or(0.0, |w| if unit > 0.0 { flag * w / unit } else { 0.0 })
}

/// The flag weights scaled by the main profile's `terms` (and the prefill
/// profile's prefix weight, for picking prefill workers).
fn mapped_weights(
    terms: &BTreeMap<&str, f64>,
    base: Weights,
    doc: &Document,
    by_ref: &BTreeMap<&str, &PluginSpec>,
) -> Weights {
    let mut weights = Weights {
        prefill: scale(terms, "prefill", base.prefill),
        decode: scale(terms, "decode_load", base.decode),
        queue: scale(terms, "queue", base.queue),
        kv_usage: scale(terms, "kv_usage", base.kv_usage),
        prefill_overlap: base.prefill_overlap,
    };
    // A `prefill` profile sets how much overlap counts when picking the prefill
    // worker, relative to the main profile's prefix weight.
    if let Some(prefill) = doc.scheduling_profiles.iter().find(|p| p.name == "prefill") {
        let prefill_terms = profile_terms(prefill, by_ref);
        if let (Some(w), Some(main_w)) = (
            prefill_terms.get("prefill"),
            terms.get("prefill").filter(|w| **w > 0.0),
        ) {
            weights.prefill_overlap = base.prefill_overlap * w / main_w;
        }
    }
    weights
}

/// Summed weight per cost term of a profile's scorers.
fn profile_terms(
    profile: &SchedulingProfile,
    by_ref: &BTreeMap<&str, &PluginSpec>,
) -> BTreeMap<&'static str, f64> {
    let mut terms = BTreeMap::new();
    for r in &profile.plugins {
        let entry = registry::lookup(&by_ref[r.plugin_ref.as_str()].type_);
        if let Some(Kind::Scorer { term, .. }) = entry.map(|e| e.kind) {
            *terms.entry(term).or_insert(0.0) += r.weight.unwrap_or(1.0).max(0.0);
        }
    }
    terms
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPSTREAM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llm-d-v0.10.0");

    fn upstream(name: &str) -> String {
        std::fs::read_to_string(format!("{UPSTREAM}/{name}")).unwrap()
    }

    /// Unit flag weights (prefill overlap 2): the tests check the mapped ratios.
    fn unit() -> Weights {
        Weights {
            prefill: 1.0,
            decode: 1.0,
            queue: 1.0,
            kv_usage: 1.0,
            prefill_overlap: 2.0,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn llm_d_chart_default_profile_maps_queue_kv_and_prefix_weights() {
        // llm-d v0.10.0's chart default: queue 2, kv-cache-utilization 2, prefix 3.
        let m = map(&upstream("chart-default-plugins.yaml"), unit(), 0.0).unwrap();
        assert!(close(m.weights.prefill, 1.0), "{m:?}");
        assert!(close(m.weights.queue, 2.0 / 3.0), "{m:?}");
        assert!(close(m.weights.kv_usage, 2.0 / 3.0), "{m:?}");
        assert!(close(m.weights.decode, 0.0), "no load scorer: {m:?}");
        // metrics-data-source carries parameters kvpick does not read.
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].contains("metrics-data-source"));
    }

    #[test]
    fn flag_weights_scale_the_mapped_ratios() {
        let base = Weights {
            prefill: 2.0,
            queue: 4.0,
            ..unit()
        };
        let m = map(&upstream("chart-default-plugins.yaml"), base, 0.0).unwrap();
        assert!(close(m.weights.prefill, 2.0));
        assert!(close(m.weights.queue, 4.0 * 2.0 / 3.0));
    }

    #[test]
    fn payload_agnostic_profile_maps_load_and_keeps_sessions() {
        // active-request-scorer 1, session-affinity-scorer 1: no prefix scorer,
        // so the load weight is the unit and prefix routing is off.
        let m = map(&upstream("chart-payload-agnostic.yaml"), unit(), 0.0).unwrap();
        assert!(close(m.weights.decode, 1.0), "{m:?}");
        assert!(close(m.weights.prefill, 0.0), "{m:?}");
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    }

    #[test]
    fn pd_profiles_set_the_prefill_overlap_weight() {
        let m = map(&upstream("deploy-config/pd-epp-config.yaml"), unit(), 0.0).unwrap();
        // decode profile: prefix 2, queue 1.
        assert!(
            close(m.weights.prefill, 1.0) && close(m.weights.queue, 0.5),
            "{m:?}"
        );
        // prefill profile has the same prefix weight as decode: the flag value stays.
        assert!(close(m.weights.prefill_overlap, 2.0), "{m:?}");
    }

    #[test]
    fn every_upstream_example_config_reads_and_unknown_plugins_warn() {
        let dir = format!("{UPSTREAM}/deploy-config");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(files.len() >= 19, "the vendored deploy/config files");
        let mut warned = 0;
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap();
            let m = map(&text, unit(), 0.0).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let w = m.weights;
            for x in [w.prefill, w.decode, w.queue, w.kv_usage, w.prefill_overlap] {
                assert!(x.is_finite() && x >= 0.0, "{}: {w:?}", path.display());
            }
            // Every plugin kvpick does not know is named in a warning.
            let doc: Document = serde_yaml::from_str(&text).unwrap();
            for p in doc
                .plugins
                .iter()
                .filter(|p| registry::lookup(&p.type_).is_none())
            {
                assert!(
                    m.warnings
                        .iter()
                        .any(|w| w.contains(&format!("type {}", p.type_))),
                    "{}: no warning for {}",
                    path.display(),
                    p.type_
                );
                warned += 1;
            }
        }
        assert!(warned > 0, "the examples use plugins kvpick lacks");
    }

    #[test]
    fn precise_prefix_example_maps_all_three_scorers() {
        let text = upstream("deploy-config/epp-precise-prefix-cache-config.yaml");
        let m = map(&text, unit(), 0.0).unwrap();
        assert!(close(m.weights.prefill, 1.0));
        assert!(
            close(m.weights.kv_usage, 0.5) && close(m.weights.queue, 0.5),
            "{m:?}"
        );
        assert_eq!(m.mapped.len(), 3);
    }

    #[test]
    fn gie_v1_5_chart_configs_read_as_llm_d_ones() {
        let gie = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gie-v1.5.0");
        let read = |name: &str| std::fs::read_to_string(format!("{gie}/{name}")).unwrap();
        // GIE's chart passes its default config to every EPP it runs.
        let m = map(&read("chart-default-plugins.yaml"), unit(), 0.0).unwrap();
        let llm_d = map(&upstream("chart-default-plugins.yaml"), unit(), 0.0).unwrap();
        assert_eq!(
            (m.weights, m.warnings, m.mapped),
            (llm_d.weights, llm_d.warnings, llm_d.mapped)
        );
        // The latency-predictor profile has no scorer kvpick maps: weights stay,
        // each plugin kvpick lacks is named.
        let m = map(&read("chart-latency-predictor-plugins.yaml"), unit(), 0.0).unwrap();
        assert_eq!(m.weights, unit());
        for missing in [
            "latency-scorer",
            "weighted-random-picker",
            "strict-affinity-filter",
        ] {
            assert!(
                m.warnings.iter().any(|w| w.contains(missing)),
                "{missing}: {:?}",
                m.warnings
            );
        }
    }

    #[test]
    fn gie_api_version_is_read_too() {
        let text = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n";
        let m = map(text, unit(), 0.0).unwrap();
        assert!(close(m.weights.queue, 1.0) && close(m.weights.prefill, 0.0));
    }

    #[test]
    fn wrong_kind_and_undefined_refs_are_errors() {
        let e = map("apiVersion: v1\nkind: ConfigMap\n", unit(), 0.0).unwrap_err();
        assert!(matches!(e, EndpointPickerConfigError::Kind { .. }), "{e}");
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n";
        let e = map(text, unit(), 0.0).unwrap_err();
        assert!(
            matches!(e, EndpointPickerConfigError::UndefinedPlugin { .. }),
            "{e}"
        );
        let e = map("plugins: [", unit(), 0.0).unwrap_err();
        assert!(matches!(e, EndpointPickerConfigError::Yaml(_)), "{e}");
    }

    #[test]
    fn unused_sections_and_profiles_warn() {
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nflowControl: {}\nplugins:\n- type: queue-scorer\n- type: no-hit-lru-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: no-hit-lru-scorer\n- name: batch\n  plugins: []\n";
        let m = map(text, unit(), 0.0).unwrap();
        let all = m.warnings.join("\n");
        assert!(all.contains("\"flowControl\""), "{all}");
        assert!(all.contains("type no-hit-lru-scorer"), "{all}");
        assert!(all.contains("\"batch\""), "{all}");
    }

    fn names(p: &Plugins) -> (Vec<&'static str>, Vec<&'static str>, &'static str) {
        (
            p.filters.iter().map(|f| f.name()).collect(),
            p.scorers.iter().map(|s| s.name()).collect(),
            p.picker.name(),
        )
    }

    #[test]
    fn the_main_profile_builds_the_plugin_list() {
        let m = map(&upstream("chart-default-plugins.yaml"), unit(), 0.0).unwrap();
        let plugins = m.plugins.expect("a profile with scorers");
        let (filters, scorers, picker) = names(&plugins);
        assert_eq!(
            filters,
            [
                "subset-filter",
                "prefill-needs-body-filter",
                "passive-health-filter"
            ]
        );
        // In the registry's summing order; no load scorer in that profile, and
        // the failures term built in, so failed responses still cost.
        assert_eq!(scorers, ["prefill", "queue", "kv_usage", "failures"]);
        assert_eq!(picker, "max-score-picker");
        // No scorer kvpick maps: the default list at the flag weights.
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: max-score-picker\n";
        assert!(map(text, unit(), 0.0).unwrap().plugins.is_none());
    }

    #[test]
    fn parameters_are_decoded_strictly() {
        let config = |params: &str| {
            format!(
                "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n  parameters:\n    lookback: 3\n- type: max-score-picker\n  parameters:\n{params}\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: max-score-picker\n"
            )
        };
        // A parameter of the wrong type or value is refused, naming the plugin.
        for bad in [
            "    maxNumOfEndpoints: two",
            "    maxNumOfEndpoints: 0",
            "    - 1",
        ] {
            let e = map(&config(bad), unit(), 0.0).unwrap_err();
            assert!(
                matches!(e, EndpointPickerConfigError::Plugin(_)),
                "{bad}: {e}"
            );
            let chain = format!("{:#}", anyhow::Error::from(e));
            assert!(chain.contains("max-score-picker"), "{chain}");
        }
        // One it does not read is warned about; one it reads is not.
        let m = map(&config("    maxNumOfEndpoints: 1"), unit(), 0.0).unwrap();
        let all = m.warnings.join("\n");
        assert!(
            all.contains("\"queue-scorer\"") && all.contains("\"lookback\""),
            "{all}"
        );
        assert!(!all.contains("maxNumOfEndpoints"), "{all}");
        // More than one: the decision lists fallbacks (over `--max-endpoints`).
        let m = map(&config("    maxNumOfEndpoints: 2"), unit(), 0.0).unwrap();
        assert!(!m.warnings.join("\n").contains("maxNumOfEndpoints"));
        let picker = m.plugins.expect("a profile with a scorer").picker;
        assert_eq!(picker.max_endpoints(), Some(2));
    }

    #[test]
    fn two_pickers_in_one_profile_are_an_error() {
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n- type: max-score-picker\n- name: other\n  type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: max-score-picker\n  - pluginRef: other\n";
        let e = map(text, unit(), 0.0).unwrap_err();
        assert!(
            matches!(e, EndpointPickerConfigError::Pickers { .. }),
            "{e}"
        );
    }
}
