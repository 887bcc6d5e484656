//! GIE's conformance-test hooks, as its reference picker has them (on with
//! `--conformance-test-hooks`, off by default: any client could steer its own
//! requests with them).
//!
//! - The `test-epp-endpoint-selection` request header lists pod IPs (or
//!   `ip:port`s), comma-separated: only those endpoints are candidates (every
//!   target port of a listed pod, so data-parallel ports stay pickable). A list
//!   naming no known endpoint restricts nothing, as the reference picker falls
//!   back to the whole pool.
//! - The response gets `x-conformance-test-served-endpoint`: what the gateway
//!   reports in the response's `envoy.lb` / `x-gateway-destination-endpoint-served`
//!   metadata, never kvpick's own pick, so a gateway that ignores the pick fails;
//!   without that metadata the value is the reference picker's `fail: ...` text.

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;

use super::messages::{served_endpoint, ServedMissing};
use crate::endpoints::Snapshot;

/// Request header restricting the candidates to the listed endpoints.
pub const SELECTION_HEADER: &str = "test-epp-endpoint-selection";
/// Response header carrying the endpoint the gateway reports as served.
pub const SERVED_HEADER: &str = "x-conformance-test-served-endpoint";
pub use super::messages::SERVED_KEY;

/// The endpoints of `snapshot` the selection header's `value` names, as the
/// addresses a subset hint lists; `None` when it names none.
pub fn selected(value: &str, snapshot: &Snapshot) -> Option<Vec<String>> {
    let wanted: Vec<&str> = value.split(',').map(str::trim).collect();
    let named = |a: SocketAddr| {
        wanted.iter().any(|w| match w.parse::<SocketAddr>() {
            Ok(exact) => exact == a,
            Err(_) => w.parse::<IpAddr>().is_ok_and(|ip| ip == a.ip()),
        })
    };
    let out: Vec<String> = snapshot
        .endpoints
        .iter()
        .map(|e| e.endpoint.address)
        .filter(|a| named(*a))
        .map(|a| a.to_string())
        .collect();
    (!out.is_empty()).then_some(out)
}

/// The selection narrowed by the gateway's own subset hint, when both exist.
pub fn within(selected: Vec<String>, hint: Option<&[String]>) -> Vec<String> {
    match hint {
        None => selected,
        Some(hint) => selected.into_iter().filter(|a| hint.contains(a)).collect(),
    }
}

/// The served-endpoint header's value for a response with `metadata`.
pub fn served(metadata: Option<&Metadata>) -> String {
    match served_endpoint(metadata) {
        Ok(s) => s.to_string(),
        Err(ServedMissing::LbMetadata) => "fail: missing envoy lb metadata".into(),
        Err(ServedMissing::ServedKey) => {
            "fail: missing destination endpoint served metadata".into()
        }
    }
}
