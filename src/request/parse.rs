//! The one pass over a request body: serde visitors that read only what routing
//! needs, borrowing strings from the body, skipping everything else with
//! [`IgnoredAny`], and never building a `serde_json::Value` for the prompt.
//!
//! Errors name the field: every visitor pushes the field it is about to read onto
//! a [`Path`] and pops it once read, so when serde_json reports a data error the
//! path still names where it happened.

use std::borrow::Cow;
use std::fmt::{self, Write as _};

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::error::Category;
use serde_json::value::RawValue;

use super::nvext::{Key, NvExt, NvExtVisitor};
use super::{ApiKind, InferenceRequest, RequestError, Segment};

/// One step of a field path.
#[derive(Debug, Clone, Copy)]
enum Step {
    Key(&'static str),
    Index(usize),
}

/// The field being read, e.g. `messages[2].content`.
#[derive(Debug, Default)]
struct Path(Vec<Step>);

impl Path {
    fn push(&mut self, key: &'static str) {
        self.0.push(Step::Key(key));
    }

    fn index(&mut self, i: usize) {
        self.0.push(Step::Index(i));
    }

    fn pop(&mut self) {
        self.0.pop();
    }

    fn render(&self) -> String {
        let mut s = String::new();
        for step in &self.0 {
            match step {
                Step::Key(k) if s.is_empty() => s.push_str(k),
                Step::Key(k) => {
                    s.push('.');
                    s.push_str(k);
                }
                Step::Index(i) => {
                    let _ = write!(s, "[{i}]");
                }
            }
        }
        if s.is_empty() {
            s.push('$');
        }
        s
    }
}

/// A serde_json error as a [`RequestError`]: data errors name the field at `path`.
fn request_error(e: serde_json::Error, path: String) -> RequestError {
    match e.classify() {
        Category::Data => {
            let msg = e.to_string();
            let reason = msg.rfind(" at line ").map_or(msg.as_str(), |i| &msg[..i]);
            RequestError::Field {
                field: path,
                reason: reason.to_string(),
            }
        }
        _ => RequestError::InvalidJson(e.to_string()),
    }
}

/// Prompt segments as the pass sees them; neighbours of one kind merge.
#[derive(Debug, Default)]
struct Segments(Vec<Segment>, TokenBudget);

/// Token ids still kept; those past the budget are only counted.
#[derive(Debug)]
struct TokenBudget {
    left: usize,
    omitted: usize,
}

impl Default for TokenBudget {
    fn default() -> Self {
        TokenBudget {
            left: usize::MAX,
            omitted: 0,
        }
    }
}

impl Segments {
    fn text(&mut self, s: &str) {
        match self.0.last_mut() {
            Some(Segment::Text(last)) => last.push_str(s),
            _ => self.0.push(Segment::Text(s.to_string())),
        }
    }

    fn with_token_limit(limit: usize) -> Self {
        Segments(
            Vec::new(),
            TokenBudget {
                left: limit,
                omitted: 0,
            },
        )
    }

    fn token(&mut self, t: u32) {
        if self.1.left == 0 {
            self.1.omitted += 1;
            return;
        }
        self.1.left -= 1;
        match self.0.last_mut() {
            Some(Segment::Tokens(last)) => last.push(t),
            _ => self.0.push(Segment::Tokens(vec![t])),
        }
    }

    fn image(&mut self, url: String) {
        self.0.push(Segment::Image(url));
    }

