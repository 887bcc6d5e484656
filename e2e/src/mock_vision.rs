//! The mock worker's multimodal engine, in SGLang's pad_value mode: chat prompts
//! are rendered with the model's chat template and tokenized with its tokenizer,
//! every image token is expanded into the image's token count (from its header
//! and the model's processor settings), and each image position holds
//! `pad_value(mm_hash)`, as SGLang's radix cache (and so its `BlockStored`
//! token ids) holds them.
//!
//! The hash is the one in `nvext.mm_hashes` when the request carries one per
//! image (what sglang#25300 lets a router hand the engine); otherwise the
//! engine's own, modelled as a different function of the image than kvpick's,
//! so a router that does not hand over its hashes never matches image blocks.

use std::path::Path;
use std::sync::Arc;

use kvpick::multimodal::dims::image_size;
use kvpick::multimodal::identity::{decode_data_url, identify};
use kvpick::multimodal::routing::{expand_images, PromptImage};
use kvpick::multimodal::{VisionModel, VisionPrompt};
use kvpick::request::{parse_with, ApiKind, ParseOptions, TemplateInput};
use kvpick::tokenize::{TokenizeError, Tokenizer};
use serde_json::Value;

/// The engine side of a vision model.
#[derive(Debug, Clone)]
pub struct MockVision {
    tokenizer: Arc<Tokenizer>,
    model: VisionModel,
    image_token: u32,
}

/// A chat prompt as the engine holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionTokens {
    /// Token ids with pad values at image positions.
    pub tokens: Vec<u32>,
    /// Image tokens among them.
    pub image_tokens: usize,
    /// Whether the hashes came from the request (`nvext.mm_hashes`).
    pub hashes_given: bool,
}

impl MockVision {
    /// Loads the model's tokenizer directory for `prompt`'s vision model.
    pub fn load(dir: &Path, prompt: VisionPrompt) -> Result<Self, TokenizeError> {
        let model = prompt.model.clone();
        let prompt_token = prompt.image_token.clone();
        let tokenizer = Tokenizer::load(dir)?.with_vision(prompt)?;
        let image_token = tokenizer
            .image_token_id()
            .ok_or_else(|| TokenizeError::ImageToken(prompt_token.clone()))?;
        Ok(MockVision {
            tokenizer: Arc::new(tokenizer),
            model,
            image_token,
        })
    }

    /// The engine's own hash of an image (not kvpick's).
    pub fn native_hash(url: &str) -> u64 {
        identify(url).mm_hash.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15
    }

    /// The prompt tokens of a chat body.
    pub fn chat_tokens(&self, body: &Value) -> Result<VisionTokens, String> {
        let options = ParseOptions {
            limits: kvpick::request::PromptLimits::NONE,
            template: true,
        };
        let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        let parsed = parse_with(&bytes, Some(ApiKind::Chat), options).map_err(|e| e.to_string())?;
        let Some(TemplateInput::Chat(chat)) = parsed.template else {
            return Err("not a chat body".into());
        };
        let (text, urls) = self
            .tokenizer
            .render_chat(&chat)
            .map_err(|e| e.to_string())?;
        let ids = self
            .tokenizer
            .encode(&text, false)
            .map_err(|e| e.to_string())?;
        let given: Option<Vec<u64>> = body
            .get("nvext")
            .and_then(|n| n.get("mm_hashes"))
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|h| h.as_str().and_then(|s| u64::from_str_radix(s, 16).ok()))
                    .collect()
            })
            .filter(|h: &Vec<u64>| h.len() == urls.len());
        let mut images = Vec::with_capacity(urls.len());
        for (i, url) in urls.iter().enumerate() {
            let bytes = decode_data_url(url)
                .and_then(Result::ok)
                .ok_or_else(|| format!("image {i} is not a data: URL"))?;
            let size = image_size(&bytes).map_err(|e| format!("image {i}: {e}"))?;
            let tokens = self
                .model
                .image_tokens(size)
                .map_err(|e| format!("image {i}: {e}"))?;
            let mm_hash = match &given {
                Some(h) => h[i],
                None => Self::native_hash(url),
            };
            images.push(PromptImage { mm_hash, tokens });
        }
        let tokens =
            expand_images(&ids, &[self.image_token], &images).map_err(|e| e.to_string())?;
        Ok(VisionTokens {
            tokens,
            image_tokens: images.iter().map(|i| i.tokens as usize).sum(),
            hashes_given: given.is_some(),
        })
    }

    /// Token ids of generated text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer.encode(text, false).unwrap_or_default()
    }
}
