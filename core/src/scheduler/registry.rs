//! The plugin types kvpick knows, keyed by the llm-d Router's type names where
//! kvpick has an equivalent, and how each is built from its parameters.
//!
//! Parameters are decoded strictly: a parameter of the wrong type or value is
//! refused with an error naming the plugin; one the plugin does not read is
//! named in a warning. A type listed as [`Kind::Builtin`] is something kvpick
//! always does its own way (request parsing, metrics, prefix state, role
//! filters, profile handlers): accepted, its parameters not read.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::filters::Filter;
use super::pickers::{self, max_score::MaxScore, Picker};
use super::terms::Scorer;
use super::terms::{
    kv_usage::KvUsage, load::ActiveLoad, lora::LoraAffinity, prefix::PrefixCache, queue::Queue,
};
use super::Weights;

/// What a plugin type is to kvpick.
#[derive(Clone, Copy)]
pub enum Kind {
    /// A cost term; `term` names it (several llm-d scorers may stand for one term).
    Scorer {
        /// The term's name ([`Scorer::name`]).
        term: &'static str,
        /// Builds it.
        build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError>,
    },
    /// A filter, run after the built-in ones.
    Filter(fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Filter>, PluginError>),
    /// The picker.
    Picker(fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Picker>, PluginError>),
    /// Something kvpick always does its own way; accepted without a warning.
    Builtin,
}

/// One registered plugin type.
#[derive(Clone, Copy)]
pub struct Entry {
    /// The type name (`type:` in an `EndpointPickerConfig`).
    pub type_name: &'static str,
    /// What it is.
    pub kind: Kind,
}

const fn scorer(
    type_name: &'static str,
    term: &'static str,
    build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError>,
) -> Entry {
    Entry {
        type_name,
        kind: Kind::Scorer { term, build },
    }
}

const fn picker(
    type_name: &'static str,
    build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Picker>, PluginError>,
) -> Entry {
    Entry {
        type_name,
        kind: Kind::Picker(build),
    }
}

const fn builtin(type_name: &'static str) -> Entry {
    Entry {
        type_name,
        kind: Kind::Builtin,
    }
}

