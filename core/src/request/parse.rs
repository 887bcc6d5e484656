//! The one pass over a request body: serde visitors that read only what routing
//! needs, borrowing strings from the body, skipping everything else with
//! [`IgnoredAny`], and never building a `serde_json::Value` for the prompt.
//!
//! Errors name the field: every visitor pushes the field it is about to read onto
//! a [`Path`] and pops it once read, so when serde_json reports a data error the
//! path still names where it happened.
//!
//! Prompt strings (message `content`, a completions `prompt`, a Responses
//! `input` given as a string) are asked for as bytes: serde_json then finds a
//! string's end with a vectorised search instead of testing every byte for a
//! control character, several times faster on a long prompt. [`prompt_str`]
//! still refuses bytes that are not UTF-8, in a message's content as far as the
//! parse keeps its text ([`prompt_prefix`]: bytes past that are only counted);
//! a raw control character, which JSON forbids inside a string, is left to the
//! engine to refuse, and so is invalid UTF-8 past the kept text.

use std::borrow::Cow;
use std::fmt::{self, Write as _};

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::error::Category;
use serde_json::value::RawValue;

use super::nvext::{parse_salt, Key, NvExt, NvExtVisitor};
use super::{
    ApiKind, ChatInput, ContentPart, InferenceRequest, MessageField, ParseOptions, PromptPart,
    RequestError, Segment, TemplateInput, TemplateMessage,
};

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

/// A prompt string handed over as bytes (see the module docs), as text.
fn prompt_str<E: de::Error>(v: &[u8]) -> Result<&str, E> {
    std::str::from_utf8(v).map_err(|e| {
        E::custom(format_args!(
            "invalid UTF-8 in a string at byte {}",
            e.valid_up_to()
        ))
    })
}

/// [`prompt_str`] of the first `checked` bytes of a message's content (all of
/// them when shorter, cut back to a whole character), and how many bytes after
/// them go unchecked: the parse keeps no text past its limit, so it only
/// counts them.
fn prompt_prefix<E: de::Error>(v: &[u8], checked: usize) -> Result<(&str, usize), E> {
    if checked >= v.len() {
        return Ok((prompt_str(v)?, 0));
    }
    // The line moves back to the start of a character it cuts (at most three
    // continuation bytes), so a well-formed prompt is checked in one pass.
    let mut cut = checked;
    while cut > 0 && checked - cut < 3 && v[cut] & 0xC0 == 0x80 {
        cut -= 1;
    }
    let head = &v[..cut];
    let kept = match std::str::from_utf8(head) {
        Ok(s) => s,
        // A character broken at the line: the text before it is kept.
        Err(e) if e.error_len().is_none() => prompt_str(&head[..e.valid_up_to()])?,
        Err(_) => prompt_str(head)?,
    };
    Ok((kept, v.len() - kept.len()))
}

/// How one parse sizes its prompt text: what the first text segment
/// allocates, and how many bytes are kept (the rest is only counted).
#[derive(Debug, Clone, Copy)]
struct TextRoom {
    /// The body's length (within the limit), so a long prompt is copied once
    /// instead of once per doubling of its `String`.
    capacity: usize,
    limit: usize,
}

/// Prompt segments as the pass sees them; neighbours of one kind merge.
#[derive(Debug)]
struct Segments {
    found: Vec<Segment>,
    /// Token ids.
    tokens: Budget,
    /// Text bytes; once text is cut, no later text is kept, so the text kept
    /// is always a prefix of the prompt's.
    text: Budget,
    /// Capacity of the next text segment started.
    text_capacity: usize,
}

/// Units (token ids, text bytes) still kept; those past the budget are only counted.
#[derive(Debug)]
struct Budget {
    left: usize,
    omitted: usize,
}

impl Budget {
    fn of(left: usize) -> Self {
        Budget { left, omitted: 0 }
    }
}

impl Segments {
    fn text(&mut self, s: &str) {
        let s = match s.len() <= self.text.left {
            true => {
                self.text.left -= s.len();
                s
            }
            false => {
                let mut keep = self.text.left;
                while !s.is_char_boundary(keep) {
                    keep -= 1;
                }
                self.text.omitted += s.len() - keep;
                self.text.left = 0;
                &s[..keep]
            }
        };
        if s.is_empty() {
            return;
        }
        match self.found.last_mut() {
            Some(Segment::Text(last)) => last.push_str(s),
            _ => {
                let mut text = String::with_capacity(s.len().max(self.text_capacity));
                text.push_str(s);
                self.text_capacity = 0;
                self.found.push(Segment::Text(text));
            }
        }
    }

