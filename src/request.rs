//! Parsing OpenAI-style inference request bodies into what routing needs.
//!
//! Supports `/v1/chat/completions` (messages with string or content-part arrays),
//! `/v1/completions` (prompt string, string array, or token ids), and
//! `/v1/responses` (`input` string or message array). Errors name the field that
//! is wrong so the client can fix the request.

use serde::Deserialize;
use serde_json::Value;

/// Why a body is not a usable inference request. The message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON at all.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// A field is missing, empty, or of the wrong type.
    #[error("invalid field `{field}`: {reason}")]
    Field {
        /// JSON path of the field, e.g. `messages[2].content`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn field_err(field: impl Into<String>, reason: impl Into<String>) -> RequestError {
    RequestError::Field {
        field: field.into(),
        reason: reason.into(),
    }
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

/// What the client asked of the session (`nvext.session_control.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionAction {
    /// First turn: bind the session once this request succeeds.
    Open,
    /// Last turn: unbind once this response has finished.
    Close,
}

/// Default session inactivity timeout in seconds.
pub const DEFAULT_SESSION_TIMEOUT_SECS: u64 = 300;

/// `nvext.session_control`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SessionControl {
    /// The client's session id.
    pub session_id: String,
    /// `open`, `close`, or absent for a middle turn.
    #[serde(default)]
    pub action: Option<SessionAction>,
    /// Inactivity timeout in seconds (default 300).
    #[serde(default)]
    pub timeout: Option<u64>,
}

impl SessionControl {
    /// The inactivity timeout, with the default applied.
    pub fn timeout_secs(&self) -> u64 {
        self.timeout.unwrap_or(DEFAULT_SESSION_TIMEOUT_SECS)
    }
}

/// The `nvext` extension object.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct NvExt {
    /// Sticky-session control.
    #[serde(default)]
    pub session_control: Option<SessionControl>,
    /// Free-form hints from agent frameworks (kept for logging and future scoring).
    #[serde(default)]
    pub agent_hints: Option<Value>,
    /// A worker the client asks for. Never honoured: a client must not choose its
    /// worker; kvpick removes it from the body before forwarding.
    #[serde(default)]
    pub backend_instance_id: Option<Value>,
}

/// Body fields in `nvext` that name a worker; removed before forwarding.
pub const CLIENT_WORKER_FIELDS: &[&str] = &[
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
];

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
    /// Whether `nvext` names a worker (and the body must be rewritten).
    pub names_worker: bool,
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
            .sum()
    }

    /// The session control, if the body has one.
    pub fn session(&self) -> Option<&SessionControl> {
        self.nvext.session_control.as_ref()
    }
}

/// Parses a request body. `kind` comes from the path; when the path is unknown the
/// body's shape decides (`messages` → chat, `prompt` → completions, `input` → responses).
pub fn parse(body: &[u8], kind: Option<ApiKind>) -> Result<InferenceRequest, RequestError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::InvalidJson(e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| field_err("$", "the body must be a JSON object"))?;
    let kind = match kind {
        Some(k) => k,
        None if obj.contains_key("messages") => ApiKind::Chat,
        None if obj.contains_key("prompt") => ApiKind::Completions,
        None if obj.contains_key("input") => ApiKind::Responses,
        None => return Err(field_err(
            "messages",
            "missing: expected `messages` (chat), `prompt` (completions) or `input` (responses)",
        )),
    };
    let model = match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) => return Err(field_err("model", "must not be empty")),
        Some(_) => return Err(field_err("model", "must be a string")),
        None => return Err(field_err("model", "missing")),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(field_err("stream", "must be a boolean")),
    };
    let segments = match kind {
        ApiKind::Chat => chat_segments(obj.get("messages"), "messages")?,
        ApiKind::Completions => completion_segments(obj.get("prompt"))?,
        ApiKind::Responses => responses_segments(obj.get("input"), obj.get("instructions"))?,
    };
    let (nvext, names_worker) = match obj.get("nvext") {
        None | Some(Value::Null) => (NvExt::default(), false),
        Some(v @ Value::Object(map)) => {
            let nv: NvExt =
                serde_json::from_value(v.clone()).map_err(|e| field_err("nvext", e.to_string()))?;
            if let Some(sc) = &nv.session_control {
                if sc.session_id.is_empty() {
                    return Err(field_err(
                        "nvext.session_control.session_id",
                        "must not be empty",
                    ));
                }
            }
            let names = CLIENT_WORKER_FIELDS.iter().any(|f| map.contains_key(*f));
            (nv, names)
        }
        Some(_) => return Err(field_err("nvext", "must be an object")),
    };
    Ok(InferenceRequest {
        kind,
        model,
        segments,
        stream,
        nvext,
        names_worker,
    })
}

/// Removes the `nvext` fields that name a worker; returns the new body.
pub fn strip_client_worker_fields(body: &[u8]) -> Result<Vec<u8>, RequestError> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::InvalidJson(e.to_string()))?;
    if let Some(nv) = value.get_mut("nvext").and_then(Value::as_object_mut) {
        for f in CLIENT_WORKER_FIELDS {
            nv.remove(*f);
        }
    }
    serde_json::to_vec(&value).map_err(|e| RequestError::InvalidJson(e.to_string()))
}

