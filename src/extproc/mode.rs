//! How Envoy sends a body to kvpick: announced in `protocol_config`, or
//! inferred from what arrives.

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;

/// How Envoy sends the request (or response) body on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// Not announced and not yet inferred.
    Unknown,
    /// FULL_DUPLEX_STREAMED: chunks arrive without waiting; kvpick answers the
    /// headers after the last chunk and streams the body back.
    FullDuplex,
    /// BUFFERED, BUFFERED_PARTIAL or STREAMED: Envoy waits for the headers answer,
    /// then sends the body, one answer per body message.
    Buffered,
    /// NONE: the body is never sent to kvpick.
    None,
}

impl BodyMode {
    /// The mode a `protocol_config` announces.
    pub fn from_config(mode: i32) -> BodyMode {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(_) => BodyMode::Buffered,
            Err(_) => BodyMode::Unknown,
        }
    }

    /// The request mode once a body chunk arrives: an unknown one is buffered
    /// when Envoy already had the headers answer, full duplex otherwise.
    pub fn on_request_body(self, headers_answered: bool) -> BodyMode {
        match self {
            BodyMode::Unknown if headers_answered => BodyMode::Buffered,
            BodyMode::Unknown => BodyMode::FullDuplex,
            known => known,
        }
    }

    /// The response mode once a response body chunk arrives: an unknown one
    /// follows the request side (GIE configures both directions alike).
    pub fn on_response_body(self, request: BodyMode) -> BodyMode {
        match (self, request) {
            (BodyMode::Unknown, BodyMode::FullDuplex) => BodyMode::FullDuplex,
            (BodyMode::Unknown, _) => BodyMode::Buffered,
            (known, _) => known,
        }
    }
}