    fn append(&mut self, other: Segments) {
        self.1.omitted += other.1.omitted;
        for seg in other.0 {
            match seg {
                Segment::Text(t) => self.text(&t),
                Segment::Tokens(t) if matches!(self.0.last(), Some(Segment::Tokens(_))) => {
                    t.into_iter().for_each(|t| self.token(t))
                }
                s => self.0.push(s),
            }
        }
    }
}

/// A prompt given as one string: its text (an empty prompt is an error).
fn text_prompt<E: de::Error>(v: &str) -> Result<Segments, E> {
    if v.is_empty() {
        return Err(E::custom("must not be empty"));
    }
    let mut out = Segments::default();
    out.text(v);
    Ok(out)
}

fn once<E: de::Error, T>(slot: &Option<T>, name: &str) -> Result<(), E> {
    match slot {
        Some(_) => Err(E::custom(format_args!("duplicate field `{name}`"))),
        None => Ok(()),
    }
}

/// Parses a body in one pass (see [`super::parse`]).
pub(super) fn parse_body(
    body: &[u8],
    kind: Option<ApiKind>,
    token_limit: usize,
) -> Result<InferenceRequest, RequestError> {
    let mut path = Path::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = de
        .deserialize_map(Top {
            path: &mut path,
            kind,
            token_limit,
        })
        .and_then(|top| de.end().map(|()| top))
        .map_err(|e| request_error(e, path.render()))?;
    let nvext = match top.nvext {
        Some(raw) if raw.get() != "null" => {
            let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
            let mut nv = parse_nvext(raw.get())?;
            nv.span = Some(start..start + raw.get().len());
            nv
        }
        _ => NvExt::default(),
    };
    // Dynamo's `token_data` is the pre-tokenized prompt the engine runs: its ids,
    // not the text, are what the engine caches, so they are what kvpick hashes
    // (and no tokenization is needed).
    let (segments, omitted_tokens) = match &nvext.token_data {
        Some(ids) if !ids.is_empty() => {
            let kept = ids.len().min(token_limit);
            (
                vec![super::Segment::Tokens(ids[..kept].to_vec())],
                ids.len() - kept,
            )
        }
        _ => (top.segments.0, top.segments.1.omitted),
    };
    Ok(InferenceRequest {
        kind: top.kind,
        model: top.model,
        segments,
        omitted_tokens,
        stream: top.stream,
        names_worker: nvext.names_worker(),
        nvext,
    })
}

/// Parses the `nvext` object's JSON.
pub(super) fn parse_nvext(json: &str) -> Result<NvExt, RequestError> {
    let mut path = Vec::new();
    serde_json::Deserializer::from_str(json)
        .deserialize_map(NvExtVisitor { path: &mut path })
        .map_err(|e| {
            let field = std::iter::once("nvext")
                .chain(path)
                .collect::<Vec<_>>()
                .join(".");
            request_error(e, field)
        })
}

struct TopFound<'de> {
    kind: ApiKind,
    model: String,
    stream: bool,
    segments: Segments,
    nvext: Option<&'de RawValue>,
}

