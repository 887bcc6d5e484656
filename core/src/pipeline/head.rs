//! The request headers the pipeline reads, and the routing headers kvpick owns.
//!
//! The protocol hands its headers over through [`Headers`] (a lookup by name and
//! the list of names), so no protocol type reaches the core. [`RequestHead`] is
//! what the rest of the request needs of them. Invariant: every routing header
//! the client sent is in [`RequestHead::spoofed`], so the answer removes or
//! overwrites it.

use crate::admission::priority::{FAIRNESS_ID_HEADER, OBJECTIVE_HEADER};
use crate::request::ApiKind;

/// The header (and `envoy.lb` metadata key) naming the destination endpoint.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Decode worker instance id.
pub const WORKER_ID_HEADER: &str = "x-worker-instance-id";
/// Decode worker data-parallel rank.
pub const DP_RANK_HEADER: &str = "x-dp-rank";
/// Prefill worker instance id (disaggregated pools).
pub const PREFILL_ID_HEADER: &str = "x-prefill-instance-id";
/// Prefill worker data-parallel rank (disaggregated pools).
pub const PREFILL_DP_RANK_HEADER: &str = "x-prefill-dp-rank";
/// Prefill bootstrap host (SGLang disaggregation).
pub const BOOTSTRAP_HOST_HEADER: &str = "x-prefill-bootstrap-host";
/// Prefill bootstrap port (SGLang disaggregation).
pub const BOOTSTRAP_PORT_HEADER: &str = "x-prefill-bootstrap-port";
/// Prefill bootstrap room (SGLang disaggregation).
pub const BOOTSTRAP_ROOM_HEADER: &str = "x-prefill-bootstrap-room";

/// Routing headers kvpick owns. Any of these the client sent is removed or
/// overwritten (and any header starting with [`DESTINATION_HEADER`]).
pub const ROUTING_HEADERS: &[&str] = &[
    DESTINATION_HEADER,
    WORKER_ID_HEADER,
    DP_RANK_HEADER,
    PREFILL_ID_HEADER,
    PREFILL_DP_RANK_HEADER,
    BOOTSTRAP_HOST_HEADER,
    BOOTSTRAP_PORT_HEADER,
    BOOTSTRAP_ROOM_HEADER,
];

/// Whether a request header name is a routing header kvpick must own (any case).
pub fn is_routing_header(name: &str) -> bool {
    let destination = name
        .get(..DESTINATION_HEADER.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(DESTINATION_HEADER));
    destination || ROUTING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// Request headers as a protocol delivers them.
pub trait Headers {
    /// The first value of header `name` (ASCII case-insensitive).
    fn get(&self, name: &str) -> Option<String>;
    /// Every header name, as sent.
    fn names(&self) -> impl Iterator<Item = &str>;
}

/// Plain `(name, value)` pairs.
impl Headers for [(&str, &str)] {
    fn get(&self, name: &str) -> Option<String> {
        self.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.to_string())
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.iter().map(|(k, _)| *k)
    }
}

/// What the request's headers tell the pipeline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    /// `:path`.
    pub path: String,
    /// The API the path names, if it names one.
    pub kind: Option<ApiKind>,
    /// `x-request-id`.
    pub request_id: Option<String>,
    /// The session header's value (non-empty).
    pub session_id: Option<String>,
    /// The session token header's value (non-empty).
    pub session_token: Option<String>,
    /// Routing headers the client sent, lowercased, sorted, once each.
    pub spoofed: Vec<String>,
    /// `x-gateway-inference-objective`.
    pub objective: Option<String>,
    /// `x-gateway-inference-fairness-id`.
    pub fairness_id: Option<String>,
    /// `content-length`, when the client sent a number.
    pub content_length: Option<usize>,
    /// `x-tenant-id`: the tenant salt, above the body's
    /// ([`crate::request::InferenceRequest::set_tenant`]).
    pub tenant: Option<String>,
    /// `x-slo-ttft-ms`: the time-to-first-token objective, in milliseconds.
    pub slo_ttft_ms: Option<u32>,
    /// `x-slo-tpot-ms`: the time-per-output-token objective, in milliseconds.
    pub slo_tpot_ms: Option<u32>,
}

/// The time-to-first-token objective header (llm-d's).
pub const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";
/// The time-per-output-token objective header (llm-d's).
pub const SLO_TPOT_HEADER: &str = "x-slo-tpot-ms";
/// Largest objective read from a header (one hour); a larger, zero or
/// unparsable value is ignored.
pub const MAX_SLO_MS: u32 = 3_600_000;

/// An objective header's value: whole milliseconds in `1..=MAX_SLO_MS`.
fn slo_ms(value: Option<String>) -> Option<u32> {
    value
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|ms| (1..=MAX_SLO_MS).contains(ms))
}

