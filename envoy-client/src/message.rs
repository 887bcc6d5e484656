//! `ProcessingRequest`s as Envoy's ext_proc filter sends them.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

use crate::{BodyMode, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE};

/// A header map with each value in `raw_value`, as Envoy fills it.
pub fn header_map<K: AsRef<str>, V: AsRef<[u8]>>(
    pairs: impl IntoIterator<Item = (K, V)>,
) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .into_iter()
            .map(|(k, v)| HeaderValue {
                key: k.as_ref().to_string(),
                value: String::new(),
                raw_value: v.as_ref().to_vec(),
            })
            .collect(),
    }
}

/// The request headers message, the first of every stream.
#[derive(Debug, Clone, Default)]
pub struct RequestHeaders {
    pairs: Vec<(String, Vec<u8>)>,
    end_of_stream: bool,
    mode: Option<BodyMode>,
    metadata: Option<Metadata>,
}

impl RequestHeaders {
    /// Exactly these headers (pseudo-headers included), nothing added.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        RequestHeaders {
            pairs: pairs
                .into_iter()
                .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_vec()))
                .collect(),
            ..Default::default()
        }
    }

    /// A JSON `POST` to `path` through host `gateway`: `:method`, `:path`,
    /// `:authority`, `:scheme`, `content-type`; a body follows.
    pub fn post(path: &str) -> Self {
        Self::from_pairs([
            (":method", "POST"),
            (":path", path),
            (":authority", "gateway"),
            (":scheme", "http"),
            ("content-type", "application/json"),
        ])
    }

    /// A `GET` of `path` with no body (the headers end the stream).
    pub fn get(path: &str) -> Self {
        Self::from_pairs([
            (":method", "GET"),
            (":path", path),
            (":authority", "gateway"),
            (":scheme", "http"),
        ])
        .end_of_stream(true)
    }

    /// Adds a header.
    pub fn header(mut self, key: &str, value: impl AsRef<[u8]>) -> Self {
        self.pairs.push((key.to_string(), value.as_ref().to_vec()));
        self
    }

    /// Adds headers.
    pub fn headers(self, pairs: &[(&str, &str)]) -> Self {
        pairs.iter().fold(self, |h, (k, v)| h.header(k, v))
    }

    /// Adds `content-length` (Envoy forwards the client's).
    pub fn content_length(self, bytes: usize) -> Self {
        self.header("content-length", bytes.to_string())
    }

    /// Whether the headers end the request (no body).
    pub fn end_of_stream(mut self, end_of_stream: bool) -> Self {
        self.end_of_stream = end_of_stream;
        self
    }

    /// Announces the body mode of both directions in `protocol_config`.
    pub fn mode(mut self, mode: BodyMode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Sets `metadata_context`.
    pub fn metadata(mut self, metadata: Metadata) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// The message.
    pub fn build(self) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(header_map(self.pairs)),
                end_of_stream: self.end_of_stream,
                ..Default::default()
            })),
            protocol_config: self.mode.map(|m| ProtocolConfiguration {
                request_body_mode: m.send_mode() as i32,
                response_body_mode: m.send_mode() as i32,
                ..Default::default()
            }),
            metadata_context: self.metadata,
            ..Default::default()
        }
    }
}

fn http_body(bytes: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// A request body chunk.
pub fn request_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    message(Request::RequestBody(http_body(bytes, end_of_stream)))
}

/// A response body chunk.
pub fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    message(Request::ResponseBody(http_body(bytes, end_of_stream)))
}

/// Response headers: `:status` then `pairs`.
pub fn response_headers(
    status: &str,
    pairs: &[(&str, &[u8])],
    end_of_stream: bool,
) -> ProcessingRequest {
    let all = std::iter::once((":status", status.as_bytes())).chain(pairs.iter().copied());
    message(Request::ResponseHeaders(HttpHeaders {
        headers: Some(header_map(all)),
        end_of_stream,
        ..Default::default()
    }))
}

/// Request trailers.
pub fn request_trailers(pairs: &[(&str, &str)]) -> ProcessingRequest {
    message(Request::RequestTrailers(HttpTrailers {
        trailers: Some(header_map(pairs.iter().copied())),
    }))
}

/// Response trailers.
pub fn response_trailers(pairs: &[(&str, &str)]) -> ProcessingRequest {
    message(Request::ResponseTrailers(HttpTrailers {
        trailers: Some(header_map(pairs.iter().copied())),
    }))
}

