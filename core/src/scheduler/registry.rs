//! Every plugin kvpick knows: a list of the declarations the plugin files
//! make ([`TermDecl`], [`FilterDecl`], [`PickerDecl`]), and the llm-d Router
//! plugin types (v0.10.0's names, `cmd/epp/runner/runner.go` registrations)
//! kvpick does its own way.
//!
//! The list's order is the terms' summing order, the built-in filters'
//! asking order and the order of the weight flags. A type listed as
//! [`Plugin::Builtin`] is something kvpick always does its own way (request
//! parsing, metrics, prefix state, role filters, profile handlers): accepted,
//! its parameters not read.

use super::filters::{body, ejected, subset, FilterDecl};
use super::pickers::{max_score, random, PickerDecl};
use super::terms::{failures, kv_usage, load, lora, prefix, queue, running, TermDecl};

/// One entry of the registry.
#[derive(Debug, Clone, Copy)]
pub enum Plugin {
    /// A cost term.
    Term(&'static TermDecl),
    /// A filter.
    Filter(&'static FilterDecl),
    /// A picker.
    Picker(&'static PickerDecl),
    /// An llm-d plugin type kvpick always does its own way; accepted without
    /// a warning.
    Builtin(&'static str),
}

/// Every plugin kvpick knows.
pub static REGISTRY: &[Plugin] = &[
    Plugin::Term(&prefix::TERM),
    Plugin::Term(&load::TERM),
    Plugin::Term(&queue::TERM),
    Plugin::Term(&kv_usage::TERM),
    Plugin::Term(&lora::TERM),
    Plugin::Term(&running::TERM),
    Plugin::Term(&failures::TERM),
    Plugin::Filter(&subset::FILTER),
    Plugin::Filter(&body::FILTER),
    Plugin::Filter(&ejected::FILTER),
    Plugin::Picker(&max_score::PICKER),
    Plugin::Picker(&random::PICKER),
    // kvpick keeps sessions on their worker through signed session tokens.
    Plugin::Builtin("session-affinity-scorer"),
    Plugin::Builtin("session-affinity-filter"),
    Plugin::Builtin("session-id-producer"),
    Plugin::Builtin("single-profile-handler"),
    // Prefix state: kvpick's own index, fed by KV events where engines publish them.
    Plugin::Builtin("approx-prefix-cache-producer"),
    Plugin::Builtin("precise-prefix-cache-producer"),
    Plugin::Builtin("inflight-load-producer"),
    Plugin::Builtin("token-producer"),
    Plugin::Builtin("tokenizer"),
    // Request parsing and worker metrics: kvpick's parser and scraper.
    Plugin::Builtin("openai-parser"),
    Plugin::Builtin("vllmhttp-parser"),
    Plugin::Builtin("passthrough-parser"),
    Plugin::Builtin("metrics-data-source"),
    Plugin::Builtin("core-metrics-extractor"),
    Plugin::Builtin("endpoint-notification-source"),
    // Disaggregated prefill/decode: kvpick's kvpick.io/role labels.
    Plugin::Builtin("decode-filter"),
    Plugin::Builtin("prefill-filter"),
    Plugin::Builtin("disagg-profile-handler"),
    Plugin::Builtin("pd-profile-handler"),
    Plugin::Builtin("prefix-based-pd-decider"),
    Plugin::Builtin("always-disagg-pd-decider"),
];

/// The picker of the default plugin list and of a profile that names none.
pub static DEFAULT_PICKER: &PickerDecl = &max_score::PICKER;

/// The cost terms, in summing order.
pub fn terms() -> impl Iterator<Item = &'static TermDecl> {
    REGISTRY.iter().filter_map(|p| match p {
        Plugin::Term(t) => Some(*t),
        _ => None,
    })
}

/// The filters, in asking order.
pub fn filters() -> impl Iterator<Item = &'static FilterDecl> {
    REGISTRY.iter().filter_map(|p| match p {
        Plugin::Filter(f) => Some(*f),
        _ => None,
    })
}

/// The place of `term` in the summing order ([`terms`]).
pub fn term_index(term: &TermDecl) -> Option<usize> {
    terms().position(|t| std::ptr::eq(t, term))
}

/// The plugin an `EndpointPickerConfig` means by `type_name`.
pub fn lookup(type_name: &str) -> Option<Plugin> {
    REGISTRY.iter().copied().find(|p| match p {
        Plugin::Term(t) => t.types.contains(&type_name),
        Plugin::Filter(f) => f.types.contains(&type_name),
        Plugin::Picker(p) => p.name == type_name,
        Plugin::Builtin(name) => *name == type_name,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::scheduler::plugin::{Knob, PluginArgs, Weight};

    /// Every flag a declaration carries.
    fn knobs() -> Vec<Knob> {
        let mut knobs = Vec::new();
        for t in terms() {
            if let Weight::Flag(k) = t.weight {
                knobs.push(k);
            }
            knobs.extend(t.prefill_weight);
        }
        knobs
    }

    #[test]
    fn names_types_and_flags_are_unique() {
        let mut names = HashSet::new();
        for t in terms() {
            assert!(names.insert(t.name), "term {}", t.name);
        }
        let mut types = HashSet::new();
        for p in REGISTRY {
            let declared: Vec<&str> = match p {
                Plugin::Term(t) => t.types.to_vec(),
                Plugin::Filter(f) => f.types.to_vec(),
                Plugin::Picker(p) => vec![p.name],
                Plugin::Builtin(name) => vec![*name],
            };
            for ty in declared {
                assert!(types.insert(ty), "type {ty}");
                assert!(lookup(ty).is_some(), "{ty}");
            }
        }
        let mut flags = HashSet::new();
        for k in knobs() {
            assert!(flags.insert(k.flag) && flags.insert(k.env), "{}", k.flag);
        }
    }

    #[test]
    fn every_declaration_builds_without_parameters() {
        let mut warnings = Vec::new();
        let mut args = PluginArgs {
            reference: "test",
            weight: 1.0,
            prefill_weight: 1.0,
            temperature: 0.0,
            params: None,
            warnings: &mut warnings,
        };
        for p in REGISTRY {
            match p {
                Plugin::Term(t) => assert_eq!((t.build)(&mut args).unwrap().name(), t.name),
                Plugin::Filter(f) => assert_eq!((f.build)(&mut args).unwrap().name(), f.name),
                Plugin::Picker(p) => assert_eq!((p.build)(&mut args).unwrap().name(), p.name),
                Plugin::Builtin(_) => {}
            }
        }
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn the_running_requests_scorer_is_its_own_term_weighted_0_by_default() {
        let Some(Plugin::Term(t)) = lookup("running-requests-size-scorer") else {
            panic!("running-requests-size-scorer is a term");
        };
        assert_eq!(t.name, running::TERM.name);
        assert_eq!(t.weight.default_value(), 0.0);
    }
}
