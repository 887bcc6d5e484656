//! In-process tokenization, so request blocks match the blocks engines report in
//! KV events.
//!
//! [`Tokenizer::load`] reads a HuggingFace model directory: `tokenizer.json` (the
//! `tokenizers` crate) and the chat template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`). Chat requests are rendered the way
//! vLLM renders them with transformers' Jinja settings (`trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a Python-style
//! `tojson`, Python string methods) with `messages`, `tools`,
//! `add_generation_prompt: true`, the special tokens (`bos_token`, `eos_token`, …)
//! and the request's `chat_template_kwargs`; the result is tokenized without
//! special tokens. Completion prompts are tokenized with special tokens (BOS).
//! `nvext.use_raw_prompt` needs nothing: as in Dynamo, a completions prompt is
//! tokenized as is and a chat body (no raw prompt) still gets its template.
//!
//! Images: each image part is replaced by a marker while rendering; the rendered
//! text is split at the markers and the result is `Tokens, Image, Tokens, …`, so
//! blocks after an image are chained to that image's hash and the text before it
//! tokenizes exactly as the engine's.
//!
//! The tokenizer renders from what the one pass over the body kept for it
//! ([`TemplateInput`], parsed with [`ParseOptions::template`](crate::request::ParseOptions)):
//! the body is not read again. Only the small JSON fields the template may print
//! as they are (`tools`, `chat_template_kwargs`, a message's `name`,
//! `tool_call_id`, `tool_calls`, …) are read from their kept JSON text.
//!
//! [`TokenizerPool`] runs tokenization on tokio's blocking threads behind a
//! semaphore, so a 200 KB prompt never stalls the async threads serving other
//! streams, and at most `threads` prompts are tokenized at once.

use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};
use tokio::sync::Semaphore;

use crate::multimodal::dims::image_size;
use crate::multimodal::identity::{self, ImageIdentity};
use crate::multimodal::remote::{KnownImages, RemoteImages};
use crate::multimodal::routing::{expand_images, ExpandError, PromptImage};
use crate::multimodal::{MmRouting, MmStats, VisionPrompt};
use crate::request::{
    ChatInput, ContentPart, InferenceRequest, MessageField, PromptPart, Segment, TemplateInput,
};

