//! The Envoy side of an ext_proc stream, for kvpick's loopback tests, the
//! e2e test gateway and the benchmarks: one client instead of a copy each.
//!
//! - [`message`] builds `ProcessingRequest`s as Envoy's ext_proc filter sends
//!   them: request headers with the pseudo-headers and `protocol_config`, body
//!   chunks, response headers, body and trailers, GIE's subset hint.
//! - [`EnvoyStream`] drives one stream: sends, awaits answers with Envoy's
//!   `message_timeout`, and runs the request and response paths in
//!   FULL_DUPLEX_STREAMED, BUFFERED or STREAMED body mode.
//! - [`answer`] turns a `ProcessingResponse` into a typed [`Answer`]: the
//!   header mutations, body change and destination of a phase, or an
//!   immediate response; [`Decision`] is what the request path decided.
//!
//! It builds every message from the Envoy protos itself and does not depend
//! on kvpick, so tests check kvpick against the protocol, not against its own
//! builders.

pub mod answer;
pub mod message;
mod stream;

pub use answer::{Answer, BodyChange, Changes, Decision, Immediate, Phase, Routed, SetHeader};
pub use stream::{Answers, EnvoyStream, RequestBody, ResponseOutcome};

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;

/// Dynamic-metadata namespace of the ORIGINAL_DST load balancer.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Key naming the destination (metadata key and header).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// Key (in [`LB_NAMESPACE`] of a response's metadata) of the endpoint that served it.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Metadata namespace of GIE's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// How Envoy sends a body to the processor (`ProcessingMode.BodySendMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// FULL_DUPLEX_STREAMED: chunks sent without waiting, the body streamed back
    /// (GIE's configuration).
    FullDuplex,
    /// BUFFERED: the whole body in one message, one answer.
    Buffered,
    /// STREAMED: chunks, one answer per chunk.
    Streamed,
}

impl BodyMode {
    /// The proto enum value.
    pub fn send_mode(self) -> BodySendMode {
        match self {
            BodyMode::FullDuplex => BodySendMode::FullDuplexStreamed,
            BodyMode::Buffered => BodySendMode::Buffered,
            BodyMode::Streamed => BodySendMode::Streamed,
        }
    }
}

/// Why a stream failed on the Envoy side.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The call failed or the processor ended it with an error status.
    #[error("ext_proc call failed")]
    Status(#[source] Box<tonic::Status>),
    /// The processor closed the stream (or its receiving side) early.
    #[error("ext_proc stream closed early")]
    Closed,
    /// No answer within Envoy's `message_timeout`.
    #[error("no ext_proc answer within {0:?}")]
    Timeout(std::time::Duration),
    /// An answer for another phase than the one Envoy waits for.
    #[error("expected a {expected} answer, got {got}")]
    Unexpected {
        /// The phase Envoy waits for.
        expected: &'static str,
        /// What came instead.
        got: String,
    },
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        ClientError::Status(Box::new(status))
    }
}