impl RequestHead {
    /// The request's latency objectives.
    pub fn slo(&self) -> crate::scheduler::Slo {
        let secs = |ms: Option<u32>| ms.map(|ms| f64::from(ms) / 1000.0);
        crate::scheduler::Slo {
            ttft: secs(self.slo_ttft_ms),
            tpot: secs(self.slo_tpot_ms),
        }
    }
}

/// The tenant whose salt seeds the prompt's block hashes, above the body's
/// `nvext.cache_salt` and `cache_salt`.
pub const TENANT_HEADER: &str = "x-tenant-id";

impl RequestHead {
    /// Reads `headers`; `session_header` and `session_token_header` name the
    /// headers carrying a session id and a signed session token.
    pub fn read(
        headers: &(impl Headers + ?Sized),
        session_header: &str,
        session_token_header: &str,
    ) -> Self {
        let path = headers.get(":path").unwrap_or_default();
        let mut spoofed: Vec<String> = headers
            .names()
            .filter(|name| is_routing_header(name))
            .map(str::to_ascii_lowercase)
            .collect();
        spoofed.sort();
        spoofed.dedup();
        RequestHead {
            kind: ApiKind::from_path(&path),
            path,
            request_id: headers.get("x-request-id"),
            session_id: headers.get(session_header).filter(|s| !s.is_empty()),
            session_token: headers.get(session_token_header).filter(|s| !s.is_empty()),
            spoofed,
            objective: headers.get(OBJECTIVE_HEADER),
            fairness_id: headers.get(FAIRNESS_ID_HEADER),
            content_length: headers.get("content-length").and_then(|v| v.parse().ok()),
            tenant: headers.get(TENANT_HEADER),
            slo_ttft_ms: slo_ms(headers.get(SLO_TTFT_HEADER)),
            slo_tpot_ms: slo_ms(headers.get(SLO_TPOT_HEADER)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_headers_are_known_in_any_case_without_panicking_on_any_name() {
        for name in [
            "x-gateway-destination-endpoint",
            "X-Gateway-Destination-Endpoint",
            "x-gateway-destination-endpoint-subset",
            "X-WORKER-INSTANCE-ID",
            "x-prefill-bootstrap-room",
        ] {
            assert!(is_routing_header(name), "{name}");
        }
        for name in [
            "",
            "x-worker",
            "content-length",
            "x-gateway-destination-endpoin",
            "x-gateway-destination-endpoinü",
            "ü-gateway-destination-endpoint",
        ] {
            assert!(!is_routing_header(name), "{name}");
        }
    }

    #[test]
    fn the_head_names_each_spoofed_routing_header_once_and_ignores_empty_sessions() {
        let headers: &[(&str, &str)] = &[
            (":path", "/v1/chat/completions"),
            ("X-Worker-Instance-Id", "7"),
            ("x-worker-instance-id", "8"),
            ("x-gateway-destination-endpoint-subset", "10.0.0.1:8000"),
            ("x-session-id", ""),
            ("x-kvpick-session", "tok"),
            ("Content-Length", "12"),
            ("x-gateway-inference-objective", "chat"),
        ];
        let head = RequestHead::read(headers, "x-session-id", "x-kvpick-session");
        assert_eq!(head.kind, Some(ApiKind::Chat));
        assert_eq!(
            head.spoofed,
            [
                "x-gateway-destination-endpoint-subset",
                "x-worker-instance-id"
            ]
        );
        assert_eq!(head.session_id, None);
        assert_eq!(head.session_token.as_deref(), Some("tok"));
        assert_eq!(head.content_length, Some(12));
        assert_eq!(head.objective.as_deref(), Some("chat"));
    }

    #[test]
    fn objectives_are_read_in_bounds_and_anything_else_is_ignored() {
        let read = |v: &str| {
            let headers: &[(&str, &str)] = &[("x-slo-ttft-ms", v), ("X-SLO-TPOT-MS", v)];
            let head = RequestHead::read(headers, "x-session-id", "x-kvpick-session");
            (head.slo_ttft_ms, head.slo_tpot_ms)
        };
        assert_eq!(read("250"), (Some(250), Some(250)));
        assert_eq!(read(" 40 "), (Some(40), Some(40)));
        for bad in ["0", "-5", "1.5", "99999999999", "3600001", "", "fast"] {
            assert_eq!(read(bad), (None, None), "{bad:?}");
        }
        let head = RequestHead {
            slo_ttft_ms: Some(250),
            ..RequestHead::default()
        };
        assert_eq!(head.slo().ttft, Some(0.25));
        assert_eq!(head.slo().tpot, None);
    }
}