struct Top<'p> {
    path: &'p mut Path,
    kind: Option<ApiKind>,
    token_limit: usize,
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = TopFound<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopFound<'de>, A::Error> {
        let wants = |k: ApiKind| self.kind.is_none_or(|kind| kind == k);
        let (want_chat, want_completions, want_responses) = (
            wants(ApiKind::Chat),
            wants(ApiKind::Completions),
            wants(ApiKind::Responses),
        );
        let mut model: Option<Key<'de>> = None;
        let mut stream: Option<Option<bool>> = None;
        let mut messages: Option<Segments> = None;
        let mut prompt: Option<Segments> = None;
        let mut input: Option<Segments> = None;
        let mut instructions: Option<Option<Key<'de>>> = None;
        let mut nvext: Option<&'de RawValue> = None;
        let path = self.path;
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "model" => {
                    path.push("model");
                    once(&model, "model")?;
                    let m: Key = map.next_value()?;
                    if m.0.is_empty() {
                        return Err(de::Error::custom("must not be empty"));
                    }
                    model = Some(m);
                }
                "stream" => {
                    path.push("stream");
                    once(&stream, "stream")?;
                    stream = Some(map.next_value()?);
                }
                "messages" if want_chat => {
                    path.push("messages");
                    once(&messages, "messages")?;
                    messages = Some(map.next_value_seed(Messages {
                        path: &mut *path,
                        allow_text: false,
                    })?);
                }
                "prompt" if want_completions => {
                    path.push("prompt");
                    once(&prompt, "prompt")?;
                    prompt = Some(map.next_value_seed(Prompt {
                        path: &mut *path,
                        token_limit: self.token_limit,
                    })?);
                }
                "input" if want_responses => {
                    path.push("input");
                    once(&input, "input")?;
                    input = Some(map.next_value_seed(Messages {
                        path: &mut *path,
                        allow_text: true,
                    })?);
                }
                "instructions" if want_responses => {
                    path.push("instructions");
                    once(&instructions, "instructions")?;
                    instructions = Some(map.next_value()?);
                }
                "nvext" => {
                    path.push("nvext");
                    once(&nvext, "nvext")?;
                    nvext = Some(map.next_value()?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            }
            path.pop();
        }
        let kind = match self.kind {
            Some(k) => k,
            None if messages.is_some() => ApiKind::Chat,
            None if prompt.is_some() => ApiKind::Completions,
            None if input.is_some() => ApiKind::Responses,
            None => {
                path.push("messages");
                return Err(de::Error::custom(
                    "missing: expected `messages` (chat), `prompt` (completions) or `input` (responses)",
                ));
            }
        };
        let Some(Key(model)) = model else {
            path.push("model");
            return Err(de::Error::custom("missing"));
        };
        let (field, found) = match kind {
            ApiKind::Chat => ("messages", messages),
            ApiKind::Completions => ("prompt", prompt),
            ApiKind::Responses => ("input", input),
        };
        let Some(found) = found else {
            path.push(field);
            return Err(de::Error::custom("missing"));
        };
        let segments = match instructions.flatten() {
            Some(Key(s)) if kind == ApiKind::Responses => {
                let mut out = Segments::default();
                out.text("system\n");
                out.text(&s);
                out.text("\n");
                out.append(found);
                out
            }
            _ => found,
        };
        Ok(TopFound {
            kind,
            model: model.into_owned(),
            stream: stream.flatten().unwrap_or(false),
            segments,
            nvext,
        })
    }
}

/// Chat `messages` (or a Responses `input`, which may also be a string).
struct Messages<'p> {
    path: &'p mut Path,
    allow_text: bool,
}

