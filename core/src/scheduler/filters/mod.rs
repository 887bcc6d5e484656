//! Filters: which endpoints may take part in a request's pick at all.
//!
//! A filter drops an endpoint for one request, whatever its cost (the llm-d
//! Router's `Filter`, Dynamo's routing eligibility). Each has a reason label
//! that `explain` shows for the endpoints it drops. A *yielding* filter (passive
//! health) is set aside for a pick in which it would leave no decode candidate
//! among the endpoints the other filters keep: then every one of those is tried
//! rather than none.
//!
//! Invariants: a filter is a pure function of the request and the endpoint's
//! state at the pick's instant (it books nothing), and [`Filter::applies`] is
//! asked once per pick, so a filter with nothing to drop for a request costs
//! nothing per endpoint.
//!
//! Adding a filter: one file here with a type implementing [`Filter`], its
//! `from_config` (parameters decoded strictly with
//! [`decode_params`](super::plugin::decode_params)) and its [`FilterDecl`]
//! naming the plugin types it answers to, and one line in
//! [`super::registry::REGISTRY`]; configured filters run after the built-ins.
//! The built-ins (declared with no type), always on (the Inference
//! Extension's contract), in the order they are asked:
//! - [`subset::Subset`]: the gateway's subset hint;
//! - [`body::PrefillNeedsBody`]: a prefill-only worker for a request without body;
//! - [`ejected::Ejected`]: passive health (yielding).

pub mod body;
pub mod ejected;
pub mod subset;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use super::plugin::{PluginArgs, PluginError};
use super::PickRequest;
use crate::endpoints::EndpointState;

/// A filter as its file declares it; the registry lists the declarations.
#[derive(Debug)]
pub struct FilterDecl {
    /// Its name ([`Filter::name`]).
    pub name: &'static str,
    /// The plugin types it stands for in an `EndpointPickerConfig`; none: a
    /// built-in filter, run by every scheduler before the configured ones.
    pub types: &'static [&'static str],
    /// Builds it.
    pub build: fn(&mut PluginArgs<'_>) -> Result<Arc<dyn Filter>, PluginError>,
}

impl FilterDecl {
    /// Whether every scheduler runs it (no plugin type configures it).
    pub fn builtin(&self) -> bool {
        self.types.is_empty()
    }
}

/// One filter.
pub trait Filter: Send + Sync + fmt::Debug {
    /// The plugin type name.
    fn name(&self) -> &'static str;

    /// Why an endpoint it drops sits out (`explain`'s `filtered_out`).
    fn reason(&self) -> &'static str;

    /// Whether it may drop anything for this request; asked once per pick
    /// (false: never asked about endpoints).
    fn applies(&self, _at: &FilterContext<'_>) -> bool {
        true
    }

    /// Whether it is set aside when it would leave no decode candidate.
    fn yields(&self) -> bool {
        false
    }

    /// Whether `ep` may take part in the request.
    fn admits(&self, at: &FilterContext<'_>, ep: &EndpointState) -> bool;
}

/// What the filters read about one pick.
#[derive(Debug, Clone, Copy)]
pub struct FilterContext<'a> {
    /// The request.
    pub req: &'a PickRequest<'a>,
    /// The subset hint's addresses, parsed and sorted once per pick.
    pub subset: Option<&'a [SocketAddr]>,
    /// The pick's instant, coded by [`Epoch::process`](crate::time::Epoch::process).
    pub now: i64,
}
