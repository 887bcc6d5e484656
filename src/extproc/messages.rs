//! Builders for the ext_proc messages kvpick sends, and readers for the ones Envoy sends.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_response::Response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

/// Largest body chunk kvpick sends back in one `StreamedBodyResponse` (as the GIE EPP).
pub const MAX_CHUNK: usize = 62_000;

/// Dynamic-metadata namespace Envoy's ORIGINAL_DST load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace carrying the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key (header and metadata) naming the destination endpoint.
pub const DESTINATION_KEY: &str = crate::pipeline::DESTINATION_HEADER;
/// Key of the subset hint inside [`SUBSET_NAMESPACE`].
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// A header value from Envoy's map (Envoy sends `raw_value`; older versions `value`).
pub fn header_value(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// Looks up a header (names are lower-case in Envoy's map).
pub fn find_header(map: Option<&HeaderMap>, name: &str) -> Option<String> {
    map?.headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(header_value)
}

/// Envoy's request headers as the pipeline reads them.
pub struct EnvoyHeaders<'a>(pub Option<&'a HeaderMap>);

impl crate::pipeline::Headers for EnvoyHeaders<'_> {
    fn get(&self, name: &str) -> Option<String> {
        find_header(self.0, name)
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.0
            .into_iter()
            .flat_map(|m| m.headers.iter())
            .map(|h| h.key.as_str())
    }
}

/// A mutation replacing the whole body (buffered modes).
pub fn replace_body(body: Vec<u8>) -> BodyMutation {
    BodyMutation {
        mutation: Some(Mutation::Body(body)),
    }
}

/// An overwrite-or-add header option, value sent as `raw_value` as Envoy expects.
pub fn set_header(key: &str, value: impl Into<Vec<u8>>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.into(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// Overwrite-or-add options for `(name, value)` pairs.
pub fn set_headers<K: AsRef<str>, V: Into<Vec<u8>>>(
    pairs: impl IntoIterator<Item = (K, V)>,
) -> impl Iterator<Item = HeaderValueOption> {
    pairs.into_iter().map(|(k, v)| set_header(k.as_ref(), v))
}

/// The `envoy.lb` dynamic metadata naming the destination.
pub fn destination_metadata(address: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_KEY.to_string(),
            Value {
                kind: Some(Kind::StringValue(address.to_string())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// Key of the endpoint the gateway served the request from, in the
/// response's `envoy.lb` metadata.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// Where the gateway reports it served the request: the `envoy.lb`
/// metadata's [`SERVED_KEY`] of a response; `Err` says what is missing.
pub fn served_endpoint(metadata: Option<&Metadata>) -> Result<&str, ServedMissing> {
    let lb = metadata
        .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
        .ok_or(ServedMissing::LbMetadata)?;
    match lb.fields.get(SERVED_KEY).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(s)) => Ok(s),
        _ => Err(ServedMissing::ServedKey),
    }
}

/// What a response's metadata lacks to name the served endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedMissing {
    /// No `envoy.lb` metadata.
    LbMetadata,
    /// `envoy.lb` without [`SERVED_KEY`] (as a string).
    ServedKey,
}

/// Reads the subset hint: `Some(list)` when the gateway sent one (possibly empty),
/// `None` when it sent none. Accepts a list or a comma-separated string.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let ns = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = ns.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match &value.kind {
        Some(Kind::StringValue(s)) => split_addresses(s, &mut out),
        Some(Kind::ListValue(ListValue { values })) => {
            for v in values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    split_addresses(s, &mut out);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

fn split_addresses(s: &str, out: &mut Vec<String>) {
    out.extend(
        s.split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(String::from),
    );
}

/// A common response that continues with a header mutation.
pub fn common(mutation: Option<HeaderMutation>, clear_route_cache: bool) -> CommonResponse {
    CommonResponse {
        header_mutation: mutation,
        clear_route_cache,
        ..Default::default()
    }
}

/// Answer to request headers.
pub fn request_headers(common: CommonResponse, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Answer to response headers.
pub fn response_headers(mutation: Option<HeaderMutation>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse {
            response: Some(common(mutation, false)),
        })),
        ..Default::default()
    }
}

/// Answer to a (buffered or streamed-mode) body message.
pub fn body(
    common: CommonResponse,
    metadata: Option<Struct>,
    response_path: bool,
) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(common),
    };
    ProcessingResponse {
        response: Some(if response_path {
            Response::ResponseBody(body)
        } else {
            Response::RequestBody(body)
        }),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Full-duplex answers that stream `bytes` back in chunks of at most [`MAX_CHUNK`];
/// the last carries `end_of_stream`. An empty body still yields one (empty) chunk.
pub fn streamed_body(
    bytes: &[u8],
    end_of_stream: bool,
    response_path: bool,
) -> Vec<ProcessingResponse> {
    if bytes.is_empty() {
        return vec![streamed_chunk(&[], end_of_stream, response_path)];
    }
    let last = (bytes.len() - 1) / MAX_CHUNK;
    bytes
        .chunks(MAX_CHUNK)
        .enumerate()
        .map(|(i, chunk)| streamed_chunk(chunk, end_of_stream && i == last, response_path))
        .collect()
}

/// One full-duplex body answer carrying `chunk`.
fn streamed_chunk(chunk: &[u8], end_of_stream: bool, response_path: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: chunk.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
        }),
        ..Default::default()
    };
    body(common, None, response_path)
}