impl<'de> DeserializeSeed<'de> for Messages<'_> {
    type Value = Segments;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Segments, D::Error> {
        if self.allow_text {
            d.deserialize_any(self)
        } else {
            d.deserialize_seq(self)
        }
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = Segments;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.allow_text {
            f.write_str("a string or an array of items")
        } else {
            f.write_str("an array of messages")
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Segments, E> {
        text_prompt(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Segments, A::Error> {
        let mut out = Segments::default();
        let mut i = 0;
        loop {
            self.path.index(i);
            let more = seq.next_element_seed(Message {
                path: &mut *self.path,
                out: &mut out,
            })?;
            self.path.pop();
            if more.is_none() {
                break;
            }
            i += 1;
        }
        if i == 0 {
            return Err(de::Error::custom("must not be empty"));
        }
        Ok(out)
    }
}

/// A piece of message content, borrowed from the body where it can be.
enum Piece<'de> {
    Text(Cow<'de, str>),
    Image(Cow<'de, str>),
    /// An unknown content part, as compact JSON so equal parts hash equal.
    Json(String),
}

/// One chat message, rendered as `role\n` + content + tool calls + `\n`.
struct Message<'p, 'o> {
    path: &'p mut Path,
    out: &'o mut Segments,
}

impl<'de> DeserializeSeed<'de> for Message<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut role: Option<Option<Key<'de>>> = None;
        let mut content: Option<Vec<Piece<'de>>> = None;
        let mut tool_calls: Option<&'de RawValue> = None;
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "role" => {
                    self.path.push("role");
                    once(&role, "role")?;
                    role = Some(map.next_value()?);
                }
                "content" => {
                    self.path.push("content");
                    once(&content, "content")?;
                    content = Some(map.next_value_seed(Content {
                        path: &mut *self.path,
                    })?);
                }
                "tool_calls" => {
                    self.path.push("tool_calls");
                    once(&tool_calls, "tool_calls")?;
                    tool_calls = Some(map.next_value()?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            }
            self.path.pop();
        }
        let role = role.flatten();
        self.out
            .text(role.as_ref().map_or("user", |r| r.0.as_ref()));
        self.out.text("\n");
        for piece in content.into_iter().flatten() {
            match piece {
                Piece::Text(t) => self.out.text(&t),
                Piece::Image(u) => self.out.image(u.into_owned()),
                Piece::Json(j) => self.out.text(&j),
            }
        }
        if let Some(calls) = tool_calls {
            self.out.text(calls.get());
        }
        self.out.text("\n");
        Ok(())
    }
}

/// Message `content`: null, a string, or an array of content parts.
struct Content<'p> {
    path: &'p mut Path,
}

impl<'de> DeserializeSeed<'de> for Content<'_> {
    type Value = Vec<Piece<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Content<'_> {
    type Value = Vec<Piece<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an array of content parts")
    }

    // Assistant turns with only tool calls have null content.
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(vec![Piece::Text(Cow::Borrowed(v))])
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(vec![Piece::Text(Cow::Owned(v.to_string()))])
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        loop {
            self.path.index(out.len());
            let part = seq.next_element_seed(Part {
                path: &mut *self.path,
            })?;
            self.path.pop();
            match part {
                Some(p) => out.push(p),
                None => return Ok(out),
            }
        }
    }
}

/// One content part: a string, or an object with a `type`.
struct Part<'p> {
    path: &'p mut Path,
}

impl<'de> DeserializeSeed<'de> for Part<'_> {
    type Value = Piece<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Part<'_> {
    type Value = Piece<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an object")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Piece::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Piece::Text(Cow::Owned(v.to_string())))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut ty: Option<Key<'de>> = None;
        let mut text: Option<Key<'de>> = None;
        let mut image: Option<Cow<'de, str>> = None;
        let mut other: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "type" => {
                    self.path.push("type");
                    once(&ty, "type")?;
                    ty = Some(map.next_value()?);
                }
                "text" => {
                    self.path.push("text");
                    once(&text, "text")?;
                    text = Some(map.next_value()?);
                }
                "image_url" => {
                    self.path.push("image_url");
                    once(&image, "image_url")?;
                    image = Some(map.next_value_seed(ImageUrl {
                        path: &mut *self.path,
                    })?);
                }
                _ => {
                    other.push((key, map.next_value()?));
                    continue;
                }
            }
            self.path.pop();
        }
        let ty = ty.map_or(Cow::Borrowed("text"), |k| k.0);
        match ty.as_ref() {
            "text" | "input_text" | "output_text" => match text {
                Some(Key(t)) => Ok(Piece::Text(t)),
                None => {
                    self.path.push("text");
                    Err(de::Error::custom("missing"))
                }
            },
            "image_url" | "input_image" => match image {
                Some(u) => Ok(Piece::Image(u)),
                None => {
                    self.path.push("image_url");
                    Err(de::Error::custom("missing"))
                }
            },
            // Audio, files and unknown parts: their JSON, so equal parts match.
            _ => {
                let mut json = String::from("{\"type\":");
                push_json_str(&mut json, &ty);
                if let Some(Key(t)) = text {
                    json.push_str(",\"text\":");
                    push_json_str(&mut json, &t);
                }
                if let Some(u) = image {
                    json.push_str(",\"image_url\":");
                    push_json_str(&mut json, &u);
                }
                for (k, v) in other {
                    json.push(',');
                    push_json_str(&mut json, &k);
                    json.push(':');
                    json.push_str(v.get());
                }
                json.push('}');
                Ok(Piece::Json(json))
            }
        }
    }
}

