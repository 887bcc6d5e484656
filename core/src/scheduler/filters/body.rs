//! A request without a body (e.g. `GET /v1/models`) has nothing to prefill: a
//! prefill-only worker sits out.

use std::sync::Arc;

use super::{Filter, FilterContext, FilterDecl};
use crate::endpoints::EndpointState;

/// Drops prefill-only workers for requests without a body.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillNeedsBody;

/// The declaration: built in.
pub static FILTER: FilterDecl = FilterDecl {
    name: "prefill-needs-body-filter",
    types: &[],
    build: |_| Ok(Arc::new(PrefillNeedsBody)),
};

impl Filter for PrefillNeedsBody {
    fn name(&self) -> &'static str {
        FILTER.name
    }

    fn reason(&self) -> &'static str {
        "prefill_without_body"
    }

    fn applies(&self, at: &FilterContext<'_>) -> bool {
        at.req.body.is_none()
    }

    fn admits(&self, at: &FilterContext<'_>, ep: &EndpointState) -> bool {
        ep.serves_decode() || at.req.body.is_some()
    }
}
