//! The tokenizer: a request's prompt or chat rendered and tokenized, images
//! expanded in place for vision models.

use std::sync::Arc;

use minijinja::value::Value as JValue;
use minijinja::Environment;
use serde_json::{Map, Value};

use crate::multimodal::dims::image_size;
use crate::multimodal::identity::{self, ImageIdentity};
use crate::multimodal::remote::KnownImages;
use crate::multimodal::routing::{expand_images, ExpandError, PromptImage};
use crate::multimodal::{MmRouting, MmStats, VisionPrompt};
use crate::request::{ChatInput, InferenceRequest, PromptPart, Segment, TemplateInput};

use super::error::TokenizeError;
use super::template::{chat_messages, json_field, IMAGE_MARK, TEMPLATE};

/// A loaded tokenizer with its chat template.
pub struct Tokenizer {
    pub(super) inner: tokenizers::Tokenizer,
    pub(super) env: Option<Environment<'static>>,
    /// Special tokens passed to the template (`bos_token`, `eos_token`, …).
    pub(super) special: Map<String, Value>,
    /// Whether the template iterates over content parts (OpenAI content format)
    /// rather than reading content as a string.
    pub(super) parts_content: bool,
    /// The vision model, when images are tokenized exactly.
    pub(super) vision: Option<Vision>,
    /// Multimodal counters.
    pub(super) mm_stats: Arc<MmStats>,
}

/// A vision model resolved against the tokenizer.
#[derive(Debug)]
pub(super) struct Vision {
    pub(super) prompt: VisionPrompt,
    /// Token ids of the image token: one id, or several when the tokenizer splits it.
    pub(super) image_token_ids: Vec<u32>,
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

impl Tokenizer {
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
