//! The llm-d Router's (and GIE's) `EndpointPickerConfig`, read from
//! `--config-file` / `--config-text`, mapped onto kvpick's cost weights.
//!
//! The format is llm-d Router v0.10.0's `apix/config/v1alpha1`
//! (`apiVersion: llm-d.ai/v1alpha1`; GIE's `inference.networking.x-k8s.io/v1alpha1`
//! has the same shape): a list of `plugins` (type, optional name and
//! parameters) and `schedulingProfiles` whose `pluginRef`s give scorers a
//! weight (1 when unset). llm-d adds up weighted scores in [0, 1]; kvpick adds
//! up weighted costs in KV blocks, so weights map as ratios: each cost term
//! kvpick has an equivalent scorer for gets its flag weight times the scorer's
//! weight over the prefix-cache scorer's (or, without one, the largest mapped
//! weight). A term whose scorers the profile lacks is switched off, as an
//! absent scorer has no say in llm-d. Plugins kvpick does by itself (parsers,
//! metrics sources, role filters, the max-score picker, P/D profile handlers)
//! are accepted silently; every other plugin, and every parameter, is reported
//! as a warning and ignored. The mapping is a pure function of the text.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use crate::scheduler::Weights;

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

/// A kvpick cost term an llm-d scorer stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Term {
    /// Prefix-cache overlap: `Weights::prefill` (and `prefill_overlap`).
    Prefix,
    /// In-flight load: `Weights::decode`.
    Load,
    /// Scraped queue depth: `Weights::queue`.
    Queue,
    /// Scraped KV-cache utilisation: `Weights::kv_usage`.
    KvUsage,
}

/// What a plugin type is to kvpick.
enum Meaning {
    /// A scorer whose weight maps to a cost term.
    Scorer(Term),
    /// Something kvpick always does its own way; accepted without a warning.
    Builtin,
}

/// Plugin types of llm-d Router v0.10.0 (`cmd/epp/runner/runner.go`
/// registrations) that kvpick has an equivalent for.
fn meaning(plugin_type: &str) -> Option<Meaning> {
    use Meaning::{Builtin, Scorer};
    Some(match plugin_type {
        "prefix-cache-scorer" | "precise-prefix-cache-scorer" => Scorer(Term::Prefix),
        "active-request-scorer"
        | "load-aware-scorer"
        | "running-requests-size-scorer"
        | "token-load-scorer" => Scorer(Term::Load),
        "queue-scorer" => Scorer(Term::Queue),
        "kv-cache-utilization-scorer" => Scorer(Term::KvUsage),
        // kvpick keeps sessions on their worker through signed session tokens.
        "session-affinity-scorer" | "session-affinity-filter" | "session-id-producer" => Builtin,
        // kvpick picks the cheapest candidate (--temperature 0).
        "max-score-picker" | "single-profile-handler" => Builtin,
        // Prefix state: kvpick's own index, fed by KV events where engines publish them.
        "approx-prefix-cache-producer"
        | "precise-prefix-cache-producer"
        | "inflight-load-producer"
        | "token-producer"
        | "tokenizer" => Builtin,
        // Request parsing and worker metrics: kvpick's parser and scraper.
        "openai-parser"
        | "vllmhttp-parser"
        | "passthrough-parser"
        | "metrics-data-source"
        | "core-metrics-extractor"
        | "endpoint-notification-source" => Builtin,
        // Disaggregated prefill/decode: kvpick's kvpick.io/role labels.
        "decode-filter"
        | "prefill-filter"
        | "disagg-profile-handler"
        | "pd-profile-handler"
        | "prefix-based-pd-decider"
        | "always-disagg-pd-decider" => Builtin,
        _ => return None,
    })
}

/// Top-level sections kvpick does its own way (no warning).
const BUILTIN_SECTIONS: [&str; 3] = ["dataLayer", "requestHandler", "parser"];

/// Weights read from a config, and what was ignored.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapping {
    /// The cost weights to schedule with.
    pub weights: Weights,
    /// One line per plugin, parameter or section that has no effect.
    pub warnings: Vec<String>,
    /// `(pluginRef, weight)` of the scorers that set a weight, for the log.
    pub mapped: Vec<(String, f64)>,
}