fn prefix(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError> {
    Ok(Arc::new(PrefixCache::from_config(a)?))
}
fn load(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError> {
    Ok(Arc::new(ActiveLoad::from_config(a)?))
}
fn queue(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError> {
    Ok(Arc::new(Queue::from_config(a)?))
}
fn kv_usage(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError> {
    Ok(Arc::new(KvUsage::from_config(a)?))
}
fn lora(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Scorer>, PluginError> {
    Ok(Arc::new(LoraAffinity::from_config(a)?))
}
fn max_score(a: &mut PluginArgs<'_>) -> Result<Arc<dyn Picker>, PluginError> {
    Ok(Arc::new(MaxScore::from_config(a)?))
}

/// Every plugin type kvpick reads (llm-d Router v0.10.0's names,
/// `cmd/epp/runner/runner.go` registrations, where kvpick has an equivalent).
pub static REGISTRY: &[Entry] = &[
    scorer("prefix-cache-scorer", "prefill", prefix),
    scorer("precise-prefix-cache-scorer", "prefill", prefix),
    scorer("active-request-scorer", "decode_load", load),
    scorer("load-aware-scorer", "decode_load", load),
    scorer("running-requests-size-scorer", "decode_load", load),
    scorer("token-load-scorer", "decode_load", load),
    scorer("queue-scorer", "queue", queue),
    scorer("kv-cache-utilization-scorer", "kv_usage", kv_usage),
    scorer("lora-affinity-scorer", "lora", lora),
    picker("max-score-picker", max_score),
    picker("random-picker", |a| {
        Ok(Arc::new(pickers::random::Random::from_config(a)?))
    }),
    // kvpick keeps sessions on their worker through signed session tokens.
    builtin("session-affinity-scorer"),
    builtin("session-affinity-filter"),
    builtin("session-id-producer"),
    builtin("single-profile-handler"),
    // Prefix state: kvpick's own index, fed by KV events where engines publish them.
    builtin("approx-prefix-cache-producer"),
    builtin("precise-prefix-cache-producer"),
    builtin("inflight-load-producer"),
    builtin("token-producer"),
    builtin("tokenizer"),
    // Request parsing and worker metrics: kvpick's parser and scraper.
    builtin("openai-parser"),
    builtin("vllmhttp-parser"),
    builtin("passthrough-parser"),
    builtin("metrics-data-source"),
    builtin("core-metrics-extractor"),
    builtin("endpoint-notification-source"),
    // Disaggregated prefill/decode: kvpick's kvpick.io/role labels.
    builtin("decode-filter"),
    builtin("prefill-filter"),
    builtin("disagg-profile-handler"),
    builtin("pd-profile-handler"),
    builtin("prefix-based-pd-decider"),
    builtin("always-disagg-pd-decider"),
];

/// The registered plugin type `type_name`.
pub fn lookup(type_name: &str) -> Option<&'static Entry> {
    REGISTRY.iter().find(|e| e.type_name == type_name)
}

/// What a plugin is built from.
#[derive(Debug)]
pub struct PluginArgs<'a> {
    /// The name the config refers to it by (for messages).
    pub reference: &'a str,
    /// Its term's weight (scorers): the flag weight scaled by the profile.
    pub weight: f64,
    /// Every term's weight, as mapped (a term may read another's, as the
    /// prefix term reads `prefill_overlap`).
    pub weights: Weights,
    /// `--temperature` (pickers).
    pub temperature: f64,
    /// Its `parameters`, if any.
    pub params: Option<&'a serde_json::Value>,
    /// Where to say what has no effect.
    pub warnings: &'a mut Vec<String>,
}

impl PluginArgs<'_> {
    /// Records a warning about this plugin.
    pub fn warn(&mut self, what: impl std::fmt::Display) {
        self.warnings.push(format!(
            "EndpointPickerConfig plugin {:?}: {what}",
            self.reference
        ));
    }

    /// A refused parameter value.
    pub fn invalid(&self, message: impl Into<String>) -> PluginError {
        PluginError::Invalid {
            plugin: self.reference.to_string(),
            message: message.into(),
        }
    }
}

/// Why a plugin could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// `parameters` is not a map.
    #[error("plugin {plugin:?}: parameters must be a map")]
    NotAMap {
        /// The plugin's reference.
        plugin: String,
    },
    /// A parameter has the wrong type.
    #[error("plugin {plugin:?}: parameters do not decode")]
    Params {
        /// The plugin's reference.
        plugin: String,
        /// What serde found.
        #[source]
        source: serde_json::Error,
    },
    /// A parameter has a value the plugin refuses.
    #[error("plugin {plugin:?}: {message}")]
    Invalid {
        /// The plugin's reference.
        plugin: String,
        /// What is wrong.
        message: String,
    },
}

/// Decodes a plugin's parameters into `P` strictly: wrong types are an error,
/// parameters `P` does not have are warned about (a field of `P` is one its
/// serialization names). No parameters: `P::default()`.
pub fn decode_params<P>(args: &mut PluginArgs<'_>) -> Result<P, PluginError>
where
    P: Serialize + DeserializeOwned + Default,
{
    let Some(value) = args.params.filter(|v| !v.is_null()) else {
        return Ok(P::default());
    };
    let Some(given) = value.as_object() else {
        return Err(PluginError::NotAMap {
            plugin: args.reference.to_string(),
        });
    };
    let params: P =
        serde_json::from_value(value.clone()).map_err(|source| PluginError::Params {
            plugin: args.reference.to_string(),
            source,
        })?;
    let read = serde_json::to_value(&params).unwrap_or_default();
    let read = read.as_object();
    for key in given.keys() {
        if !read.is_some_and(|r| r.contains_key(key)) {
            args.warn(format_args!(
                "parameter {key:?} is not read by kvpick; ignored"
            ));
        }
    }
    Ok(params)
}
