//! Typed processor answers: what Envoy applies from each `ProcessingResponse`.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::service::ext_proc::v3::common_response::ResponseStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_response::Response, CommonResponse, HeaderMutation,
    ImmediateResponse, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct};

use crate::{ClientError, DESTINATION_KEY, LB_NAMESPACE};

/// The phase an answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `request_headers`
    RequestHeaders,
    /// `request_body`
    RequestBody,
    /// `request_trailers`
    RequestTrailers,
    /// `response_headers`
    ResponseHeaders,
    /// `response_body`
    ResponseBody,
    /// `response_trailers`
    ResponseTrailers,
}

impl Phase {
    /// The phase's proto field name.
    pub fn name(self) -> &'static str {
        match self {
            Phase::RequestHeaders => "request_headers",
            Phase::RequestBody => "request_body",
            Phase::RequestTrailers => "request_trailers",
            Phase::ResponseHeaders => "response_headers",
            Phase::ResponseBody => "response_body",
            Phase::ResponseTrailers => "response_trailers",
        }
    }
}

/// One header to set, with Envoy's append action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetHeader {
    /// Lower-case name (pseudo-headers such as `:path` included).
    pub key: String,
    /// The value (`raw_value`, else `value`).
    pub value: Vec<u8>,
    /// What to do when the header exists.
    pub action: HeaderAppendAction,
}

impl SetHeader {
    fn from_option(o: &HeaderValueOption) -> Option<Self> {
        let h = o.header.as_ref()?;
        Some(SetHeader {
            key: h.key.clone(),
            value: if h.raw_value.is_empty() {
                h.value.as_bytes().to_vec()
            } else {
                h.raw_value.clone()
            },
            action: HeaderAppendAction::try_from(o.append_action)
                .unwrap_or(HeaderAppendAction::AppendIfExistsOrAdd),
        })
    }
}

/// What an answer does to the body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BodyChange {
    /// Nothing: the body goes on as it is.
    #[default]
    Unchanged,
    /// The whole body is replaced (buffered modes).
    Replace(Vec<u8>),
    /// The body is cleared.
    Clear,
    /// A chunk of the body streamed back (full duplex).
    Streamed {
        /// The chunk.
        body: Vec<u8>,
        /// Whether it is the last.
        end_of_stream: bool,
    },
}

/// The mutations of one answer (or of several, merged in order).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Changes {
    /// `CONTINUE`, or `CONTINUE_AND_REPLACE` (the answer's body replaces the rest).
    pub status: ResponseStatus,
    /// Headers to set, in order.
    pub set: Vec<SetHeader>,
    /// Headers to remove.
    pub removed: Vec<String>,
    /// `clear_route_cache`.
    pub clear_route_cache: bool,
    /// The body mutation.
    pub body: BodyChange,
    /// `envoy.lb` / `x-gateway-destination-endpoint` of the dynamic metadata, as sent.
    pub metadata_destination: Option<String>,
}

impl Changes {
    /// The mutations of a phase's `CommonResponse` and the message's metadata.
    pub fn of(common: Option<&CommonResponse>, metadata: Option<&Struct>) -> Self {
        let mut c = Changes {
            metadata_destination: metadata_destination(metadata),
            ..Default::default()
        };
        if let Some(common) = common {
            c.status = ResponseStatus::try_from(common.status).unwrap_or_default();
            c.clear_route_cache = common.clear_route_cache;
            if let Some(m) = &common.header_mutation {
                c.add_header_mutation(m);
            }
            c.body = match common
                .body_mutation
                .as_ref()
                .and_then(|m| m.mutation.as_ref())
            {
                Some(Mutation::Body(b)) => BodyChange::Replace(b.clone()),
                Some(Mutation::ClearBody(true)) => BodyChange::Clear,
                Some(Mutation::StreamedResponse(s)) => BodyChange::Streamed {
                    body: s.body.clone(),
                    end_of_stream: s.end_of_stream,
                },
                _ => BodyChange::Unchanged,
            };
        }
        c
    }

    /// Adds a header mutation's sets and removals.
    pub fn add_header_mutation(&mut self, m: &HeaderMutation) {
        self.set
            .extend(m.set_headers.iter().filter_map(SetHeader::from_option));
        self.removed.extend(m.remove_headers.iter().cloned());
    }