/// Parses `text` and maps it onto `base` (the weights the flags give).
pub fn map(text: &str, base: Weights) -> Result<Mapping, EndpointPickerConfigError> {
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
    for p in &doc.plugins {
        match meaning(&p.type_) {
            None => warnings.push(format!(
                "EndpointPickerConfig plugin {:?} (type {}) has no equivalent in kvpick; ignored",
                p.reference(),
                p.type_
            )),
            Some(_) if p.parameters.is_some() => warnings.push(format!(
                "EndpointPickerConfig parameters of plugin {:?} are not read by kvpick",
                p.reference()
            )),
            Some(_) => {}
        }
    }
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
    let Some(main) = main else {
        warnings.push("EndpointPickerConfig has no scheduling profile; weights unchanged".into());
        return Ok(Mapping {
            weights: base,
            warnings,
            mapped: Vec::new(),
        });
    };
    for other in &doc.scheduling_profiles {
        if other.name != main.name && other.name != "prefill" {
            warnings.push(format!(
                "EndpointPickerConfig scheduling profile {:?} is not used by kvpick (it picks with {:?})",
                other.name, main.name
            ));
        }
    }
    let terms = profile_terms(main, &by_ref);
    if terms.is_empty() {
        warnings.push(format!(
            "EndpointPickerConfig profile {:?} has no scorer kvpick maps; weights unchanged",
            main.name
        ));
        return Ok(Mapping {
            weights: base,
            warnings,
            mapped: Vec::new(),
        });
    }
    let unit = terms
        .get(&Term::Prefix)
        .copied()
        .unwrap_or_else(|| terms.values().copied().fold(0.0, f64::max));
    let scale = |term: Term, flag: f64| {
        terms
            .get(&term)
            .map_or(0.0, |w| if unit > 0.0 { flag * w / unit } else { 0.0 })
    };
    let mut weights = Weights {
        prefill: scale(Term::Prefix, base.prefill),
        decode: scale(Term::Load, base.decode),
        queue: scale(Term::Queue, base.queue),
        kv_usage: scale(Term::KvUsage, base.kv_usage),
        prefill_overlap: base.prefill_overlap,
    };
    // A `prefill` profile sets how much overlap counts when picking the prefill
    // worker, relative to the main profile's prefix weight.
    if let Some(prefill) = doc.scheduling_profiles.iter().find(|p| p.name == "prefill") {
        let prefill_terms = profile_terms(prefill, &by_ref);
        if let (Some(w), Some(main_w)) = (
            prefill_terms.get(&Term::Prefix),
            terms.get(&Term::Prefix).filter(|w| **w > 0.0),
        ) {
            weights.prefill_overlap = base.prefill_overlap * w / main_w;
        }
    }
    let mapped = main
        .plugins
        .iter()
        .filter(|r| {
            matches!(
                meaning(&by_ref[r.plugin_ref.as_str()].type_),
                Some(Meaning::Scorer(_))
            )
        })
        .map(|r| (r.plugin_ref.clone(), r.weight.unwrap_or(1.0)))
        .collect();
    Ok(Mapping {
        weights,
        warnings,
        mapped,
    })
}

/// Summed weight per cost term of a profile's scorers.
fn profile_terms(
    profile: &SchedulingProfile,
    by_ref: &BTreeMap<&str, &PluginSpec>,
) -> BTreeMap<Term, f64> {
    let mut terms = BTreeMap::new();
    for r in &profile.plugins {
        if let Some(Meaning::Scorer(term)) = meaning(&by_ref[r.plugin_ref.as_str()].type_) {
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
        let m = map(&upstream("chart-default-plugins.yaml"), unit()).unwrap();
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
        let m = map(&upstream("chart-default-plugins.yaml"), base).unwrap();
        assert!(close(m.weights.prefill, 2.0));
        assert!(close(m.weights.queue, 4.0 * 2.0 / 3.0));
    }

    #[test]
    fn payload_agnostic_profile_maps_load_and_keeps_sessions() {
        // active-request-scorer 1, session-affinity-scorer 1: no prefix scorer,
        // so the load weight is the unit and prefix routing is off.
        let m = map(&upstream("chart-payload-agnostic.yaml"), unit()).unwrap();
        assert!(close(m.weights.decode, 1.0), "{m:?}");
        assert!(close(m.weights.prefill, 0.0), "{m:?}");
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    }

    #[test]
    fn pd_profiles_set_the_prefill_overlap_weight() {
        let m = map(&upstream("deploy-config/pd-epp-config.yaml"), unit()).unwrap();
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
            let m = map(&text, unit()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let w = m.weights;
            for x in [w.prefill, w.decode, w.queue, w.kv_usage, w.prefill_overlap] {
                assert!(x.is_finite() && x >= 0.0, "{}: {w:?}", path.display());
            }
            // Every plugin kvpick does not know is named in a warning.
            let doc: Document = serde_yaml::from_str(&text).unwrap();
            for p in doc.plugins.iter().filter(|p| meaning(&p.type_).is_none()) {
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
        let m = map(&text, unit()).unwrap();
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
        let m = map(&read("chart-default-plugins.yaml"), unit()).unwrap();
        let llm_d = map(&upstream("chart-default-plugins.yaml"), unit()).unwrap();
        assert_eq!(m, llm_d);
        // The latency-predictor profile has no scorer kvpick maps: weights stay,
        // each plugin kvpick lacks is named.
        let m = map(&read("chart-latency-predictor-plugins.yaml"), unit()).unwrap();
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
        let m = map(text, unit()).unwrap();
        assert!(close(m.weights.queue, 1.0) && close(m.weights.prefill, 0.0));
    }

    #[test]
    fn wrong_kind_and_undefined_refs_are_errors() {
        let e = map("apiVersion: v1\nkind: ConfigMap\n", unit()).unwrap_err();
        assert!(matches!(e, EndpointPickerConfigError::Kind { .. }), "{e}");
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n";
        let e = map(text, unit()).unwrap_err();
        assert!(
            matches!(e, EndpointPickerConfigError::UndefinedPlugin { .. }),
            "{e}"
        );
        let e = map("plugins: [", unit()).unwrap_err();
        assert!(matches!(e, EndpointPickerConfigError::Yaml(_)), "{e}");
    }

    #[test]
    fn unused_sections_and_profiles_warn() {
        let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nflowControl: {}\nplugins:\n- type: queue-scorer\n- type: lora-affinity-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: lora-affinity-scorer\n- name: batch\n  plugins: []\n";
        let m = map(text, unit()).unwrap();
        let all = m.warnings.join("\n");
        assert!(all.contains("\"flowControl\""), "{all}");
        assert!(all.contains("type lora-affinity-scorer"), "{all}");
        assert!(all.contains("\"batch\""), "{all}");
    }
}