/// The pieces of at most `chunk` bytes `body` is sent in (one empty piece for
/// an empty body).
pub(crate) fn pieces(body: &[u8], chunk: usize) -> impl ExactSizeIterator<Item = &[u8]> {
    let chunk = chunk.max(1);
    let n = body.len().div_ceil(chunk).max(1);
    (0..n).map(move |i| &body[(i * chunk).min(body.len())..((i + 1) * chunk).min(body.len())])
}

/// `body` as body messages of at most `chunk` bytes, the last one ending the
/// stream; an empty body is one empty end-of-stream message.
pub fn body_chunks(
    body: &[u8],
    chunk: usize,
    response: bool,
) -> impl Iterator<Item = ProcessingRequest> + '_ {
    let all = pieces(body, chunk);
    let n = all.len();
    all.enumerate().map(move |(i, piece)| {
        if response {
            response_body(piece, i + 1 == n)
        } else {
            request_body(piece, i + 1 == n)
        }
    })
}

/// `metadata_context` carrying GIE's subset hint with `value` (a list of
/// addresses, or a comma-separated string).
pub fn subset_hint(value: Kind) -> Metadata {
    let mut md = Metadata::default();
    md.filter_metadata
        .insert(SUBSET_NAMESPACE.into(), one_field(SUBSET_KEY, value));
    md
}

/// The response's `metadata_context` naming the endpoint that served it
/// (`envoy.lb` / `x-gateway-destination-endpoint-served`, GIE's protocol).
pub fn served_endpoint(endpoint: &str) -> Metadata {
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        LB_NAMESPACE.into(),
        one_field(SERVED_KEY, Kind::StringValue(endpoint.into())),
    );
    md
}

/// A protobuf struct of one field.
pub fn one_field(key: &str, value: Kind) -> Struct {
    Struct {
        fields: [(key.to_string(), Value { kind: Some(value) })]
            .into_iter()
            .collect(),
    }
}

/// A list of strings as a protobuf value.
pub fn string_list<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> Kind {
    Kind::ListValue(ListValue {
        values: items
            .into_iter()
            .map(|s| Value {
                kind: Some(Kind::StringValue(s.as_ref().to_string())),
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(m: &ProcessingRequest) -> (&[u8], bool) {
        match &m.request {
            Some(Request::RequestBody(b)) | Some(Request::ResponseBody(b)) => {
                (&b.body, b.end_of_stream)
            }
            other => panic!("not a body: {other:?}"),
        }
    }

    #[test]
    fn chunks_cover_the_body_and_only_the_last_ends_it() {
        let body: Vec<u8> = (0..10u8).collect();
        let msgs: Vec<_> = body_chunks(&body, 4, false).collect();
        let parts: Vec<_> = msgs.iter().map(body_of).collect();
        assert_eq!(
            parts,
            vec![
                (&body[..4], false),
                (&body[4..8], false),
                (&body[8..], true)
            ]
        );
        let empty: Vec<_> = body_chunks(&[], 4, true).collect();
        assert_eq!(empty.len(), 1);
        assert!(matches!(
            &empty[0].request,
            Some(Request::ResponseBody(b)) if b.body.is_empty() && b.end_of_stream
        ));
    }

    #[test]
    fn request_headers_carry_mode_metadata_and_raw_values() {
        let m = RequestHeaders::post("/v1/completions")
            .content_length(12)
            .mode(BodyMode::Buffered)
            .metadata(subset_hint(string_list(["10.0.0.1:8000"])))
            .build();
        let Some(Request::RequestHeaders(h)) = &m.request else {
            panic!("{m:?}")
        };
        assert!(!h.end_of_stream);
        let headers = &h.headers.as_ref().unwrap().headers;
        assert_eq!(headers[1].key, ":path");
        assert_eq!(headers[1].raw_value, b"/v1/completions");
        assert!(headers[1].value.is_empty());
        assert_eq!(headers.last().unwrap().raw_value, b"12");
        let pc = m.protocol_config.unwrap();
        assert_eq!(pc.request_body_mode, pc.response_body_mode);
        assert_eq!(
            pc.request_body_mode,
            envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode::Buffered as i32
        );
        assert!(
            m.metadata_context.unwrap().filter_metadata[SUBSET_NAMESPACE]
                .fields
                .contains_key(SUBSET_KEY)
        );
        assert!(matches!(
            RequestHeaders::get("/v1/models").build().request,
            Some(Request::RequestHeaders(h)) if h.end_of_stream
        ));
    }
}
