//! Parsing OpenAI-style inference request bodies into what routing needs.
//!
//! Supports `/v1/chat/completions` (messages with string or content-part arrays),
//! `/v1/completions` (prompt string, string array, or token ids), and
//! `/v1/responses` (`input` string or message array), plus Dynamo's `nvext`
//! extension ([`nvext`]).
//!
//! [`parse`] reads the body once ([`parse`](self::parse) module): strings are
//! borrowed from the body while it runs, everything routing does not need is
//! skipped without being built, and no `serde_json::Value` tree is made. A key
//! that appears twice among the fields routing reads is a 400, so kvpick and the
//! engine cannot disagree about which copy counts. [`InferenceRequest::rewrite_body`]
//! edits `nvext` in place ([`NvExtEdit`]); kvpick always removes the fields that
//! name a worker ([`CLIENT_WORKER_FIELDS`]) before forwarding.
//!
//! Limits checked while parsing (a 400 naming the field):
//! `nvext.session_control.session_id` is 1..=[`MAX_SESSION_ID_BYTES`] (256) bytes;
//! `nvext.session_control.timeout` is
//! [`MIN_SESSION_TIMEOUT_SECS`]..=[`MAX_SESSION_TIMEOUT_SECS`] (1..=86,400) seconds.

pub mod nvext;
mod parse;
mod rewrite;
pub mod usage;

pub use nvext::{
    AgentHints, NvExt, SessionAction, SessionControl, CLIENT_WORKER_FIELDS,
    DEFAULT_SESSION_TIMEOUT_SECS, MAX_SESSION_ID_BYTES, MAX_SESSION_TIMEOUT_SECS,
    MIN_SESSION_TIMEOUT_SECS,
};
pub use rewrite::NvExtEdit;

/// Why a body is not a usable inference request. The message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON at all.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// A field is missing, empty, repeated, out of range, or of the wrong type.
    #[error("invalid field `{field}`: {reason}")]
    Field {
        /// JSON path of the field, e.g. `messages[2].content`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Which OpenAI API the request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/v1/responses`
    Responses,
}

impl ApiKind {
    /// The API for a request path (query string ignored); `None` for other paths.
    pub fn from_path(path: &str) -> Option<ApiKind> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(ApiKind::Chat)
        } else if path.ends_with("/completions") {
            Some(ApiKind::Completions)
        } else if path.ends_with("/responses") {
            Some(ApiKind::Responses)
        } else {
            None
        }
    }
}

/// One piece of the prompt, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Prompt text (chat messages are rendered as `role\ncontent\n`).
    Text(String),
    /// Token ids given directly by the client.
    Tokens(Vec<u32>),
    /// An image, by URL or data URL.
    Image(String),
}

/// A parsed inference request: what routing needs from the body.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest {
    /// The API the body follows.
    pub kind: ApiKind,
    /// `model` (may name a LoRA adapter).
    pub model: String,
    /// The prompt, in order.
    pub segments: Vec<Segment>,
    /// Whether the client asked for a streamed (SSE) reply.
    pub stream: bool,
    /// The `nvext` extension, if any.
    pub nvext: NvExt,
    /// The tenant salt the prompt's block hashes are seeded with
    /// ([`crate::kv::hash::request_seed`]): the body's `nvext.cache_salt`, else
    /// its `cache_salt`; the ext_proc layer puts the `x-tenant-id` header above
    /// both ([`InferenceRequest::set_tenant`]).
    pub salt: Option<String>,
    /// Whether `nvext` names a worker (and the body must be rewritten).
    pub names_worker: bool,
    /// Prompt token ids past the parse limit ([`parse_capped`]): counted, not kept.
    pub omitted_tokens: usize,
    /// Prompt text bytes past the parse limit: counted, not kept.
    pub omitted_text_bytes: usize,
    /// The output-token cap the body asks for: `max_completion_tokens`, else
    /// `max_tokens`, else `max_output_tokens` (Responses), when it is a
    /// positive integer; any other value reads as none (the engine judges it).
    pub max_output_tokens: Option<u32>,
    /// What a tokenizer needs to render the prompt, when parsed with
    /// [`ParseOptions::template`].
    pub template: Option<TemplateInput>,
}