/// A whole request body streamed back lazily, one [`MAX_CHUNK`] answer at a
/// time, then the answers queued behind it: the body is never copied whole.
#[derive(Debug)]
pub struct Echo {
    body: Vec<u8>,
    sent: usize,
    started: bool,
    end_of_stream: bool,
    /// Answers that go after the body (e.g. the request trailers' answer).
    pub after: std::collections::VecDeque<ProcessingResponse>,
}

impl Echo {
    /// The request-path echo of `body`; the last chunk carries `end_of_stream`.
    pub fn new(body: Vec<u8>, end_of_stream: bool) -> Self {
        Echo {
            body,
            sent: 0,
            started: false,
            end_of_stream,
            after: Default::default(),
        }
    }
}

impl Iterator for Echo {
    type Item = ProcessingResponse;

    fn next(&mut self) -> Option<ProcessingResponse> {
        if !self.started || self.sent < self.body.len() {
            self.started = true;
            let end = (self.sent + MAX_CHUNK).min(self.body.len());
            let chunk = &self.body[self.sent..end];
            self.sent = end;
            let last = end == self.body.len();
            if last {
                // Nothing more to copy from: free the body before the last send.
                let msg = streamed_chunk(chunk, self.end_of_stream, false);
                self.body = Vec::new();
                self.sent = 0;
                return Some(msg);
            }
            return Some(streamed_chunk(chunk, false, false));
        }
        self.after.pop_front()
    }
}

/// The headers answer carrying a decision: its header `mutation`, and the
/// `envoy.lb` metadata naming `destination` (its endpoints, comma-separated).
pub fn routed_headers(mutation: HeaderMutation, destination: &str) -> ProcessingResponse {
    let metadata = Some(destination_metadata(destination));
    request_headers(common(Some(mutation), true), metadata)
}

/// [`routed_headers`] on the body answer (buffered modes), replacing the body
/// with `replacement` when there is one.
pub fn routed_body(
    mutation: HeaderMutation,
    destination: &str,
    replacement: Option<Vec<u8>>,
) -> ProcessingResponse {
    let mut common = common(Some(mutation), true);
    common.body_mutation = replacement.map(replace_body);
    body(common, Some(destination_metadata(destination)), false)
}

/// Answer to trailers (request or response path), passing them through.
pub fn trailers(response_path: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if response_path {
            Response::ResponseTrailers(t)
        } else {
            Response::RequestTrailers(t)
        }),
        ..Default::default()
    }
}

/// An immediate (local) reply with an OpenAI-style JSON error body.
pub fn immediate_error(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "code": status}
    });
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![set_header("content-type", "application/json")],
                ..Default::default()
            }),
            body: body.to_string().into_bytes(),
            details: format!("kvpick_{kind}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Adds header `key: value` to an immediate reply (nothing on other answers).
pub fn add_immediate_header(answer: &mut ProcessingResponse, key: &str, value: &str) {
    if let Some(Response::ImmediateResponse(ir)) = &mut answer.response {
        let headers = ir.headers.get_or_insert_with(Default::default);
        headers.set_headers.push(set_header(key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_bounded_and_lossless() {
        let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let msgs = streamed_body(&body, true, false);
        assert_eq!(msgs.len(), 4);
        let mut joined = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            let Some(Response::RequestBody(b)) = &m.response else {
                panic!()
            };
            let Some(Mutation::StreamedResponse(s)) = b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            else {
                panic!()
            };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 3);
            joined.extend_from_slice(&s.body);
        }
        assert_eq!(joined, body);
    }

    #[test]
    fn the_lazy_echo_matches_the_eager_one_then_sends_what_is_queued() {
        for len in [0, 1, MAX_CHUNK, MAX_CHUNK + 1, 200_000] {
            let body: Vec<u8> = (0..len as u32).map(|i| (i % 251) as u8).collect();
            for end_of_stream in [true, false] {
                let mut echo = Echo::new(body.clone(), end_of_stream);
                echo.after.push_back(trailers(false));
                let mut want = streamed_body(&body, end_of_stream, false);
                want.push(trailers(false));
                assert_eq!(echo.collect::<Vec<_>>(), want, "{len} {end_of_stream}");
            }
        }
    }

    #[test]
    fn subset_hint_forms() {
        let mut md = Metadata::default();
        assert_eq!(subset_hint(Some(&md)), None);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.1:80".into())),
                    },
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.2:80, 10.0.0.3:80".into())),
                    },
                ],
            })),
        };
        md.filter_metadata.insert(
            SUBSET_NAMESPACE.into(),
            Struct {
                fields: [(SUBSET_KEY.to_string(), list)].into_iter().collect(),
            },
        );
        assert_eq!(
            subset_hint(Some(&md)).unwrap(),
            vec!["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
        );
    }
}
