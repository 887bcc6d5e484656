//! Passive health: an endpoint ejected after failed responses sits out
//! (see [`crate::health`]), unless every endpoint the request could use is
//! ejected: then all of them are tried rather than none (it yields).

use std::sync::Arc;

use super::{Filter, FilterContext, FilterDecl};
use crate::endpoints::EndpointState;

/// Drops passively ejected endpoints.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ejected;

/// The declaration: built in.
pub static FILTER: FilterDecl = FilterDecl {
    name: "passive-health-filter",
    types: &[],
    build: |_| Ok(Arc::new(Ejected)),
};

impl Filter for Ejected {
    fn name(&self) -> &'static str {
        FILTER.name
    }

    fn reason(&self) -> &'static str {
        "ejected"
    }

    fn yields(&self) -> bool {
        true
    }

    #[inline]
    fn admits(&self, at: &FilterContext<'_>, ep: &EndpointState) -> bool {
        ep.health().available_at(at.now)
    }
}