    /// Counts `n` bytes of text read past the limit, unkept: no later text is kept.
    fn omit_text(&mut self, n: usize) {
        if n > 0 {
            self.text.omitted += n;
            self.text.left = 0;
        }
    }

    /// Segments whose text is sized and limited by `room`.
    fn with_room(room: TextRoom) -> Self {
        Segments {
            found: Vec::new(),
            tokens: Budget::of(usize::MAX),
            text: Budget::of(room.limit),
            text_capacity: room.capacity,
        }
    }

    fn with_token_limit(limit: usize, room: TextRoom) -> Self {
        Segments {
            tokens: Budget::of(limit),
            ..Segments::with_room(room)
        }
    }

    /// The segments found, and how many token ids and text bytes were only
    /// counted; text sized well beyond its length (a body mostly made of
    /// something else) gives the spare capacity back.
    fn into_parts(mut self) -> (Vec<Segment>, usize, usize) {
        for seg in &mut self.found {
            if let Segment::Text(t) = seg {
                if t.capacity() / 2 > t.len() {
                    t.shrink_to_fit();
                }
            }
        }
        (self.found, self.tokens.omitted, self.text.omitted)
    }

    /// Adds a token id within the budget; whether it was kept.
    fn token(&mut self, t: u32) -> bool {
        if self.tokens.left == 0 {
            self.tokens.omitted += 1;
            return false;
        }
        self.tokens.left -= 1;
        match self.found.last_mut() {
            Some(Segment::Tokens(last)) => last.push(t),
            _ => self.found.push(Segment::Tokens(vec![t])),
        }
        true
    }

    fn image(&mut self, url: String) {
        self.found.push(Segment::Image(url));
    }

    fn append(&mut self, other: Segments) {
        self.tokens.omitted += other.tokens.omitted;
        self.text.omitted += other.text.omitted;
        for seg in other.found {
            match seg {
                Segment::Text(t) => self.text(&t),
                Segment::Tokens(t) if matches!(self.found.last(), Some(Segment::Tokens(_))) => {
                    t.into_iter().for_each(|t| {
                        self.token(t);
                    })
                }
                s => self.found.push(s),
            }
        }
    }
}