/// Why a tokenizer could not be loaded or a request not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate can load.
    #[error("cannot load tokenizer.json")]
    Load(#[source] tokenizers::Error),
    /// `tokenizer_config.json` is not valid JSON.
    #[error("tokenizer_config.json is not valid JSON")]
    Config(#[source] serde_json::Error),
    /// The chat template does not compile or failed to render.
    #[error("chat template failed")]
    Template(#[source] minijinja::Error),
    /// A chat request arrived but the model has no chat template.
    #[error("the model directory has no chat template")]
    NoTemplate,
    /// A field kept as JSON text is not JSON (the parse kept it from a valid body).
    #[error("request field `{field}`")]
    Field {
        /// The field.
        field: String,
        /// Why it does not read.
        #[source]
        source: serde_json::Error,
    },
    /// The request was parsed without [`ParseOptions::template`](crate::request::ParseOptions).
    #[error("the request was parsed without its template input")]
    NoTemplateInput,
    /// Encoding failed.
    #[error("encoding failed")]
    Encode(#[source] tokenizers::Error),
    /// The vision model's image token is not a single token id, or encodes to none.
    #[error("vision: image token {0:?} is not one token")]
    ImageToken(String),
    /// A prompt's image tokens do not pair with its images.
    #[error("vision: the prompt's image tokens do not pair with its images")]
    ImagePairing(#[source] ExpandError),
    /// The tokenizer's task pool is closed (the process is shutting down).
    #[error("tokenization pool closed")]
    Closed(#[source] tokio::sync::AcquireError),
    /// The blocking tokenization task panicked or was cancelled.
    #[error("tokenization task failed")]
    Task(#[source] tokio::task::JoinError),
}

const TEMPLATE: &str = "chat";

/// Marks where an image was in the rendered prompt (private-use characters).
const IMAGE_MARK: &str = "\u{F8FF}kvpick-image\u{F8FF}";

/// A loaded tokenizer with its chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    env: Option<Environment<'static>>,
    /// Special tokens passed to the template (`bos_token`, `eos_token`, …).
    special: Map<String, Value>,
    /// Whether the template iterates over content parts (OpenAI content format)
    /// rather than reading content as a string.
    parts_content: bool,
    /// The vision model, when images are tokenized exactly.
    vision: Option<Vision>,
    /// Multimodal counters.
    mm_stats: Arc<MmStats>,
}

/// A vision model resolved against the tokenizer.
#[derive(Debug)]
struct Vision {
    prompt: VisionPrompt,
    /// Token ids of the image token: one id, or several when the tokenizer splits it.
    image_token_ids: Vec<u32>,
}

/// What the glue needs to know about each image of a tokenized request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedImage {
    /// Its identity.
    pub identity: ImageIdentity,
    /// Prompt tokens it became; `None` when its size is unknown (remote URL), in
    /// which case it and everything after it is hashed apart from engine blocks.
    pub tokens: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("chat_template", &self.env.is_some())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Option<String>, TokenizeError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// A special token in `tokenizer_config.json`: a string or an AddedToken object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and the chat template from a model directory.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let json = read(&path)?.ok_or_else(|| TokenizeError::Io {
            path: path.display().to_string(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        let inner: tokenizers::Tokenizer = json.parse().map_err(TokenizeError::Load)?;
        let config: Map<String, Value> = match read(&dir.join("tokenizer_config.json"))? {
            Some(s) => serde_json::from_str(&s).map_err(TokenizeError::Config)?,
            None => Map::new(),
        };
        let template = match read(&dir.join("chat_template.jinja"))? {
            Some(t) => Some(t),
            None => match config.get("chat_template") {
                Some(Value::String(t)) => Some(t.clone()),
                // A list of named templates: use "default" (or the first).
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(String::from),
                _ => None,
            },
        };
        let mut special = Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = config.get(key).and_then(token_text) {
                special.insert(key.to_string(), Value::String(t));
            }
        }
        let parts_content = template.as_deref().is_some_and(iterates_content);
        let env = template.map(chat_environment).transpose()?;
        Ok(Tokenizer {
            inner,
            env,
            special,
            parts_content,
            vision: None,
            mm_stats: Arc::default(),
        })
    }

    /// Tokenizes images exactly for `prompt`'s model: the chat template gets image
    /// parts (or, for string-content templates, the placeholder text first in the
    /// message, as vLLM inserts it) and each image token in the result is
    /// replaced by the image's token count of SGLang pad values.
    pub fn with_vision(mut self, prompt: VisionPrompt) -> Result<Self, TokenizeError> {
        let image_token_ids = match self.inner.token_to_id(&prompt.image_token) {
            Some(id) => vec![id],
            None => self.encode(&prompt.image_token, false)?,
        };
        if image_token_ids.is_empty() {
            return Err(TokenizeError::ImageToken(prompt.image_token.clone()));
        }
        self.vision = Some(Vision {
            prompt,
            image_token_ids,
        });
        Ok(self)
    }

    /// The single token id of the vision model's image token, if it is one token
    /// (what vLLM puts at image positions of its `BlockStored` token ids).
    pub fn image_token_id(&self) -> Option<u32> {
        match self.vision.as_ref()?.image_token_ids.as_slice() {
            [id] => Some(*id),
            _ => None,
        }
    }

    /// Whether a vision model is configured.
    pub fn has_vision(&self) -> bool {
        self.vision.is_some()
    }

    /// Records into `stats` (shared with the rest of the process) from now on.
    pub fn with_mm_stats(mut self, stats: Arc<MmStats>) -> Self {
        self.mm_stats = stats;
        self
    }

    /// Multimodal counters (image identities, requests by routing mode).
    pub fn mm_stats(&self) -> &Arc<MmStats> {
        &self.mm_stats
    }

    /// Renders a chat (`messages`, optional `tools` and `chat_template_kwargs`)
    /// to the prompt string; images become markers.
    pub fn render_chat(&self, chat: &ChatInput) -> Result<(String, Vec<String>), TokenizeError> {
        let env = self.env.as_ref().ok_or(TokenizeError::NoTemplate)?;
        let placeholder = self.vision.as_ref().map(|v| v.prompt.placeholder.as_str());
        let (messages, images) = chat_messages(chat, self.parts_content, placeholder)?;
        let mut ctx = Map::new();
        if let Some(kw) = &chat.chat_template_kwargs {
            if let Value::Object(kw) = json_field("chat_template_kwargs", kw)? {
                ctx.extend(kw);
            }
        }
        ctx.extend(self.special.clone());
        ctx.insert("messages".into(), Value::Array(messages));
        let tools = match &chat.tools {
            Some(t) => json_field("tools", t)?,
            None => Value::Null,
        };
        ctx.insert("tools".into(), tools);
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        let template = env
            .get_template(TEMPLATE)
            .map_err(TokenizeError::Template)?;
        let text = template
            .render(JValue::from(minijinja::value::Serde(&ctx)))
            .map_err(TokenizeError::Template)?;
        Ok((text, images))
    }

    /// Tokenizes a parsed request (parsed with its template input) into token
    /// segments, with image segments where the images were.
    pub fn tokenize_request(
        &self,
        request: &InferenceRequest,
    ) -> Result<Vec<Segment>, TokenizeError> {
        let input = request
            .template
            .as_ref()
            .ok_or(TokenizeError::NoTemplateInput)?;
        self.tokenize_input(input, &KnownImages::default())
    }

    /// Tokenizes a request's template input. Remote images in `known` (fetched)
    /// are identified by content and sized from their header, like `data:` URLs.
    pub fn tokenize_input(
        &self,
        input: &TemplateInput,
        known: &KnownImages,
    ) -> Result<Vec<Segment>, TokenizeError> {
        let chat = match input {
            TemplateInput::Prompt(parts) => return self.tokenize_prompt(parts),
            TemplateInput::Chat(chat) => chat,
        };
        let (text, images) = self.render_chat(chat)?;
        match &self.vision {
            Some(v) if !images.is_empty() => {
                let (segments, imgs) = self.expand_vision(v, &text, &images, known)?;
                for i in &imgs {
                    self.mm_stats.record_image(i.identity.source);
                }
                let exact = imgs.iter().all(|i| i.tokens.is_some());
                self.mm_stats.record_request(if exact {
                    MmRouting::Exact
                } else {
                    MmRouting::Approximate
                });
                Ok(segments)
            }
            None if !images.is_empty() => {
                for url in &images {
                    self.mm_stats.record_image(identity::identify(url).source);
                }
                self.mm_stats.record_request(MmRouting::TextOnly);
                self.split_at_images(&text, images, false)
            }
            _ => self.split_at_images(&text, images, false),
        }
    }

    /// Tokenizes a completions prompt: each string with special tokens (BOS),
    /// token ids kept.
    fn tokenize_prompt(&self, parts: &[PromptPart]) -> Result<Vec<Segment>, TokenizeError> {
        let mut tokens = Vec::new();
        for part in parts {
            match part {
                PromptPart::Text(s) => tokens.extend(self.encode(s, true)?),
                PromptPart::Tokens(t) => tokens.extend_from_slice(t),
            }
        }
        Ok(vec![Segment::Tokens(tokens)])
    }

    /// The rendered prompt's token ids with every image token expanded into pad
    /// values. Images of unknown size (remote URLs not in `known`) stop the
    /// expansion: tokens up to that image, the image as a [`Segment::Image`],
    /// then the rest unexpanded.
    fn expand_vision(
        &self,
        v: &Vision,
        text: &str,
        urls: &[String],
        known: &KnownImages,
    ) -> Result<(Vec<Segment>, Vec<TokenizedImage>), TokenizeError> {
        let ids = self.encode(text, false)?;
        let mut images = Vec::with_capacity(urls.len());
        let mut sized = Vec::with_capacity(urls.len());
        for url in urls {
            let (identity, size) = match known.get(url) {
                Some(k) => (k.identity, Some(k.size)),
                None => {
                    let r = identity::resolve(url);
                    let size = r.bytes.as_deref().and_then(|b| image_size(b).ok());
                    (r.identity, size)
                }
            };
            let tokens = size.and_then(|size| v.prompt.model.image_tokens(size).ok());
            if let (Some(t), true) = (tokens, sized.len() == images.len()) {
                sized.push(PromptImage {
                    mm_hash: identity.mm_hash,
                    tokens: t,
                });
            }
            images.push(TokenizedImage { identity, tokens });
        }
        if sized.len() == images.len() {
            let tokens = expand_images(&ids, &v.image_token_ids, &sized)
                .map_err(TokenizeError::ImagePairing)?;
            return Ok((vec![Segment::Tokens(tokens)], images));
        }
        // Cut at the first image of unknown size.
        let cut = sized.len();
        let ph = &v.image_token_ids;
        let mut seen = 0;
        let mut at = None;
        let mut i = 0;
        while i < ids.len() {
            if ids[i..].starts_with(ph) {
                if seen == cut {
                    at = Some(i);
                    break;
                }
                seen += 1;
                i += ph.len();
            } else {
                i += 1;
            }
        }
        let at = at.ok_or(TokenizeError::ImagePairing(ExpandError::Count {
            found: seen,
            images: urls.len(),
        }))?;
        let head = expand_images(&ids[..at], ph, &sized).map_err(TokenizeError::ImagePairing)?;
        let mut out = vec![Segment::Tokens(head), Segment::Image(urls[cut].clone())];
        let tail = &ids[at + ph.len()..];
        if !tail.is_empty() {
            out.push(Segment::Tokens(tail.to_vec()));
        }
        Ok((out, images))
    }

    fn split_at_images(
        &self,
        text: &str,
        images: Vec<String>,
        special: bool,
    ) -> Result<Vec<Segment>, TokenizeError> {
        let mut out = Vec::with_capacity(images.len() * 2 + 1);
        let mut pieces = text.split(IMAGE_MARK);
        let first = pieces.next().unwrap_or_default();
        out.push(Segment::Tokens(self.encode(first, special)?));
        let mut images = images.into_iter();
        for piece in pieces {
            if let Some(url) = images.next() {
                out.push(Segment::Image(url));
            }
            let ids = self.encode(piece, false)?;
            if !ids.is_empty() {
                out.push(Segment::Tokens(ids));
            }
        }
        Ok(out)
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS) when `special`.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.inner
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(TokenizeError::Encode)
    }
}

/// Whether a template loops over message content parts (vLLM's "openai" content
/// format) instead of printing the content as a string.
fn iterates_content(template: &str) -> bool {
    let t: String = template.chars().filter(|c| !c.is_whitespace()).collect();
    [
        "inmessage['content']",
        "inmessage[\"content\"]",
        "inmessage.content",
    ]
    .iter()
    .any(|p| t.contains(p))
}

/// A field kept as JSON text, as a value.
fn json_field(field: &str, json: &str) -> Result<Value, TokenizeError> {
    serde_json::from_str(json).map_err(|source| TokenizeError::Field {
        field: field.to_string(),
        source,
    })
}

/// The OpenAI messages of a chat, with content normalized the way vLLM hands
/// it to the template, and the image URLs in order.
fn chat_messages(
    chat: &ChatInput,
    parts_content: bool,
    placeholder: Option<&str>,
) -> Result<(Vec<Value>, Vec<String>), TokenizeError> {
    let mut images = Vec::new();
    let mut out = Vec::with_capacity(chat.messages.len());
    for m in &chat.messages {
        // Inserted in body order: a repeated key keeps its first place and last value.
        let mut message = Map::new();
        for (key, field) in &m.fields {
            let value = match field {
                MessageField::Null => Value::Null,
                MessageField::Text(t) => Value::String(t.clone()),
                MessageField::Json(j) => json_field(key, j)?,
                MessageField::Parts(parts) => {
                    normalize_parts(parts, &mut images, parts_content, placeholder)
                }
            };
            message.insert(key.clone(), value);
        }
        out.push(Value::Object(message));
    }
    Ok((out, images))
}

/// Content parts as the template gets them; image URLs are appended to `images`.
fn normalize_parts(
    parts: &[ContentPart],
    images: &mut Vec<String>,
    parts_content: bool,
    placeholder: Option<&str>,
) -> Value {
    // Each part as text, or `None` for an image (its URL recorded).
    let items: Vec<Option<String>> = parts
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => Some(t.clone()),
            ContentPart::Image(url) => {
                images.push(url.clone());
                None
            }
        })
        .collect();
    match (parts_content, placeholder) {
        // Without a vision model an image is a marker in the text.
        (true, None) => Value::Array(
            items
                .into_iter()
                .map(|t| {
                    serde_json::json!({"type": "text", "text": t.unwrap_or_else(|| IMAGE_MARK.to_string())})
                })
                .collect(),
        ),
        (false, None) => Value::String(
            items
                .into_iter()
                .map(|t| t.unwrap_or_else(|| IMAGE_MARK.to_string()))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        // With one, the template sees image parts and emits the model's
        // placeholder itself, as vLLM's "openai" content format does.
        (true, Some(_)) => Value::Array(
            items
                .into_iter()
                .map(|t| match t {
                    Some(t) => serde_json::json!({"type": "text", "text": t}),
                    None => serde_json::json!({"type": "image"}),
                })
                .collect(),
        ),
        // String-content templates: vLLM puts one placeholder per image
        // first, then the text parts, all joined by newlines.
        (false, Some(ph)) => {
            let n = items.iter().filter(|t| t.is_none()).count();
            let text: Vec<String> = items.into_iter().flatten().collect();
            let mut all: Vec<String> = vec![ph.to_string(); n];
            all.push(text.join("\n"));
            Value::String(all.join("\n"))
        }
    }
}

/// A Jinja environment configured like transformers' chat template renderer.
fn chat_environment(template: String) -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(TokenizeError::Template)?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, JError> {
        Err(JError::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |_fmt: String| -> String {
        // Keeps prompts stable for caching; templates use this for a date line.
        String::new()
    });
    env.add_filter("tojson", py_tojson);
    env.add_template_owned(TEMPLATE, template)
        .map_err(TokenizeError::Template)?;
    Ok(env)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// with Python's separators (`", "` and `": "`), no HTML escaping.
fn py_tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(&mut out, &value, indent, 0)?;
    Ok(JValue::from_safe_string(out))
}

fn write_py_json(
    out: &mut String,
    v: &JValue,
    indent: Option<usize>,
    level: usize,
) -> Result<(), JError> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64().filter(|_| v.is_integer()) {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else {
                    out.push_str(&f.to_string());
                }
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).unwrap_or_default())
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_json(out, item, indent, level + 1)?;
            }
            if !items.is_empty() {
                newline(out, level);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<JValue> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = k
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&key).unwrap_or_default());
                out.push_str(": ");
                write_py_json(out, &v.get_item(k)?, indent, level + 1)?;
            }
            if !keys.is_empty() {
                newline(out, level);
            }
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
    }
    Ok(())
}