/// The prompt as a tokenizer renders it: everything the chat template reads,
/// kept by the parse so the body is not read again. Only built when asked
/// ([`ParseOptions::template`]), so a picker without a tokenizer pays nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateInput {
    /// Chat messages (a Responses body's `instructions` and `input` as messages).
    Chat(ChatInput),
    /// A completions prompt, item by item (the tokenizer adds BOS per string).
    Prompt(Vec<PromptPart>),
}

/// A chat body as its template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatInput {
    /// The messages, in order.
    pub messages: Vec<TemplateMessage>,
    /// `tools`, as its JSON text.
    pub tools: Option<String>,
    /// `chat_template_kwargs`, as its JSON text (chat completions only).
    pub chat_template_kwargs: Option<String>,
}

/// One message: every field in body order (a repeated key keeps each copy, in
/// order, as a JSON object read from the body would keep the last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateMessage {
    /// The fields, by key.
    pub fields: Vec<(String, MessageField)>,
}

/// A message field's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageField {
    /// JSON `null`.
    Null,
    /// A string (`role`, string `content`).
    Text(String),
    /// A content-part array.
    Parts(Vec<ContentPart>),
    /// Any other field (`name`, `tool_call_id`, `tool_calls`, …) as its JSON text.
    Json(String),
}

/// One content part as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentPart {
    /// A text part's text (an empty string for a part without text).
    Text(String),
    /// An image part's URL.
    Image(String),
}

/// One item of a completions prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptPart {
    /// A string item, encoded on its own.
    Text(String),
    /// Token ids (neighbouring arrays merged; capped like the segments).
    Tokens(Vec<u32>),
}

/// How [`parse_with`] reads a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// How much of the prompt is kept (see [`parse_capped`]).
    pub limits: PromptLimits,
    /// Also keep the [`TemplateInput`] (a tokenizer is configured).
    pub template: bool,
}

/// How much of a prompt a parse keeps: prefix matching hashes no more, and
/// what lies past it is only counted ([`InferenceRequest::omitted_tokens`],
/// [`InferenceRequest::omitted_text_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimits {
    /// Prompt token ids kept.
    pub tokens: usize,
    /// Bytes of prompt text kept.
    pub text_bytes: usize,
}

impl PromptLimits {
    /// Everything kept.
    pub const NONE: PromptLimits = PromptLimits {
        tokens: usize::MAX,
        text_bytes: usize::MAX,
    };
}

impl InferenceRequest {
    /// Total prompt size in bytes of text (tokens count 4 bytes, images their URL).
    pub fn prompt_len(&self) -> usize {
        self.segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len(),
                Segment::Tokens(t) => t.len() * 4,
                Segment::Image(u) => u.len(),
            })
            .sum::<usize>()
            .saturating_add(self.omitted_tokens.saturating_mul(4))
            .saturating_add(self.omitted_text_bytes)
    }

    /// Blocks of the prompt the parse only counted (past [`PromptLimits`]),
    /// for text blocks of `byte_block` bytes and token blocks of `token_block` ids.
    pub fn unhashed_blocks(&self, byte_block: usize, token_block: usize) -> usize {
        self.omitted_tokens.div_ceil(token_block.max(1))
            + self.omitted_text_bytes.div_ceil(byte_block.max(1))
    }

    /// The session control, if the body has one.
    pub fn session(&self) -> Option<&SessionControl> {
        self.nvext.session_control.as_ref()
    }

    /// Puts the `x-tenant-id` header's value above the body's salts (Dynamo's
    /// precedence); an empty header changes nothing.
    pub fn set_tenant(&mut self, tenant: Option<&str>) {
        if let Some(t) = tenant.filter(|t| !t.is_empty()) {
            self.salt = Some(t.to_string());
        }
    }
}

/// Parses a request body. `kind` comes from the path; when the path is unknown the
/// body's shape decides (`messages` → chat, `prompt` → completions, `input` → responses).
pub fn parse(body: &[u8], kind: Option<ApiKind>) -> Result<InferenceRequest, RequestError> {
    parse_capped(body, kind, PromptLimits::NONE)
}