/// A prompt given as one string: its text (an empty prompt is an error).
fn text_prompt<E: de::Error>(v: &str, room: TextRoom) -> Result<Segments, E> {
    if v.is_empty() {
        return Err(E::custom("must not be empty"));
    }
    let mut out = Segments::with_room(TextRoom {
        capacity: 0,
        ..room
    });
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
    options: ParseOptions,
) -> Result<InferenceRequest, RequestError> {
    let token_limit = options.limits.tokens;
    let text = TextRoom {
        capacity: body.len().min(options.limits.text_bytes),
        limit: options.limits.text_bytes,
    };
    let mut path = Path::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = de
        .deserialize_map(Top {
            path: &mut path,
            kind,
            options,
            text,
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
    let (segments, omitted_tokens, omitted_text_bytes) = match &nvext.token_data {
        Some(ids) if !ids.is_empty() => {
            let kept = ids.len().min(token_limit);
            (
                vec![super::Segment::Tokens(ids[..kept].to_vec())],
                ids.len() - kept,
                0,
            )
        }
        _ => top.segments.into_parts(),
    };
    Ok(InferenceRequest {
        kind: top.kind,
        model: top.model,
        segments,
        omitted_tokens,
        omitted_text_bytes,
        stream: top.stream,
        names_worker: nvext.names_worker(),
        // Dynamo's precedence: `nvext.cache_salt` over the top-level field.
        salt: nvext.cache_salt.clone().or(top.cache_salt),
        nvext,
        max_output_tokens: top.max_output_tokens,
        template: top.template,
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
    cache_salt: Option<String>,
    max_output_tokens: Option<u32>,
    template: Option<TemplateInput>,
}

struct Top<'p> {
    path: &'p mut Path,
    kind: Option<ApiKind>,
    options: ParseOptions,
    text: TextRoom,
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
        let keep = self.options.template;
        let mut model: Option<Key<'de>> = None;
        let mut stream: Option<Option<bool>> = None;
        let mut messages: Option<(Segments, Vec<TemplateMessage>)> = None;
        let mut prompt: Option<(Segments, Vec<PromptPart>)> = None;
        let mut input: Option<(Segments, Vec<TemplateMessage>)> = None;
        let mut instructions: Option<Option<Key<'de>>> = None;
        let mut nvext: Option<&'de RawValue> = None;
        let mut cache_salt: Option<Option<String>> = None;
        // `max_completion_tokens`, `max_tokens`, `max_output_tokens`, in that
        // order of precedence.
        let mut output_caps: [Option<Option<u32>>; 3] = [None; 3];
        // Template-only fields: a repeated key counts its last copy, as JSON does.
        let mut tools: Option<&'de RawValue> = None;
        let mut kwargs: Option<&'de RawValue> = None;
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
                        keep,
                        text: self.text,
                    })?);
                }
                "prompt" if want_completions => {
                    path.push("prompt");
                    once(&prompt, "prompt")?;
                    prompt = Some(map.next_value_seed(Prompt {
                        path: &mut *path,
                        token_limit: self.options.limits.tokens,
                        keep,
                        text: self.text,
                    })?);
                }
                "input" if want_responses => {
                    path.push("input");
                    once(&input, "input")?;
                    input = Some(map.next_value_seed(Messages {
                        path: &mut *path,
                        allow_text: true,
                        keep,
                        text: self.text,
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
                "cache_salt" => {
                    path.push("cache_salt");
                    once(&cache_salt, "cache_salt")?;
                    cache_salt = Some(parse_salt(&mut map)?);
                }
                key @ ("max_completion_tokens" | "max_tokens" | "max_output_tokens") => {
                    let (i, name) = match key {
                        "max_completion_tokens" => (0, "max_completion_tokens"),
                        "max_tokens" => (1, "max_tokens"),
                        _ => (2, "max_output_tokens"),
                    };
                    path.push(name);
                    once(&output_caps[i], name)?;
                    output_caps[i] = Some(output_cap(map.next_value()?));
                }
                "tools" if keep => {
                    tools = Some(map.next_value()?);
                    continue;
                }
                "chat_template_kwargs" if keep => {
                    kwargs = Some(map.next_value()?);
                    continue;
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
        let (found, kept) = match (kind, messages, prompt, input) {
            (ApiKind::Chat, Some((found, kept)), _, _)
            | (ApiKind::Responses, _, _, Some((found, kept))) => (
                found,
                Some(TemplateInput::Chat(chat_input(kept, tools, None))),
            ),
            (ApiKind::Completions, _, Some((found, kept)), _) => {
                (found, Some(TemplateInput::Prompt(kept)))
            }
            _ => {
                path.push(match kind {
                    ApiKind::Chat => "messages",
                    ApiKind::Completions => "prompt",
                    ApiKind::Responses => "input",
                });
                return Err(de::Error::custom("missing"));
            }
        };
        let mut template = kept.filter(|_| keep);
        if let Some(TemplateInput::Chat(chat)) = &mut template {
            if kind == ApiKind::Chat {
                chat.chat_template_kwargs = kwargs.map(|k| k.get().to_string());
            }
        }
        let segments = match instructions.flatten() {
            Some(Key(s)) if kind == ApiKind::Responses => {
                if let Some(TemplateInput::Chat(chat)) = &mut template {
                    chat.messages.insert(0, template_message("system", &s));
                }
                let mut out = Segments::with_room(self.text);
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
            cache_salt: cache_salt.flatten(),
            max_output_tokens: output_caps.into_iter().flatten().flatten().next(),
            template,
        })
    }
}

/// An output-token cap as the latency model reads it: a positive integer
/// (past `u32::MAX` it saturates); anything else (a string, a float, a
/// negative number, `null`) reads as no cap, and the engine judges it.
fn output_cap(raw: &RawValue) -> Option<u32> {
    match raw.get().parse::<u64>() {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n.min(u64::from(u32::MAX)) as u32),
    }
}

/// The template's view of a chat body.
fn chat_input(
    messages: Vec<TemplateMessage>,
    tools: Option<&RawValue>,
    chat_template_kwargs: Option<&RawValue>,
) -> ChatInput {
    ChatInput {
        messages,
        tools: tools.map(|t| t.get().to_string()),
        chat_template_kwargs: chat_template_kwargs.map(|k| k.get().to_string()),
    }
}

/// A message of a role and string content (Responses `instructions` and `input`).
fn template_message(role: &str, content: &str) -> TemplateMessage {
    TemplateMessage {
        fields: vec![
            ("role".into(), MessageField::Text(role.into())),
            ("content".into(), MessageField::Text(content.into())),
        ],
    }
}

/// Chat `messages` (or a Responses `input`, which may also be a string), with
/// the template's messages when `keep`.
struct Messages<'p> {
    path: &'p mut Path,
    allow_text: bool,
    keep: bool,
    text: TextRoom,
}

type Found = (Segments, Vec<TemplateMessage>);

impl<'de> DeserializeSeed<'de> for Messages<'_> {
    type Value = Found;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        if self.allow_text {
            d.deserialize_bytes(self)
        } else {
            d.deserialize_seq(self)
        }
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.allow_text {
            f.write_str("a string or an array of items")
        } else {
            f.write_str("an array of messages")
        }
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Found, E> {
        self.visit_str(prompt_str(v)?)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Found, E> {
        self.visit_str(prompt_str(v)?)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Found, E> {
        let kept = match self.keep {
            true => vec![template_message("user", v)],
            false => Vec::new(),
        };
        Ok((text_prompt(v, self.text)?, kept))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
        let mut out = Segments::with_room(self.text);
        let mut kept = Vec::new();
        let mut i = 0;
        loop {
            self.path.index(i);
            let more = seq.next_element_seed(Message {
                path: &mut *self.path,
                out: &mut out,
                kept: self.keep.then_some(&mut kept),
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
        Ok((out, kept))
    }
}

/// A piece of message content, borrowed from the body where it can be.
enum Piece<'de> {
    Text(Cow<'de, str>),
    Image(Cow<'de, str>),
    /// An unknown content part, as compact JSON so equal parts hash equal, and
    /// its `text` (what a template sees of it).
    Other {
        json: String,
        text: Option<Cow<'de, str>>,
    },
}

impl Piece<'_> {
    /// The part as the chat template sees it.
    fn for_template(&self) -> ContentPart {
        match self {
            Piece::Text(t) => ContentPart::Text(t.to_string()),
            Piece::Image(u) => ContentPart::Image(u.to_string()),
            Piece::Other { text, .. } => {
                ContentPart::Text(text.as_deref().unwrap_or_default().to_string())
            }
        }
    }
}

/// Message `content` as the body gives it.
enum ContentValue<'de> {
    Null,
    /// The text, and how many bytes after it were past the parse's text limit
    /// (counted, never checked).
    Text(Cow<'de, str>, usize),
    Parts(Vec<Piece<'de>>),
}

/// One chat message, rendered as `role\n` + content + tool calls + `\n`; with
/// `kept`, also every field for the template.
struct Message<'p, 'o> {
    path: &'p mut Path,
    out: &'o mut Segments,
    kept: Option<&'o mut Vec<TemplateMessage>>,
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
        let keep = self.kept.is_some();
        let mut role: Option<Option<Key<'de>>> = None;
        let mut content: Option<ContentValue<'de>> = None;
        let mut tool_calls: Option<&'de RawValue> = None;
        let mut fields: Vec<(String, MessageField)> = Vec::new();
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "role" => {
                    self.path.push("role");
                    once(&role, "role")?;
                    let r: Option<Key> = map.next_value()?;
                    if keep {
                        let value = r.as_ref().map_or(MessageField::Null, |Key(r)| {
                            MessageField::Text(r.to_string())
                        });
                        fields.push((key.into_owned(), value));
                    }
                    role = Some(r);
                }
                "content" => {
                    self.path.push("content");
                    once(&content, "content")?;
                    // A template renders the whole content: check all of it.
                    let checked = if keep { usize::MAX } else { self.out.text.left };
                    let c = map.next_value_seed(Content {
                        path: &mut *self.path,
                        checked,
                    })?;
                    if keep {
                        let value = match &c {
                            ContentValue::Null => MessageField::Null,
                            ContentValue::Text(t, _) => MessageField::Text(t.to_string()),
                            ContentValue::Parts(p) => {
                                MessageField::Parts(p.iter().map(Piece::for_template).collect())
                            }
                        };
                        fields.push((key.into_owned(), value));
                    }
                    content = Some(c);
                }
                "tool_calls" => {
                    self.path.push("tool_calls");
                    once(&tool_calls, "tool_calls")?;
                    let calls: &RawValue = map.next_value()?;
                    if keep {
                        fields.push((key.into_owned(), MessageField::Json(calls.get().into())));
                    }
                    tool_calls = Some(calls);
                }
                _ if keep => {
                    let raw: &RawValue = map.next_value()?;
                    fields.push((key.into_owned(), MessageField::Json(raw.get().into())));
                    continue;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            }
            self.path.pop();
        }
        if let Some(kept) = self.kept {
            kept.push(TemplateMessage { fields });
        }
        let role = role.flatten();
        self.out
            .text(role.as_ref().map_or("user", |r| r.0.as_ref()));
        self.out.text("\n");
        match content {
            None | Some(ContentValue::Null) => {}
            Some(ContentValue::Text(t, unchecked)) => {
                self.out.text(&t);
                self.out.omit_text(unchecked);
            }
            Some(ContentValue::Parts(pieces)) => {
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => self.out.text(&t),
                        Piece::Image(u) => self.out.image(u.into_owned()),
                        Piece::Other { json, .. } => self.out.text(&json),
                    }
                }
            }
        }
        if let Some(calls) = tool_calls {
            self.out.text(calls.get());
        }
        self.out.text("\n");
        Ok(())
    }
}

/// Message `content`: null, a string, or an array of content parts. A
/// string is checked as UTF-8 only as far as the parse may keep it.
struct Content<'p> {
    path: &'p mut Path,
    /// Bytes of a string content to check.
    checked: usize,
}

impl<'de> DeserializeSeed<'de> for Content<'_> {
    type Value = ContentValue<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        // null, else a string (as bytes) or an array.
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for Content<'_> {
    type Value = ContentValue<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an array of content parts")
    }

    // Assistant turns with only tool calls have null content.
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(ContentValue::Null)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(ContentValue::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_bytes(self)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        let (text, unchecked) = prompt_prefix(v, self.checked)?;
        Ok(ContentValue::Text(Cow::Borrowed(text), unchecked))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        let (text, unchecked) = prompt_prefix(v, self.checked)?;
        Ok(ContentValue::Text(Cow::Owned(text.to_string()), unchecked))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(ContentValue::Text(Cow::Borrowed(v), 0))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(ContentValue::Text(Cow::Owned(v.to_string()), 0))
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
                None => return Ok(ContentValue::Parts(out)),
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
                if let Some(Key(t)) = &text {
                    json.push_str(",\"text\":");
                    push_json_str(&mut json, t);
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
                Ok(Piece::Other {
                    json,
                    text: text.map(|Key(t)| t),
                })
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
    /// Keep the items for the tokenizer ([`PromptParts`]).
    keep: bool,
    text: TextRoom,
}

/// A completions prompt item by item, for the tokenizer (it encodes each string
/// with its own BOS); token ids only as far as the segments keep them.
struct PromptParts {
    keep: bool,
    parts: Vec<PromptPart>,
}

impl PromptParts {
    fn text(&mut self, s: &str) {
        if self.keep {
            self.parts.push(PromptPart::Text(s.to_string()));
        }
    }

    fn token(&mut self, t: u32) {
        if !self.keep {
            return;
        }
        match self.parts.last_mut() {
            Some(PromptPart::Tokens(last)) => last.push(t),
            _ => self.parts.push(PromptPart::Tokens(vec![t])),
        }
    }
}

type PromptFound = (Segments, Vec<PromptPart>);

impl<'de> DeserializeSeed<'de> for Prompt<'_> {
    type Value = PromptFound;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<PromptFound, D::Error> {
        d.deserialize_bytes(self)
    }
}