    /// The first value set for `key`, as text.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.set
            .iter()
            .find(|h| h.key == key)
            .and_then(|h| std::str::from_utf8(&h.value).ok())
    }

    /// Adds a later answer's mutations: headers and removals appended, the
    /// route cache cleared if either clears it, the later status, body change
    /// and destination when they are not the defaults.
    pub fn merge(&mut self, later: Changes) {
        if later.status != ResponseStatus::Continue {
            self.status = later.status;
        }
        self.set.extend(later.set);
        self.removed.extend(later.removed);
        self.clear_route_cache |= later.clear_route_cache;
        if later.body != BodyChange::Unchanged {
            self.body = later.body;
        }
        if later.metadata_destination.is_some() {
            self.metadata_destination = later.metadata_destination;
        }
    }

    /// The endpoint ORIGINAL_DST routes to: the first of the metadata's
    /// comma-separated list, else the first of the header's (GIE's fallback).
    pub fn destination(&self) -> Option<&str> {
        self.metadata_destination
            .as_deref()
            .or_else(|| self.get(DESTINATION_KEY))
            .map(|list| list.split(',').next().unwrap_or(list).trim())
    }
}

/// The `envoy.lb` destination of a response's dynamic metadata, as sent.
pub fn metadata_destination(metadata: Option<&Struct>) -> Option<String> {
    let Some(Kind::StructValue(lb)) = metadata?.fields.get(LB_NAMESPACE)?.kind.as_ref() else {
        return None;
    };
    match lb.fields.get(DESTINATION_KEY)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// An immediate response: Envoy answers the client itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Immediate {
    /// HTTP status (200 when the processor set none).
    pub status: u16,
    /// Headers of the local reply.
    pub headers: Changes,
    /// The body.
    pub body: Vec<u8>,
}

impl Immediate {
    fn of(r: ImmediateResponse) -> Self {
        let mut headers = Changes::default();
        if let Some(m) = &r.headers {
            headers.add_header_mutation(m);
        }
        Immediate {
            status: r
                .status
                .and_then(|s| u16::try_from(s.code).ok())
                .filter(|c| *c > 0)
                .unwrap_or(200),
            headers,
            body: r.body,
        }
    }
}

/// One answer of the processor.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Go on with the phase, applying the changes.
    Continue(Phase, Changes),
    /// Stop and answer the client.
    Immediate(Immediate),
}

impl Answer {
    /// The typed form of `msg`; `None` when it answers nothing this client
    /// applies (empty, or a streamed immediate response).
    pub fn of(msg: ProcessingResponse) -> Option<Self> {
        let md = msg.dynamic_metadata.as_ref();
        let (phase, common) = match msg.response? {
            Response::ImmediateResponse(r) => return Some(Answer::Immediate(Immediate::of(r))),
            Response::RequestHeaders(h) => (Phase::RequestHeaders, h.response),
            Response::ResponseHeaders(h) => (Phase::ResponseHeaders, h.response),
            Response::RequestBody(b) => (Phase::RequestBody, b.response),
            Response::ResponseBody(b) => (Phase::ResponseBody, b.response),
            Response::RequestTrailers(t) => {
                let mut c = Changes::of(None, md);
                if let Some(m) = &t.header_mutation {
                    c.add_header_mutation(m);
                }
                return Some(Answer::Continue(Phase::RequestTrailers, c));
            }
            Response::ResponseTrailers(t) => {
                let mut c = Changes::of(None, md);
                if let Some(m) = &t.header_mutation {
                    c.add_header_mutation(m);
                }
                return Some(Answer::Continue(Phase::ResponseTrailers, c));
            }
            // Envoy's streamed local replies: kvpick sends none.
            Response::StreamedImmediateResponse(_) => return None,
        };
        Some(Answer::Continue(phase, Changes::of(common.as_ref(), md)))
    }

    /// The changes of a `phase` answer (`Ok(Ok(_))`), or the immediate
    /// response that came instead (`Ok(Err(_))`); an answer for another phase
    /// is an error.
    pub fn expect(self, phase: Phase) -> Result<Result<Changes, Immediate>, ClientError> {
        match self {
            Answer::Continue(p, c) if p == phase => Ok(Ok(c)),
            Answer::Immediate(i) => Ok(Err(i)),
            Answer::Continue(p, _) => Err(ClientError::Unexpected {
                expected: phase.name(),
                got: p.name().to_string(),
            }),
        }
    }
}

/// The body the request goes on with.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// Every request-path answer's changes, merged in order.
    pub changes: Changes,
    /// The body streamed back or replacing the client's (`None`: unchanged, or
    /// no body).
    pub body: Option<Vec<u8>>,
    /// Sizes of the chunks the body came back in (full duplex).
    pub chunks: Vec<usize>,
}

