//! The mapping of the llm-d Router's and GIE's published configs, and of
//! small ones that pin one rule each.

use super::*;
use crate::scheduler::terms::{kv_usage, load, prefix, queue, running};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
const UPSTREAM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/llm-d-v0.10.0"
);

fn upstream(name: &str) -> String {
    std::fs::read_to_string(format!("{UPSTREAM}/{name}")).unwrap()
}

/// Unit flag weights (prefill overlap 2): the tests check the mapped ratios.
fn unit() -> TermWeights {
    TermWeights::default()
        .with(&load::TERM, 1.0)
        .with(&queue::TERM, 1.0)
}

/// The weight `m` maps `term` to.
fn w(m: &Mapping, term: &TermDecl) -> f64 {
    m.weights.get(term).weight
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn llm_d_chart_default_profile_maps_queue_kv_and_prefix_weights() {
    // llm-d v0.10.0's chart default: queue 2, kv-cache-utilization 2, prefix 3.
    let m = map(&upstream("chart-default-plugins.yaml"), &unit(), 0.0).unwrap();
    assert!(close(w(&m, &prefix::TERM), 1.0), "{m:?}");
    assert!(close(w(&m, &queue::TERM), 2.0 / 3.0), "{m:?}");
    assert!(close(w(&m, &kv_usage::TERM), 2.0 / 3.0), "{m:?}");
    assert!(close(w(&m, &load::TERM), 0.0), "no load scorer: {m:?}");
    // metrics-data-source carries parameters kvpick does not read.
    assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
    assert!(m.warnings[0].contains("metrics-data-source"));
}

#[test]
fn flag_weights_scale_the_mapped_ratios() {
    let base = unit().with(&prefix::TERM, 2.0).with(&queue::TERM, 4.0);
    let m = map(&upstream("chart-default-plugins.yaml"), &base, 0.0).unwrap();
    assert!(close(w(&m, &prefix::TERM), 2.0));
    assert!(close(w(&m, &queue::TERM), 4.0 * 2.0 / 3.0));
}

#[test]
fn payload_agnostic_profile_maps_load_and_keeps_sessions() {
    // active-request-scorer 1, session-affinity-scorer 1: no prefix scorer,
    // so the load weight is the unit and prefix routing is off.
    let m = map(&upstream("chart-payload-agnostic.yaml"), &unit(), 0.0).unwrap();
    assert!(close(w(&m, &load::TERM), 1.0), "{m:?}");
    assert!(close(w(&m, &prefix::TERM), 0.0), "{m:?}");
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
}

#[test]
fn pd_profiles_set_the_prefill_overlap_weight() {
    let m = map(&upstream("deploy-config/pd-epp-config.yaml"), &unit(), 0.0).unwrap();
    // decode profile: prefix 2, queue 1.
    assert!(
        close(w(&m, &prefix::TERM), 1.0) && close(w(&m, &queue::TERM), 0.5),
        "{m:?}"
    );
    // prefill profile has the same prefix weight as decode: the flag value stays.
    assert!(
        close(m.weights.get(&prefix::TERM).prefill_side(), 2.0),
        "{m:?}"
    );
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
        let m = map(&text, &unit(), 0.0).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (t, x) in m.weights.iter() {
            for x in [x.weight, x.prefill_side()] {
                assert!(x.is_finite() && x >= 0.0, "{}: {}", path.display(), t.name);
            }
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
    let m = map(&text, &unit(), 0.0).unwrap();
    assert!(close(w(&m, &prefix::TERM), 1.0));
    assert!(
        close(w(&m, &kv_usage::TERM), 0.5) && close(w(&m, &queue::TERM), 0.5),
        "{m:?}"
    );
    assert_eq!(m.mapped.len(), 3);
}

#[test]
fn gie_v1_5_chart_configs_read_as_llm_d_ones() {
    let read =
        |name: &str| std::fs::read_to_string(format!("{FIXTURES}/gie-v1.5.0/{name}")).unwrap();
    // GIE's chart passes its default config to every EPP it runs.
    let m = map(&read("chart-default-plugins.yaml"), &unit(), 0.0).unwrap();
    let llm_d = map(&upstream("chart-default-plugins.yaml"), &unit(), 0.0).unwrap();
    assert_eq!(
        (m.weights, m.warnings, m.mapped),
        (llm_d.weights, llm_d.warnings, llm_d.mapped)
    );
    // The latency-predictor profile has no scorer kvpick maps: weights stay,
    // each plugin kvpick lacks is named.
    let m = map(&read("chart-latency-predictor-plugins.yaml"), &unit(), 0.0).unwrap();
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
    let m = map(text, &unit(), 0.0).unwrap();
    assert!(close(w(&m, &queue::TERM), 1.0) && close(w(&m, &prefix::TERM), 0.0));
}

#[test]
fn wrong_kind_and_undefined_refs_are_errors() {
    let e = map("apiVersion: v1\nkind: ConfigMap\n", &unit(), 0.0).unwrap_err();
    assert!(matches!(e, EndpointPickerConfigError::Kind { .. }), "{e}");
    let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n";
    let e = map(text, &unit(), 0.0).unwrap_err();
    assert!(
        matches!(e, EndpointPickerConfigError::UndefinedPlugin { .. }),
        "{e}"
    );
    let e = map("plugins: [", &unit(), 0.0).unwrap_err();
    assert!(matches!(e, EndpointPickerConfigError::Yaml(_)), "{e}");
}

#[test]
fn unused_sections_and_profiles_warn() {
    let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nflowControl: {}\nplugins:\n- type: queue-scorer\n- type: no-hit-lru-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: no-hit-lru-scorer\n- name: batch\n  plugins: []\n";
    let m = map(text, &unit(), 0.0).unwrap();
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
    let m = map(&upstream("chart-default-plugins.yaml"), &unit(), 0.0).unwrap();
    let (filters, scorers, picker) = names(&m.plugins);
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
    let m = map(text, &unit(), 0.0).unwrap();
    assert_eq!(
        names(&m.plugins),
        names(&Plugins::with_weights(&unit(), 0.0))
    );
    assert_eq!(m.weights, unit());
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
        let e = map(&config(bad), &unit(), 0.0).unwrap_err();
        assert!(
            matches!(e, EndpointPickerConfigError::Plugin(_)),
            "{bad}: {e}"
        );
        let chain = crate::error_chain::ErrorChain(&e).to_string();
        assert!(chain.contains("max-score-picker"), "{chain}");
    }
    // One it does not read is warned about; one it reads is not.
    let m = map(&config("    maxNumOfEndpoints: 1"), &unit(), 0.0).unwrap();
    let all = m.warnings.join("\n");
    assert!(
        all.contains("\"queue-scorer\"") && all.contains("\"lookback\""),
        "{all}"
    );
    assert!(!all.contains("maxNumOfEndpoints"), "{all}");
    // More than one: the decision lists fallbacks (over `--max-endpoints`).
    let m = map(&config("    maxNumOfEndpoints: 2"), &unit(), 0.0).unwrap();
    assert!(!m.warnings.join("\n").contains("maxNumOfEndpoints"));
    assert_eq!(m.plugins.picker.max_endpoints(), Some(2));
}

#[test]
fn two_pickers_in_one_profile_are_an_error() {
    let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n- type: max-score-picker\n- name: other\n  type: max-score-picker\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n  - pluginRef: max-score-picker\n  - pluginRef: other\n";
    let e = map(text, &unit(), 0.0).unwrap_err();
    assert!(
        matches!(e, EndpointPickerConfigError::Pickers { .. }),
        "{e}"
    );
}

#[test]
fn the_running_requests_scorer_maps_to_its_own_term() {
    let text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: prefix-cache-scorer\n- type: running-requests-size-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: prefix-cache-scorer\n    weight: 2\n  - pluginRef: running-requests-size-scorer\n";
    // Its flag weight (0 by default) scaled by 1 over the prefix scorer's 2.
    let m = map(text, &unit().with(&running::TERM, 0.5), 0.0).unwrap();
    assert!(close(w(&m, &running::TERM), 0.25), "{m:?}");
    assert!(
        close(w(&m, &load::TERM), 0.0),
        "not the active-load term: {m:?}"
    );
    let (_, scorers, _) = names(&m.plugins);
    assert_eq!(scorers, ["prefill", "running", "failures"]);
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
}