/// Tokenization on a bounded pool of blocking threads.
#[derive(Debug, Clone)]
pub struct TokenizerPool {
    tokenizer: Arc<Tokenizer>,
    permits: Arc<Semaphore>,
    /// Fetches remote images before tokenizing (`--mm-fetch`).
    remote: Option<Arc<RemoteImages>>,
}

impl TokenizerPool {
    /// A pool tokenizing at most `threads` requests at once.
    pub fn new(tokenizer: Tokenizer, threads: usize) -> Self {
        TokenizerPool {
            tokenizer: Arc::new(tokenizer),
            permits: Arc::new(Semaphore::new(threads.max(1))),
            remote: None,
        }
    }

    /// Fetches remote images through `remote` before tokenizing
    /// ([`Self::tokenize_fetching`]).
    pub fn with_remote_images(mut self, remote: Arc<RemoteImages>) -> Self {
        self.remote = Some(remote);
        self
    }

    /// The tokenizer itself (for synchronous use in tests and tools).
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokenizes a request's template input off the async threads. The
    /// result replaces the request's text segments: token ids, with image
    /// segments where images were.
    pub async fn tokenize(&self, input: TemplateInput) -> Result<Vec<Segment>, TokenizeError> {
        self.tokenize_known(input, KnownImages::default()).await
    }

