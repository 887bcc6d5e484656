//! A request without a body (e.g. `GET /v1/models`) has nothing to prefill: a
//! prefill-only worker sits out.

use super::{Filter, FilterContext};
use crate::endpoints::EndpointState;

/// Drops prefill-only workers for requests without a body.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillNeedsBody;

impl Filter for PrefillNeedsBody {
    fn name(&self) -> &'static str {
        "prefill-needs-body-filter"
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