/// What the request path decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Forward upstream with these changes.
    Routed(Routed),
    /// Answer the client directly.
    Immediate(Immediate),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::one_field;
    use envoy_types::pb::envoy::config::core::v3::HeaderValue;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        BodyMutation, BodyResponse, HeadersResponse, StreamedBodyResponse,
    };

    fn lb(dest: &str) -> Struct {
        let inner = one_field(DESTINATION_KEY, Kind::StringValue(dest.into()));
        one_field(LB_NAMESPACE, Kind::StructValue(inner))
    }

    fn set(key: &str, value: &str, action: HeaderAppendAction, raw: bool) -> HeaderValueOption {
        HeaderValueOption {
            header: Some(HeaderValue {
                key: key.into(),
                value: if raw { String::new() } else { value.into() },
                raw_value: if raw {
                    value.as_bytes().to_vec()
                } else {
                    vec![]
                },
            }),
            append_action: action as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_headers_answer_becomes_its_changes_and_destination() {
        let msg = ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    clear_route_cache: true,
                    header_mutation: Some(HeaderMutation {
                        set_headers: vec![
                            set(
                                DESTINATION_KEY,
                                "10.0.0.9:8000",
                                HeaderAppendAction::OverwriteIfExistsOrAdd,
                                true,
                            ),
                            set("x-old", "v", HeaderAppendAction::AddIfAbsent, false),
                        ],
                        remove_headers: vec!["x-spoof".into()],
                    }),
                    ..Default::default()
                }),
            })),
            dynamic_metadata: Some(lb("10.0.0.1:8000, 10.0.0.2:8000")),
            ..Default::default()
        };
        let c = Answer::of(msg)
            .unwrap()
            .expect(Phase::RequestHeaders)
            .unwrap()
            .unwrap();
        assert!(c.clear_route_cache);
        assert_eq!(c.get(DESTINATION_KEY), Some("10.0.0.9:8000"));
        assert_eq!(
            c.get("x-old"),
            Some("v"),
            "value read when raw_value is empty"
        );
        assert_eq!(c.set[1].action, HeaderAppendAction::AddIfAbsent);
        assert_eq!(c.removed, vec!["x-spoof".to_string()]);
        assert_eq!(
            c.metadata_destination.as_deref(),
            Some("10.0.0.1:8000, 10.0.0.2:8000")
        );
        assert_eq!(c.destination(), Some("10.0.0.1:8000"), "metadata first");
        let header_only = Changes {
            metadata_destination: None,
            ..c
        };
        assert_eq!(header_only.destination(), Some("10.0.0.9:8000"));
    }

    #[test]
    fn body_answers_carry_their_mutation_and_other_phases_are_errors() {
        let streamed = ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                            body: b"abc".to_vec(),
                            end_of_stream: true,
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                }),
            })),
            ..Default::default()
        };
        let a = Answer::of(streamed).unwrap();
        assert!(matches!(
            a.clone().expect(Phase::ResponseBody),
            Err(ClientError::Unexpected {
                expected: "response_body",
                ..
            })
        ));
        let c = a.expect(Phase::RequestBody).unwrap().unwrap();
        assert_eq!(
            c.body,
            BodyChange::Streamed {
                body: b"abc".to_vec(),
                end_of_stream: true
            }
        );
        let mut merged = Changes::default();
        merged.merge(c);
        merged.merge(Changes::default());
        assert!(matches!(merged.body, BodyChange::Streamed { .. }));
        assert_eq!(Answer::of(ProcessingResponse::default()), None);
    }

    #[test]
    fn an_immediate_response_keeps_status_headers_and_body() {
        let msg = ProcessingResponse {
            response: Some(Response::ImmediateResponse(ImmediateResponse {
                status: Some(envoy_types::pb::envoy::r#type::v3::HttpStatus { code: 429 }),
                headers: Some(HeaderMutation {
                    set_headers: vec![set(
                        "x-reason",
                        "full",
                        HeaderAppendAction::OverwriteIfExistsOrAdd,
                        true,
                    )],
                    remove_headers: vec![],
                }),
                body: b"{}".to_vec(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let Ok(Err(i)) = Answer::of(msg).unwrap().expect(Phase::RequestBody) else {
            panic!("an immediate response")
        };
        assert_eq!(i.status, 429);
        assert_eq!(i.headers.get("x-reason"), Some("full"));
        assert_eq!(i.body, b"{}");
    }
}
