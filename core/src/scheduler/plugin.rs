//! What every plugin is built from and declares: the arguments a plugin's
//! `from_config` reads ([`PluginArgs`]), why building one fails
//! ([`PluginError`]), the strict decoding of its parameters
//! ([`decode_params`]) and the number flags a declaration carries ([`Knob`],
//! [`Weight`]).
//!
//! The plugin files and the registry both depend on this module and on
//! nothing of each other's but the declarations: a plugin file declares
//! itself, the registry lists the declarations.
//!
//! Parameters are decoded strictly: a parameter of the wrong type or value is
//! refused with an error naming the plugin; one the plugin does not read is
//! named in a warning.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A number a command-line flag (and its environment variable) sets, as a
/// declaration carries it: the glue turns it into the flag.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knob {
    /// The long flag, without its dashes (`weight-decode`).
    pub flag: &'static str,
    /// The environment variable that sets it too.
    pub env: &'static str,
    /// Its value when neither is given.
    pub default: f64,
    /// The flag's help line.
    pub help: &'static str,
}

/// A cost term's weight: set by a flag, or fixed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Weight {
    /// Set by this flag. An `EndpointPickerConfig` scales it by the
    /// profile's ratios.
    Flag(Knob),
    /// This weight in the default plugin list; an `EndpointPickerConfig`
    /// scales a unit weight instead (the term has no flag to scale).
    Fixed(f64),
}

impl Weight {
    /// The weight of the default plugin list.
    pub fn default_value(&self) -> f64 {
        match self {
            Weight::Flag(k) => k.default,
            Weight::Fixed(w) => *w,
        }
    }
}

/// What a plugin is built from.
#[derive(Debug)]
pub struct PluginArgs<'a> {
    /// The name the config refers to it by (for messages).
    pub reference: &'a str,
    /// Its weight (terms): the flag weight, scaled by the profile.
    pub weight: f64,
    /// Its weight when a prefill worker of a disaggregated pool is picked
    /// (terms with a prefill-side weight; else [`PluginArgs::weight`]).
    pub prefill_weight: f64,
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