const TOKEN_ID: &str = "token ids must be non-negative 32-bit integers";
const PROMPT_ITEM: &str = "must be a string or an array of token ids";

impl<'de> Visitor<'de> for Prompt<'_> {
    type Value = PromptFound;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, or an array of token ids")
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<PromptFound, E> {
        self.visit_str(prompt_str(v)?)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<PromptFound, E> {
        self.visit_str(prompt_str(v)?)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptFound, E> {
        let mut kept = PromptParts {
            keep: self.keep,
            parts: Vec::new(),
        };
        kept.text(v);
        Ok((text_prompt(v, self.text)?, kept.parts))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptFound, A::Error> {
        let mut out = Segments::with_token_limit(self.token_limit, self.text);
        let mut kept = PromptParts {
            keep: self.keep,
            parts: Vec::new(),
        };
        self.path.index(0);
        let first = seq.next_element_seed(PromptItem {
            out: &mut out,
            kept: &mut kept,
        })?;
        self.path.pop();
        match first {
            None => Err(de::Error::custom("must not be empty")),
            Some(Item::Token) => {
                // A flat array of token ids: the hot path for huge numeric prompts.
                while let Some(t) = seq.next_element::<TokenId>()? {
                    if out.token(t.0) {
                        kept.token(t.0);
                    }
                }
                Ok((out, kept.parts))
            }
            Some(Item::Other) => {
                let mut i = 1;
                loop {
                    self.path.index(i);
                    let item = seq.next_element_seed(PromptItem {
                        out: &mut out,
                        kept: &mut kept,
                    })?;
                    match item {
                        None => break,
                        Some(Item::Token) => return Err(de::Error::custom(PROMPT_ITEM)),
                        Some(Item::Other) => {}
                    }
                    self.path.pop();
                    i += 1;
                }
                self.path.pop();
                Ok((out, kept.parts))
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
    kept: &'o mut PromptParts,
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
        if self.out.token(t) {
            self.kept.token(t);
        }
        Ok(Item::Token)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Item, E> {
        Err(E::custom(TOKEN_ID))
    }

    fn visit_str<E>(self, v: &str) -> Result<Item, E> {
        self.out.text(v);
        self.kept.text(v);
        Ok(Item::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        // Token-id arrays stay separate segments from neighbouring strings.
        while let Some(t) = seq.next_element::<TokenId>()? {
            if self.out.token(t.0) {
                self.kept.token(t.0);
            }
        }
        Ok(Item::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse, Segment};

    fn text_of(body: &[u8]) -> String {
        match parse(body, None).expect("parses").segments.as_slice() {
            [Segment::Text(t), ..] => t.clone(),
            other => panic!("expected text first, got {other:?}"),
        }
    }

    /// The prompt text is sized for the body up front; when most of the body is
    /// something else (an inline image), the text gives the spare capacity back.
    #[test]
    fn prompt_text_is_sized_by_the_body_and_keeps_little_spare() {
        let long = "w".repeat(100_000);
        let chat = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{long}"}},{{"role":"user","content":"{long}"}}]}}"#
        );
        let r = parse(chat.as_bytes(), None).expect("parses");
        let [Segment::Text(t)] = r.segments.as_slice() else {
            panic!("one text segment: {:?}", r.segments.len());
        };
        assert_eq!(*t, format!("system\n{long}\nuser\n{long}\n"));
        assert!(
            t.capacity() <= chat.len(),
            "{} > {}",
            t.capacity(),
            chat.len()
        );

        let image = "A".repeat(400_000);
        let mixed = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}}]}}]}}"#
        );
        let r = parse(mixed.as_bytes(), None).expect("parses");
        let Some(Segment::Text(t)) = r.segments.first() else {
            panic!("text first: {:?}", r.segments.len());
        };
        assert_eq!(t, "user\nlook");
        assert!(t.capacity() <= 2 * t.len(), "spare kept: {}", t.capacity());
        assert_eq!(text_of(br#"{"model":"m","prompt":["a","b"]}"#), "ab");
    }

    /// Prompt strings read as bytes still decode escapes, take null content,
    /// and refuse bytes that are not UTF-8 or a value of the wrong type, naming
    /// the field.
    #[test]
    fn prompt_strings_read_as_bytes_decode_escapes_and_refuse_bad_bytes() {
        let chat = |content: &[u8]| {
            let mut b = br#"{"model":"m","messages":[{"role":"user","content":"#.to_vec();
            b.extend_from_slice(content);
            b.extend_from_slice(b"}]}");
            b
        };
        assert_eq!(text_of(&chat(br#""a\nb\u00e9""#)), "user\na\nb\u{e9}\n");
        assert_eq!(text_of(&chat(b"null")), "user\n\n");
        assert_eq!(
            text_of(br#"{"model":"m","prompt":"caf\u00e9"}"#),
            "caf\u{e9}"
        );
        assert_eq!(text_of(br#"{"model":"m","input":"hi"}"#), "hi");
        for bad in [&b"\"a\xff\""[..], b"\"\\n\xc3\"", b"5", b"{}"] {
            let err = parse(&chat(bad), None).expect_err("refused").to_string();
            assert!(err.contains("messages[0].content"), "{err}");
        }
        let err = parse(b"{\"model\":\"m\",\"prompt\":\"\xfe\"}", None)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("prompt") && err.contains("UTF-8"), "{err}");
    }
}
