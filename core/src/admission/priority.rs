//! A request's priority and flow.
//!
//! Priority comes, in order, from the InferenceObjective the
//! `x-gateway-inference-objective` header names, from `nvext.agent_hints.priority`,
//! or from the default (0, as llm-d treats an unset priority). Negative priorities
//! are sheddable. The flow (the unit of fairness inside a priority band) is the
//! `x-gateway-inference-fairness-id` header, or the model when it is absent.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;

/// Request header naming the InferenceObjective (GIE / llm-d name).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Request header naming the fairness flow (GIE / llm-d name).
pub const FAIRNESS_ID_HEADER: &str = "x-gateway-inference-fairness-id";

/// The priorities of the pool's InferenceObjectives, by name. Written by the
/// Kubernetes watch (`discovery::objective`) or from flags in standalone mode.
#[derive(Debug, Default)]
pub struct Objectives {
    by_name: RwLock<HashMap<String, i32>>,
}

impl Objectives {
    /// A table holding `entries`.
    pub fn new(entries: impl IntoIterator<Item = (String, i32)>) -> Self {
        Objectives {
            by_name: RwLock::new(entries.into_iter().collect()),
        }
    }

    /// The priority of objective `name`, if it is known.
    pub fn priority(&self, name: &str) -> Option<i32> {
        self.by_name.read().get(name).copied()
    }

    /// Replaces the whole table.
    pub fn replace(&self, entries: HashMap<String, i32>) {
        *self.by_name.write() = entries;
    }

    /// Objectives known.
    pub fn len(&self) -> usize {
        self.by_name.read().len()
    }

    /// Whether none is known.
    pub fn is_empty(&self) -> bool {
        self.by_name.read().is_empty()
    }
}

/// Why `--inference-objectives` could not be read.
#[derive(Debug, thiserror::Error)]
#[error("invalid objective {entry:?}: expected name=priority with an i32 priority")]
pub struct ObjectiveSpecError {
    entry: String,
}

/// Parses `name=priority[,name=priority...]` (the standalone objectives flag).
pub fn parse_objectives(spec: &str) -> Result<HashMap<String, i32>, ObjectiveSpecError> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let bad = || ObjectiveSpecError {
                entry: entry.to_string(),
            };
            let (name, prio) = entry.split_once('=').ok_or_else(bad)?;
            let name = name.trim();
            if name.is_empty() {
                return Err(bad());
            }
            let prio = prio.trim().parse().map_err(|_| bad())?;
            Ok((name.to_string(), prio))
        })
        .collect()
}

/// What flow control needs to know about a request. Its names are shared, so
/// cloning the class or labelling a metric with them allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestClass {
    /// Higher is served first; negative is sheddable.
    pub priority: i32,
    /// The fairness flow.
    pub flow: Arc<str>,
    /// The objective the request named (empty when none), for metric labels.
    pub objective: Arc<str>,
    /// The model the request asked for, for metric labels.
    pub model: Arc<str>,
    /// Bytes the request holds while queued.
    pub bytes: usize,
}

impl RequestClass {
    /// Whether the request may be rejected at once under saturation.
    pub fn is_sheddable(&self) -> bool {
        self.priority < 0
    }
}

/// What a request says about itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestSignals<'a> {
    /// The `x-gateway-inference-objective` header.
    pub objective: Option<&'a str>,
    /// The `x-gateway-inference-fairness-id` header.
    pub fairness_id: Option<&'a str>,
    /// `nvext.agent_hints.priority`.
    pub hint_priority: Option<i32>,
    /// The body's `model`.
    pub model: &'a str,
    /// The body's size.
    pub bytes: usize,
}

/// Resolves a request's class: objective, then agent hint, then `default_priority`.
pub fn classify(
    objectives: &Objectives,
    default_priority: i32,
    signals: RequestSignals<'_>,
) -> RequestClass {
    let objective = signals.objective.map(str::trim).unwrap_or_default();
    let priority = (!objective.is_empty())
        .then(|| objectives.priority(objective))
        .flatten()
        .or(signals.hint_priority)
        .unwrap_or(default_priority);
    let model: Arc<str> = signals.model.into();
    let flow = match signals.fairness_id.map(str::trim) {
        Some(f) if !f.is_empty() && f != signals.model => f.into(),
        _ => Arc::clone(&model),
    };
    RequestClass {
        priority,
        flow,
        objective: match objective {
            "" => Arc::clone(&NO_OBJECTIVE),
            named => named.into(),
        },
        model,
        bytes: signals.bytes,
    }
}

/// The objective of a request that names none (one shared empty name).
static NO_OBJECTIVE: LazyLock<Arc<str>> = LazyLock::new(|| "".into());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objective_then_hint_then_default() {
        let objectives = Objectives::new([("batch".to_string(), -1), ("chat".to_string(), 10)]);
        let base = RequestSignals {
            model: "m",
            bytes: 7,
            ..Default::default()
        };
        let c = |s: RequestSignals<'_>| classify(&objectives, 2, s);
        assert_eq!(c(base).priority, 2);
        let hinted = RequestSignals {
            hint_priority: Some(5),
            ..base
        };
        assert_eq!(c(hinted).priority, 5);
        let named = RequestSignals {
            objective: Some("batch"),
            ..hinted
        };
        let class = c(named);
        assert_eq!((class.priority, &*class.objective), (-1, "batch"));
        assert!(class.is_sheddable());
        // An unknown objective falls through to the hint.
        let unknown = RequestSignals {
            objective: Some("nope"),
            ..hinted
        };
        assert_eq!(c(unknown).priority, 5);
    }

    #[test]
    fn flow_is_the_fairness_header_or_the_model() {
        let o = Objectives::default();
        let s = RequestSignals {
            model: "llama",
            ..Default::default()
        };
        assert_eq!(&*classify(&o, 0, s).flow, "llama");
        let s = RequestSignals {
            fairness_id: Some("tenant-a"),
            ..s
        };
        assert_eq!(&*classify(&o, 0, s).flow, "tenant-a");
    }

    #[test]
    fn a_class_shares_its_names() {
        let o = Objectives::default();
        let s = RequestSignals {
            model: "llama",
            ..Default::default()
        };
        let (a, b) = (classify(&o, 0, s), classify(&o, 0, s));
        // The flow is the model's own name; every unnamed objective is one name.
        assert!(Arc::ptr_eq(&a.flow, &a.model));
        assert!(Arc::ptr_eq(&a.objective, &b.objective) && a.objective.is_empty());
        let copy = a.clone();
        assert!(Arc::ptr_eq(&copy.model, &a.model));
        // A fairness id equal to the model is the model's name too.
        let same = RequestSignals {
            fairness_id: Some(" llama "),
            ..s
        };
        let c = classify(&o, 0, same);
        assert!(Arc::ptr_eq(&c.flow, &c.model));
    }

    #[test]
    fn objectives_flag_parses_and_rejects_junk() {
        let m = parse_objectives("chat=10, batch=-1,").unwrap();
        assert_eq!(m.get("chat"), Some(&10));
        assert_eq!(m.get("batch"), Some(&-1));
        assert!(parse_objectives("chat").is_err());
        assert!(parse_objectives("=3").is_err());
        assert!(parse_objectives("a=x").is_err());
        assert!(parse_objectives("").unwrap().is_empty());
    }
}