fn chat_segments(messages: Option<&Value>, field: &str) -> Result<Vec<Segment>, RequestError> {
    let messages = match messages {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(field_err(field, "must not be empty")),
        Some(_) => return Err(field_err(field, "must be an array of messages")),
        None => return Err(field_err(field, "missing")),
    };
    let mut out = Vec::with_capacity(messages.len() * 2);
    for (i, msg) in messages.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let msg = msg
            .as_object()
            .ok_or_else(|| field_err(&at, "must be an object"))?;
        let role = msg.get("role").and_then(Value::as_str).unwrap_or("user");
        push_text(&mut out, format!("{role}\n"));
        match msg.get("content") {
            // Assistant turns with only tool calls have null content.
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => push_text(&mut out, s.clone()),
            Some(Value::Array(parts)) => content_parts(&mut out, parts, &format!("{at}.content"))?,
            Some(_) => {
                return Err(field_err(
                    format!("{at}.content"),
                    "must be a string or an array of content parts",
                ))
            }
        }
        if let Some(calls) = msg.get("tool_calls") {
            push_text(&mut out, calls.to_string());
        }
        push_text(&mut out, "\n".to_string());
    }
    Ok(out)
}

fn content_parts(out: &mut Vec<Segment>, parts: &[Value], at: &str) -> Result<(), RequestError> {
    for (j, part) in parts.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match part {
            Value::String(s) => push_text(out, s.clone()),
            Value::Object(p) => {
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("text");
                match ty {
                    "text" | "input_text" | "output_text" => {
                        let text = p
                            .get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| field_err(format!("{here}.text"), "missing"))?;
                        push_text(out, text.to_string());
                    }
                    "image_url" | "input_image" => {
                        let url = match p.get("image_url") {
                            Some(Value::String(u)) => u.as_str(),
                            Some(Value::Object(o)) => {
                                o.get("url").and_then(Value::as_str).ok_or_else(|| {
                                    field_err(format!("{here}.image_url.url"), "missing")
                                })?
                            }
                            _ => return Err(field_err(format!("{here}.image_url"), "missing")),
                        };
                        out.push(Segment::Image(url.to_string()));
                    }
                    // Audio, files and unknown parts: hash their JSON so equal parts match.
                    _ => push_text(out, part.to_string()),
                }
            }
            _ => return Err(field_err(here, "must be a string or an object")),
        }
    }
    Ok(())
}

fn completion_segments(prompt: Option<&Value>) -> Result<Vec<Segment>, RequestError> {
    match prompt {
        Some(Value::String(s)) if !s.is_empty() => Ok(vec![Segment::Text(s.clone())]),
        Some(Value::String(_)) => Err(field_err("prompt", "must not be empty")),
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_number) {
                return Ok(vec![Segment::Tokens(token_ids(items, "prompt")?)]);
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => push_text(&mut out, s.clone()),
                    Value::Array(ids) => {
                        out.push(Segment::Tokens(token_ids(ids, &format!("prompt[{i}]"))?))
                    }
                    _ => {
                        return Err(field_err(
                            format!("prompt[{i}]"),
                            "must be a string or an array of token ids",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(Value::Array(_)) => Err(field_err("prompt", "must not be empty")),
        Some(_) => Err(field_err(
            "prompt",
            "must be a string, an array of strings, or an array of token ids",
        )),
        None => Err(field_err("prompt", "missing")),
    }
}

fn token_ids(items: &[Value], at: &str) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| field_err(at, "token ids must be non-negative 32-bit integers"))
        })
        .collect()
}

fn responses_segments(
    input: Option<&Value>,
    instructions: Option<&Value>,
) -> Result<Vec<Segment>, RequestError> {
    let mut out = Vec::new();
    if let Some(Value::String(s)) = instructions {
        push_text(&mut out, format!("system\n{s}\n"));
    }
    match input {
        Some(Value::String(s)) if !s.is_empty() => push_text(&mut out, s.clone()),
        Some(Value::Array(items)) if !items.is_empty() => {
            out.extend(chat_segments(input, "input")?);
        }
        Some(Value::String(_)) | Some(Value::Array(_)) => {
            return Err(field_err("input", "must not be empty"))
        }
        Some(_) => return Err(field_err("input", "must be a string or an array of items")),
        None => return Err(field_err("input", "missing")),
    }
    Ok(out)
}

/// Appends text, merging with a preceding text segment.
fn push_text(out: &mut Vec<Segment>, text: String) {
    if let Some(Segment::Text(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Segment::Text(text));
    }
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
        let r = parse(body, None).unwrap();
        let sc = r.session().unwrap();
        assert_eq!(sc.session_id, "s1");
        assert_eq!(sc.action, Some(SessionAction::Open));
        assert_eq!(sc.timeout_secs(), 60);
        assert!(r.names_worker);
        let clean = strip_client_worker_fields(body).unwrap();
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
}