/// [`parse`] keeping at most `limits` of the prompt's token ids and text
/// (prefix matching looks at no more): the rest is only counted, so a prompt
/// of millions of ids or megabytes of text is not copied whole.
pub fn parse_capped(
    body: &[u8],
    kind: Option<ApiKind>,
    limits: PromptLimits,
) -> Result<InferenceRequest, RequestError> {
    parse_with(
        body,
        kind,
        ParseOptions {
            limits,
            template: false,
        },
    )
}

/// [`parse`] with options: the token cap, and whether to keep the
/// [`TemplateInput`] a tokenizer renders from.
pub fn parse_with(
    body: &[u8],
    kind: Option<ApiKind>,
    options: ParseOptions,
) -> Result<InferenceRequest, RequestError> {
    parse::parse_body(body, kind, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_field(body: &str, kind: Option<ApiKind>) -> String {
        match parse(body.as_bytes(), kind).unwrap_err() {
            RequestError::Field { field, .. } => field,
            RequestError::InvalidJson(_) => "<json>".into(),
        }
    }

    #[test]
    fn the_tenant_salt_follows_dynamos_precedence() {
        let salt = |extra: &str| {
            let body = format!(r#"{{"model":"m","prompt":"p"{extra}}}"#);
            parse(body.as_bytes(), None).unwrap().salt
        };
        assert_eq!(salt(""), None);
        assert_eq!(salt(r#","cache_salt":null"#), None);
        assert_eq!(salt(r#","cache_salt":"a""#).as_deref(), Some("a"));
        assert_eq!(salt(r#","nvext":{"cache_salt":"b"}"#).as_deref(), Some("b"));
        let both = r#","cache_salt":"a","nvext":{"cache_salt":"b"}"#;
        assert_eq!(salt(both).as_deref(), Some("b"), "nvext over the body");
        let mut r = parse(
            format!(r#"{{"model":"m","prompt":"p"{both}}}"#).as_bytes(),
            None,
        )
        .unwrap();
        r.set_tenant(Some(""));
        assert_eq!(r.salt.as_deref(), Some("b"), "an empty header is none");
        r.set_tenant(Some("c"));
        assert_eq!(r.salt.as_deref(), Some("c"), "the header over both");
        // vLLM refuses an empty salt; a repeated one is ambiguous.
        for (bad, field) in [
            (
                r#"{"model":"m","prompt":"p","cache_salt":""}"#,
                "cache_salt",
            ),
            (r#"{"model":"m","prompt":"p","cache_salt":5}"#, "cache_salt"),
            (
                r#"{"model":"m","prompt":"p","nvext":{"cache_salt":""}}"#,
                "nvext.cache_salt",
            ),
            (
                r#"{"model":"m","prompt":"p","cache_salt":"a","cache_salt":"b"}"#,
                "cache_salt",
            ),
        ] {
            assert_eq!(err_field(bad, None), field, "{bad}");
        }
    }

    #[test]
    fn chat_with_string_and_parts() {
        let body = r#"{"model":"m","stream":true,"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"look"},
              {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},
              {"type":"text","text":"what is it?"}]}]}"#;
        let r = parse(body.as_bytes(), Some(ApiKind::Chat)).unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream);
        assert_eq!(
            r.segments,
            vec![
                Segment::Text("system\nbe brief\nuser\nlook".into()),
                Segment::Image("data:image/png;base64,AAAA".into()),
                Segment::Text("what is it?\n".into()),
            ]
        );
    }

    #[test]
    fn completions_prompt_forms() {
        let r = parse(br#"{"model":"m","prompt":"hi"}"#, None).unwrap();
        assert_eq!(r.kind, ApiKind::Completions);
        assert_eq!(r.segments, vec![Segment::Text("hi".into())]);
        let r = parse(br#"{"model":"m","prompt":["a","b"]}"#, None).unwrap();
        assert_eq!(r.segments, vec![Segment::Text("ab".into())]);
        let r = parse(br#"{"model":"m","prompt":[1,2,3]}"#, None).unwrap();
        assert_eq!(r.segments, vec![Segment::Tokens(vec![1, 2, 3])]);
    }

    #[test]
    fn responses_input() {
        let r = parse(
            br#"{"model":"m","instructions":"sys","input":"hello"}"#,
            Some(ApiKind::Responses),
        )
        .unwrap();
        assert_eq!(r.segments, vec![Segment::Text("system\nsys\nhello".into())]);
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(err_field("{", None), "<json>");
        assert_eq!(err_field("[]", None), "$");
        assert_eq!(
            err_field(r#"{"messages":[{"content":"x"}]}"#, None),
            "model"
        );
        assert_eq!(
            err_field(r#"{"model":"m","messages":[]}"#, None),
            "messages"
        );
        assert_eq!(
            err_field(
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                None
            ),
            "messages[0].content"
        );
        assert_eq!(err_field(r#"{"model":"m","prompt":7}"#, None), "prompt");
        assert_eq!(
            err_field(r#"{"model":"m"}"#, Some(ApiKind::Chat)),
            "messages"
        );
        assert_eq!(
            err_field(r#"{"model":"m","prompt":"x","stream":"yes"}"#, None),
            "stream"
        );
        assert_eq!(
            err_field(
                r#"{"model":"m","prompt":"x","nvext":{"session_control":{"session_id":""}}}"#,
                None
            ),
            "nvext.session_control.session_id"
        );
    }

    #[test]
    fn session_control_and_worker_fields() {
        let body = br#"{"model":"m","prompt":"x","nvext":{"session_control":{"session_id":"s1","action":"open","timeout":60},"backend_instance_id":42}}"#;
        let mut r = parse(body, None).unwrap();
        let sc = r.session().unwrap().clone();
        assert_eq!(sc.session_id, "s1");
        assert_eq!(sc.action, Some(SessionAction::Open));
        assert_eq!(sc.timeout_secs(), 60);
        assert!(r.names_worker);
        let clean = r
            .rewrite_body(body, &NvExtEdit::strip_client_routing())
            .unwrap()
            .unwrap();
        assert!(!r.names_worker);
        let again = parse(&clean, None).unwrap();
        assert!(!again.names_worker);
        assert_eq!(again.session().unwrap().session_id, "s1");
    }

    #[test]
    fn api_kind_from_path() {
        assert_eq!(
            ApiKind::from_path("/v1/chat/completions?x=1"),
            Some(ApiKind::Chat)
        );
        assert_eq!(
            ApiKind::from_path("/v1/completions"),
            Some(ApiKind::Completions)
        );
        assert_eq!(
            ApiKind::from_path("/v1/responses"),
            Some(ApiKind::Responses)
        );
        assert_eq!(ApiKind::from_path("/v1/models"), None);
    }

    fn field_of(body: &str) -> (String, String) {
        match parse(body.as_bytes(), None).unwrap_err() {
            RequestError::Field { field, reason } => (field, reason),
            e => panic!("not a field error: {e}"),
        }
    }

    fn with_nvext(nvext: &str) -> String {
        format!(r#"{{"model":"m","prompt":"x","nvext":{nvext}}}"#)
    }

    #[test]
    fn duplicate_routing_keys_are_rejected() {
        for (body, field) in [
            (r#"{"model":"a","model":"b","prompt":"x"}"#, "model"),
            (r#"{"model":"m","prompt":"x","prompt":"y"}"#, "prompt"),
            (
                r#"{"model":"m","prompt":"x","nvext":{},"nvext":{"backend_instance_id":1}}"#,
                "nvext",
            ),
            (
                r#"{"model":"m","prompt":"x","nvext":{"session_control":{"session_id":"a","session_id":"b"}}}"#,
                "nvext.session_control.session_id",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"a","content":"b"}]}"#,
                "messages[0].content",
            ),
        ] {
            let (f, reason) = field_of(body);
            assert_eq!(f, field, "{body}");
            assert!(reason.contains("duplicate"), "{reason}");
        }
    }

    #[test]
    fn duplicate_worker_fields_are_all_removed() {
        // Repeated, escaped and null-valued copies: none survives the rewrite.
        let body = with_nvext(
            r#"{"backend_instance_id":1,"x":true,"backend_instance_id":2,"backend\u005finstance_id":3,"decode_worker_id":4,"prefill_worker_id":5,"dp_rank":6,"prefill_dp_rank":7,"session_control":{"session_id":"s"}}"#,
        );
        let mut r = parse(body.as_bytes(), None).unwrap();
        assert!(r.names_worker);
        let clean = r
            .rewrite_body(body.as_bytes(), &NvExtEdit::strip_client_routing())
            .unwrap()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&clean).unwrap();
        assert_eq!(
            v["nvext"],
            serde_json::json!({"x": true, "session_control": {"session_id": "s"}})
        );
        assert_eq!(v["prompt"], "x");
        assert!(!r.names_worker);
        // The request follows the new body: a second edit finds nvext again.
        let again = r
            .rewrite_body(
                &clean,
                &NvExtEdit::default().session_action(SessionAction::Open),
            )
            .unwrap()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&again).unwrap();
        assert_eq!(v["nvext"]["session_control"]["action"], "open");
        assert_eq!(r.session().unwrap().action, Some(SessionAction::Open));
    }

    #[test]
    fn rewrite_leaves_clean_bodies_alone_and_can_add_fields() {
        let body = with_nvext(r#"{"session_control":{"session_id":"s","action":"close"}}"#);
        let mut r = parse(body.as_bytes(), None).unwrap();
        assert_eq!(
            r.rewrite_body(body.as_bytes(), &NvExtEdit::strip_client_routing())
                .unwrap(),
            None
        );
        let plain = br#"{"model":"m","prompt":"x"}"#;
        let mut r = parse(plain, None).unwrap();
        assert_eq!(
            r.rewrite_body(plain, &NvExtEdit::strip_client_routing())
                .unwrap(),
            None
        );
        let added = r
            .rewrite_body(plain, &NvExtEdit::default().set("mm_hashes", &[1u64, 2]))
            .unwrap()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&added).unwrap();
        assert_eq!(v["nvext"]["mm_hashes"], serde_json::json!([1, 2]));
        assert_eq!(
            r.nvext.span.clone().map(|s| &added[s]),
            Some(&br#"{"mm_hashes":[1,2]}"#[..])
        );
    }

    #[test]
    fn session_limits() {
        let long = "s".repeat(MAX_SESSION_ID_BYTES + 1);
        let ok = "s".repeat(MAX_SESSION_ID_BYTES);
        let sc = |inner: &str| with_nvext(&format!(r#"{{"session_control":{{{inner}}}}}"#));
        assert!(parse(sc(&format!(r#""session_id":"{ok}""#)).as_bytes(), None).is_ok());
        for (inner, field) in [
            (
                format!(r#""session_id":"{long}""#),
                "nvext.session_control.session_id",
            ),
            (
                r#""session_id":"""#.to_string(),
                "nvext.session_control.session_id",
            ),
            (
                r#""action":"open""#.to_string(),
                "nvext.session_control.session_id",
            ),
            (
                r#""session_id":"s","timeout":0"#.to_string(),
                "nvext.session_control.timeout",
            ),
            (
                r#""session_id":"s","timeout":86401"#.to_string(),
                "nvext.session_control.timeout",
            ),
            (
                r#""session_id":"s","timeout":-5"#.to_string(),
                "nvext.session_control.timeout",
            ),
            (
                r#""session_id":"s","action":"pause""#.to_string(),
                "nvext.session_control.action",
            ),
        ] {
            assert_eq!(field_of(&sc(&inner)).0, field, "{inner}");
        }
        for t in [MIN_SESSION_TIMEOUT_SECS, MAX_SESSION_TIMEOUT_SECS] {
            let r = parse(
                sc(&format!(r#""session_id":"s","timeout":{t}"#)).as_bytes(),
                None,
            )
            .unwrap();
            assert_eq!(r.session().unwrap().timeout_secs(), t);
        }
        let r = parse(sc(r#""session_id":"s","action":null"#).as_bytes(), None).unwrap();
        assert_eq!(
            r.session().unwrap().timeout_secs(),
            DEFAULT_SESSION_TIMEOUT_SECS
        );
        assert_eq!(r.session().unwrap().action, None);
    }

    #[test]
    fn each_nvext_field() {
        let body = with_nvext(
            r#"{"session_control":{"session_id":"s","action":"close","timeout":60,"extra":1},
                "agent_hints":{"priority":-2,"osl":128,"speculative_prefill":true,"latency_sensitivity":0.5,"future_hint":{"a":1}},
                "token_data":[5,6,7],"use_raw_prompt":true,"backend_instance_id":11,
                "decode_worker_id":12,"prefill_worker_id":13,"dp_rank":3,"prefill_dp_rank":4,
                "annotations":["x"],"greed_sampling":true}"#,
        );
        let r = parse(body.as_bytes(), None).unwrap();
        let nv = &r.nvext;
        assert_eq!(
            nv.session_control,
            Some(SessionControl {
                session_id: "s".into(),
                action: Some(SessionAction::Close),
                timeout: Some(60),
            })
        );
        assert_eq!(
            nv.agent_hints,
            Some(AgentHints {
                priority: Some(-2),
                osl: Some(128),
                speculative_prefill: Some(true),
                latency_sensitivity: Some(0.5),
            })
        );
        assert_eq!(nv.token_data, Some(vec![5, 6, 7]));
        assert_eq!(nv.use_raw_prompt, Some(true));
        assert_eq!(nv.backend_instance_id, Some(11));
        assert_eq!(nv.decode_worker_id, Some(12));
        assert_eq!(nv.prefill_worker_id, Some(13));
        assert_eq!(nv.dp_rank, Some(3));
        assert_eq!(nv.prefill_dp_rank, Some(4));
        let span = nv.span.clone().unwrap();
        assert!(body[span].starts_with("{\"session_control\""));
        for (nvext, field) in [
            (
                r#"{"agent_hints":{"priority":"high"}}"#,
                "nvext.agent_hints",
            ),
            (r#"{"token_data":[1,-1]}"#, "nvext.token_data"),
            (r#"{"use_raw_prompt":"yes"}"#, "nvext.use_raw_prompt"),
            (r#"{"dp_rank":-1}"#, "nvext.dp_rank"),
            (r#"{"prefill_dp_rank":4294967296}"#, "nvext.prefill_dp_rank"),
            (
                r#"{"backend_instance_id":"w1"}"#,
                "nvext.backend_instance_id",
            ),
            (r#"{"decode_worker_id":1.5}"#, "nvext.decode_worker_id"),
            (r#"{"prefill_worker_id":[]}"#, "nvext.prefill_worker_id"),
            (r#"[1]"#, "nvext"),
        ] {
            assert_eq!(field_of(&with_nvext(nvext)).0, field, "{nvext}");
        }
        let r = parse(with_nvext("null").as_bytes(), None).unwrap();
        assert_eq!(r.nvext, NvExt::default());
    }

    #[test]
    fn prompt_shapes_and_token_errors() {
        let r = parse(br#"{"model":"m","prompt":[[1,2],"ab",[3]]}"#, None).unwrap();
        assert_eq!(
            r.segments,
            vec![
                Segment::Tokens(vec![1, 2]),
                Segment::Text("ab".into()),
                Segment::Tokens(vec![3])
            ]
        );
        assert_eq!(field_of(r#"{"model":"m","prompt":["a",1]}"#).0, "prompt[1]");
        assert_eq!(field_of(r#"{"model":"m","prompt":[1,-1]}"#).0, "prompt");
        assert_eq!(
            field_of(r#"{"model":"m","prompt":[4294967296]}"#).0,
            "prompt[0]"
        );
        assert_eq!(field_of(r#"{"model":"m","prompt":[]}"#).0, "prompt");
        // Escaped strings are decoded; tool calls and unknown parts are kept as JSON.
        let r = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\nb"},{"type":"input_audio","input_audio":{"data":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#,
            None,
        )
        .unwrap();
        assert_eq!(
            r.segments,
            vec![Segment::Text(
                "user\na\nb{\"type\":\"input_audio\",\"input_audio\":{\"data\":\"x\"}}\nassistant\n[{\"id\":\"1\"}]\n".into()
            )]
        );
        assert_eq!(
            field_of(
                r#"{"model":"m","messages":[{"content":[{"type":"image_url","image_url":{}}]}]}"#
            )
            .0,
            "messages[0].content[0].image_url.url"
        );
        assert_eq!(
            field_of(r#"{"model":"m","messages":[{"content":[{"type":"text"}]}]}"#).0,
            "messages[0].content[0].text"
        );
        assert!(matches!(
            parse(br#"{"model":"m","prompt":"x"} trailing"#, None),
            Err(RequestError::InvalidJson(_))
        ));
        assert!(matches!(
            parse(br#"{"model":"m","prompt":"x""#, None),
            Err(RequestError::InvalidJson(_))
        ));
    }

    #[test]
    fn responses_instructions_after_input() {
        let r = parse(
            br#"{"model":"m","input":[{"role":"user","content":"hi"}],"instructions":"sys"}"#,
            Some(ApiKind::Responses),
        )
        .unwrap();
        assert_eq!(
            r.segments,
            vec![Segment::Text("system\nsys\nuser\nhi\n".into())]
        );
    }

    #[test]
    fn the_template_input_is_kept_only_when_asked() {
        let keep = ParseOptions {
            limits: PromptLimits::NONE,
            template: true,
        };
        let chat = br#"{"model":"m","chat_template_kwargs":{"t":1},"tools":[1],"messages":[{"role":"user","content":[{"type":"image_url","image_url":"u"},{"type":"input_audio","input_audio":{}}],"name":"n"}]}"#;
        assert_eq!(parse(chat, None).unwrap().template, None);
        let r = parse_with(chat, None, keep).unwrap();
        assert_eq!(
            r.template,
            Some(TemplateInput::Chat(ChatInput {
                messages: vec![TemplateMessage {
                    fields: vec![
                        ("role".into(), MessageField::Text("user".into())),
                        (
                            "content".into(),
                            MessageField::Parts(vec![
                                ContentPart::Image("u".into()),
                                ContentPart::Text(String::new())
                            ])
                        ),
                        ("name".into(), MessageField::Json(r#""n""#.into())),
                    ]
                }],
                tools: Some("[1]".into()),
                chat_template_kwargs: Some(r#"{"t":1}"#.into()),
            }))
        );
        // Responses: instructions first, a string input as a user turn, no kwargs.
        let resp = br#"{"model":"m","input":"hi","chat_template_kwargs":{},"instructions":"sys"}"#;
        let msg = |role: &str, content: &str| TemplateMessage {
            fields: vec![
                ("role".into(), MessageField::Text(role.into())),
                ("content".into(), MessageField::Text(content.into())),
            ],
        };
        assert_eq!(
            parse_with(resp, Some(ApiKind::Responses), keep)
                .unwrap()
                .template,
            Some(TemplateInput::Chat(ChatInput {
                messages: vec![msg("system", "sys"), msg("user", "hi")],
                tools: None,
                chat_template_kwargs: None,
            }))
        );
        // Completions: strings stay apart (the routing text joins them).
        let r = parse_with(br#"{"model":"m","prompt":["a","b",[1],[2]]}"#, None, keep).unwrap();
        assert_eq!(r.segments[0], Segment::Text("ab".into()));
        assert_eq!(
            r.template,
            Some(TemplateInput::Prompt(vec![
                PromptPart::Text("a".into()),
                PromptPart::Text("b".into()),
                PromptPart::Tokens(vec![1, 2])
            ]))
        );
    }

    fn tokens(tokens: usize) -> PromptLimits {
        PromptLimits {
            tokens,
            ..PromptLimits::NONE
        }
    }

    #[test]
    fn a_capped_parse_keeps_a_prefix_of_the_text_and_counts_the_rest() {
        let limits = PromptLimits {
            text_bytes: 12,
            ..PromptLimits::NONE
        };
        // "user\n" (5) + "abé" (4) + "cde": 12 bytes kept, the rest counted.
        let chat = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": "ab\u{e9}cdefgh"},
            {"role": "user", "content": [{"type": "text", "text": "more"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}}]},
        ]});
        let r = parse_capped(chat.to_string().as_bytes(), None, limits).unwrap();
        assert_eq!(
            r.segments,
            vec![
                Segment::Text("user\nab\u{e9}cde".into()),
                Segment::Image("https://x/i.png".into())
            ]
        );
        let whole = parse(chat.to_string().as_bytes(), None).unwrap();
        assert_eq!(r.prompt_len(), whole.prompt_len());
        assert_eq!(r.omitted_text_bytes, whole.prompt_len() - 12 - 15);
        // A cut inside a character keeps the text before it.
        let limits = PromptLimits {
            text_bytes: 7,
            ..PromptLimits::NONE
        };
        let r = parse_capped(br#"{"model":"m","prompt":"abcdef\u00e9"}"#, None, limits).unwrap();
        assert_eq!(r.segments, vec![Segment::Text("abcdef".into())]);
        assert_eq!(r.omitted_text_bytes, 2);
        // Content is checked as UTF-8 only as far as it is kept: a bad byte
        // past the limit is counted, one within it refused.
        let chat = |content: &[u8]| {
            let mut b = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
            b.extend_from_slice(content);
            b.extend_from_slice(br#""},{"content":"x"}]}"#);
            b
        };
        let limits = PromptLimits {
            text_bytes: 9,
            ..PromptLimits::NONE
        };
        // 9 bytes of content checked (the role is counted after it), 4 kept.
        let r = parse_capped(&chat(b"ab\xc3\xa9cdefg\xffh"), None, limits).unwrap();
        assert_eq!(r.segments, vec![Segment::Text("user\nab\u{e9}".into())]);
        assert_eq!(r.omitted_text_bytes, 7 + "\n".len() + "user\nx\n".len());
        let err = parse_capped(&chat(b"a\xffbc"), None, limits).unwrap_err();
        assert!(err.to_string().contains("messages[0].content"), "{err}");
        // A check line inside a character keeps the text before it.
        let limits = PromptLimits {
            text_bytes: 3,
            ..PromptLimits::NONE
        };
        let r = parse_capped(&chat(b"ab\xc3\xa9\xff"), None, limits).unwrap();
        assert_eq!(r.segments, vec![Segment::Text("use".into())]);
        // "user\n" (5) + the content (5) + "\n" + "user\nx\n" (7), 3 kept.
        assert_eq!(r.omitted_text_bytes, 5 + 5 + 1 + 7 - 3);
    }

    #[test]
    fn a_capped_parse_keeps_the_leading_token_ids_and_counts_the_rest() {
        let ids: Vec<u32> = (0..100).collect();
        let flat = serde_json::json!({"model": "m", "prompt": ids}).to_string();
        let r = parse_capped(flat.as_bytes(), None, tokens(32)).unwrap();
        assert_eq!(r.segments, vec![Segment::Tokens((0..32).collect())]);
        assert_eq!(r.omitted_tokens, 68);
        let nested = serde_json::json!({"model": "m", "prompt": [[1, 2, 3], "x", [4, 5]]});
        let r = parse_capped(nested.to_string().as_bytes(), None, tokens(4)).unwrap();
        assert_eq!(
            r.segments,
            vec![
                Segment::Tokens(vec![1, 2, 3]),
                Segment::Text("x".into()),
                Segment::Tokens(vec![4])
            ]
        );
        assert_eq!(r.omitted_tokens, 1);
        let nv = serde_json::json!({"model": "m", "prompt": "t", "nvext": {"token_data": ids}});
        let r = parse_capped(nv.to_string().as_bytes(), None, tokens(10)).unwrap();
        assert_eq!(r.segments, vec![Segment::Tokens((0..10).collect())]);
        assert_eq!(r.omitted_tokens, 90);
        // Unlimited: everything kept.
        let r = parse(flat.as_bytes(), None).unwrap();
        assert_eq!(
            (r.segments, r.omitted_tokens),
            (vec![Segment::Tokens(ids)], 0)
        );
    }
}