    /// [`Self::tokenize`], first fetching the remote images among `image_urls`
    /// when fetching is on (and the tokenizer has a vision model to size them
    /// with); the fetched images are returned with the tokens, for the hints
    /// that tell the engine the same identities.
    pub async fn tokenize_fetching(
        &self,
        input: TemplateInput,
        image_urls: &[String],
    ) -> (Result<Vec<Segment>, TokenizeError>, KnownImages) {
        let known = match &self.remote {
            Some(remote) if self.tokenizer.has_vision() => {
                remote.resolve(image_urls.iter().map(String::as_str)).await
            }
            _ => KnownImages::default(),
        };
        let tokens = self.tokenize_known(input, known.clone()).await;
        (tokens, known)
    }

    async fn tokenize_known(
        &self,
        input: TemplateInput,
        known: KnownImages,
    ) -> Result<Vec<Segment>, TokenizeError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(TokenizeError::Closed)?;
        let tok = Arc::clone(&self.tokenizer);
        tokio::task::spawn_blocking(move || tok.tokenize_input(&input, &known))
            .await
            .map_err(TokenizeError::Task)?
    }
}

/// All token ids of tokenized segments, images skipped.
pub fn token_ids(segments: &[Segment]) -> Vec<u32> {
    segments
        .iter()
        .filter_map(|s| match s {
            Segment::Tokens(t) => Some(t.as_slice()),
            _ => None,
        })
        .flatten()
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{ApiKind, ParseOptions};

    fn render(template: &str, ctx: Value) -> String {
        let env = chat_environment(template.to_string()).unwrap();
        env.get_template(TEMPLATE)
            .unwrap()
            .render(JValue::from(minijinja::value::Serde(&ctx)))
            .unwrap()
    }

    #[test]
    fn tojson_is_python_style_and_keeps_key_order() {
        let ctx = serde_json::json!({"x": {"b": 1, "a": [true, null, "<é>"], "f": 2.0}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": 1, "a": [true, null, "<é>"], "f": 2.0}"#
        );
        assert_eq!(
            render("{{ x.a | tojson(indent=2) }}", ctx),
            "[\n  true,\n  null,\n  \"<é>\"\n]"
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let ctx = serde_json::json!({"s": "  Hi  "});
        assert_eq!(render("{{ s.strip().upper() }}", ctx.clone()), "HI");
        let env = chat_environment("{{ raise_exception('nope') }}".into()).unwrap();
        let err = env
            .get_template(TEMPLATE)
            .unwrap()
            .render(JValue::from(minijinja::value::Serde(&ctx)))
            .unwrap_err();
        assert!(err.to_string().contains("nope"));
    }

    fn parsed(kind: ApiKind, body: &str) -> InferenceRequest {
        let options = ParseOptions {
            token_limit: usize::MAX,
            template: true,
        };
        crate::request::parse_with(body.as_bytes(), Some(kind), options).unwrap()
    }

    fn fixture(template: &str) -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
        let mut tok = Tokenizer::load(dir).unwrap();
        tok.env = Some(chat_environment(template.to_string()).unwrap());
        tok.parts_content = false;
        tok
    }

    /// The parsed request renders exactly as the whole body read as a `Value`
    /// did: every message field in order (`name`, `tool_call_id`, repeated
    /// keys), `tools` and `chat_template_kwargs` as given, numbers as written.
    #[test]
    fn a_parsed_chat_renders_like_the_body_read_as_a_value() {
        let tok = fixture(
            "{{ messages | tojson }}|{{ tools | tojson }}|{{ enable_thinking }}|{{ bos_token }}|\
             {% for m in messages %}{{ m.role }}:{{ m.name }}:{{ m.tool_call_id }};{% endfor %}\
             {{ add_generation_prompt }}",
        );
        let body = r#"{"model":"m","messages":[
            {"role":"system","content":"be brief","name":"sys"},
            {"name":"ann","role":"user","content":[{"type":"text","text":"hi"},"there"]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"x\": 1.0}"}}]},
            {"tool_call_id":"c1","role":"tool","content":"42","extra":{"b":1,"a":[1.5,null,2.0]}},
            {"role":"user","name":"x","content":"again","name":"y"}],
            "tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2.50}}}],
            "chat_template_kwargs":{"enable_thinking":false,"bos_token":"ignored"},
            "nvext":{"backend_instance_id":3}}"#;
        let TemplateInput::Chat(chat) = parsed(ApiKind::Chat, body).template.unwrap() else {
            panic!("a chat")
        };
        // The context as the tokenizer used to build it from the body's `Value`.
        let value: Value = serde_json::from_str(body).unwrap();
        let mut messages = value["messages"].clone();
        messages[1]["content"] = Value::String("hi\nthere".into());
        let mut ctx = value["chat_template_kwargs"].as_object().unwrap().clone();
        ctx.extend(tok.special.clone());
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), value["tools"].clone());
        ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        let expected = tok
            .env
            .as_ref()
            .unwrap()
            .get_template(TEMPLATE)
            .unwrap()
            .render(JValue::from(minijinja::value::Serde(&ctx)))
            .unwrap();
        let (text, images) = tok.render_chat(&chat).unwrap();
        assert!(images.is_empty());
        assert_eq!(text, expected);
        assert!(text.contains(r#""name": "y""#), "{text}");
        assert!(text.contains("tool::c1;"), "{text}");
        assert!(text.contains(r#""a": 2.5"#), "{text}");
        assert!(text.contains("|False|<s>|"), "{text}");
    }

    /// Each string of a completions prompt is encoded on its own, with its BOS.
    #[test]
    fn completion_prompt_items_keep_their_boundaries() {
        let tok = fixture("");
        let req = parsed(
            ApiKind::Completions,
            r#"{"model":"m","prompt":["good morning",[7,8],"the cat"]}"#,
        );
        let mut expected = tok.encode("good morning", true).unwrap();
        expected.extend([7, 8]);
        expected.extend(tok.encode("the cat", true).unwrap());
        assert_eq!(
            tok.tokenize_request(&req).unwrap(),
            vec![Segment::Tokens(expected.clone())]
        );
        let bos = expected[0];
        assert_eq!(expected.iter().filter(|&&t| t == bos).count(), 2);
        // Parsed without the template input, there is nothing to render.
        let plain = crate::request::parse(br#"{"model":"m","prompt":"x"}"#, None).unwrap();
        assert!(matches!(
            tok.tokenize_request(&plain),
            Err(TokenizeError::NoTemplateInput)
        ));
    }

    #[test]
    fn content_format_detection() {
        assert!(iterates_content(
            "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
        ));
        assert!(!iterates_content("{{ message['content'] }}"));
    }
}