fn push_json_str(out: &mut String, s: &str) {
    // Serializing a str into a String cannot fail.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

/// `image_url`: a URL string or `{"url": ...}`.
struct ImageUrl<'p> {
    path: &'p mut Path,
}

impl<'de> DeserializeSeed<'de> for ImageUrl<'_> {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ImageUrl<'_> {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a URL string or an object with `url`")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_string()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut url: Option<Key<'de>> = None;
        while let Some(Key(key)) = map.next_key::<Key>()? {
            if key == "url" {
                self.path.push("url");
                once(&url, "url")?;
                url = Some(map.next_value()?);
                self.path.pop();
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        match url {
            Some(Key(u)) => Ok(u),
            None => {
                self.path.push("url");
                Err(de::Error::custom("missing"))
            }
        }
    }
}

/// A completions `prompt`: a string, an array of strings, an array of token ids,
/// or an array of token-id arrays.
struct Prompt<'p> {
    path: &'p mut Path,
    /// Token ids kept; the rest are counted ([`InferenceRequest::omitted_tokens`]).
    token_limit: usize,
}

impl<'de> DeserializeSeed<'de> for Prompt<'_> {
    type Value = Segments;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Segments, D::Error> {
        d.deserialize_any(self)
    }
}

const TOKEN_ID: &str = "token ids must be non-negative 32-bit integers";
const PROMPT_ITEM: &str = "must be a string or an array of token ids";

impl<'de> Visitor<'de> for Prompt<'_> {
    type Value = Segments;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, or an array of token ids")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Segments, E> {
        text_prompt(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Segments, A::Error> {
        let mut out = Segments::with_token_limit(self.token_limit);
        self.path.index(0);
        let first = seq.next_element_seed(PromptItem { out: &mut out })?;
        self.path.pop();
        match first {
            None => Err(de::Error::custom("must not be empty")),
            Some(Item::Token) => {
                // A flat array of token ids: the hot path for huge numeric prompts.
                while let Some(t) = seq.next_element::<TokenId>()? {
                    out.token(t.0);
                }
                Ok(out)
            }
            Some(Item::Other) => {
                let mut i = 1;
                loop {
                    self.path.index(i);
                    let item = seq.next_element_seed(PromptItem { out: &mut out })?;
                    match item {
                        None => break,
                        Some(Item::Token) => return Err(de::Error::custom(PROMPT_ITEM)),
                        Some(Item::Other) => {}
                    }
                    self.path.pop();
                    i += 1;
                }
                self.path.pop();
                Ok(out)
            }
        }
    }
}

/// A token id.
struct TokenId(u32);

impl<'de> de::Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(TOKEN_ID)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenId, E> {
                u32::try_from(v)
                    .map(TokenId)
                    .map_err(|_| E::custom(TOKEN_ID))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<TokenId, E> {
                Err(E::custom(TOKEN_ID))
            }
        }
        d.deserialize_u64(V)
    }
}

enum Item {
    /// A token id, already pushed.
    Token,
    /// A string or a token-id array, already pushed.
    Other,
}

struct PromptItem<'o> {
    out: &'o mut Segments,
}

impl<'de> DeserializeSeed<'de> for PromptItem<'_> {
    type Value = Item;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Item, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptItem<'_> {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(PROMPT_ITEM)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        let t = u32::try_from(v).map_err(|_| E::custom(TOKEN_ID))?;
        self.out.token(t);
        Ok(Item::Token)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Item, E> {
        Err(E::custom(TOKEN_ID))
    }

    fn visit_str<E>(self, v: &str) -> Result<Item, E> {
        self.out.text(v);
        Ok(Item::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        // Token-id arrays stay separate segments from neighbouring strings.
        while let Some(t) = seq.next_element::<TokenId>()? {
            self.out.token(t.0);
        }
        Ok(Item::Other)
    }
}
