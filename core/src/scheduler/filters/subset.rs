//! The gateway's subset hint (`x-gateway-destination-endpoint-subset`): an
//! endpoint it does not name sits out. The hint itself (an empty match is an
//! error, a session bound outside it keeps its binding) is the pool's.

use std::sync::Arc;

use super::{Filter, FilterContext, FilterDecl};
use crate::endpoints::EndpointState;

/// Drops endpoints outside the subset hint.
#[derive(Debug, Clone, Copy, Default)]
pub struct Subset;

/// The declaration: built in.
pub static FILTER: FilterDecl = FilterDecl {
    name: "subset-filter",
    types: &[],
    build: |_| Ok(Arc::new(Subset)),
};

impl Filter for Subset {
    fn name(&self) -> &'static str {
        FILTER.name
    }

    fn reason(&self) -> &'static str {
        "not_in_subset"
    }

    fn applies(&self, at: &FilterContext<'_>) -> bool {
        at.subset.is_some()
    }

    fn admits(&self, at: &FilterContext<'_>, ep: &EndpointState) -> bool {
        at.subset
            .is_none_or(|s| s.binary_search(&ep.endpoint.address).is_ok())
    }
}
