//! Multimodal routing: image blocks that equal the engines' own KV blocks.
//!
//! Pure, no network types. The parts:
//! - [`identity`]: an image's 64-bit `mm_hash` (content for `data:` URLs, URL
//!   otherwise), SGLang's pad value, the forms the engines take it in, and
//!   reading it back from vLLM `extra_keys`;
//! - [`dims`]: image size from the PNG / JPEG / WebP / GIF header;
//! - [`tokens`]: how many prompt tokens an image becomes, per model family;
//! - [`routing`]: expanding a prompt's image placeholders into pad values, and
//!   normalizing vLLM event blocks into the same form.
//!
//! How precise routing gets depends on what kvpick knows ([`MmRouting`]).

pub mod dims;
pub mod identity;
pub mod routing;
pub mod tokens;

pub use tokens::{VisionFamily, VisionModel};

/// How multimodal requests are routed, given kvpick's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MmRouting {
    /// Token-exact: a tokenizer and a vision model are configured, so image token
    /// positions carry pad values and blocks equal the engines' blocks.
    Exact,
    /// No tokenizer: text is hashed in byte blocks and each image is one block
    /// keyed by its identity; matches kvpick's own routing history, never
    /// engine events.
    Approximate,
    /// A tokenizer but no vision model: blocks up to the first image can match
    /// engine blocks, nothing after it.
    TextOnly,
}

impl MmRouting {
    /// The mode for a configuration.
    pub fn for_config(tokenizer: bool, vision_model: bool) -> MmRouting {
        match (tokenizer, vision_model) {
            (true, true) => MmRouting::Exact,
            (true, false) => MmRouting::TextOnly,
            (false, _) => MmRouting::Approximate,
        }
    }

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            MmRouting::Exact => "exact",
            MmRouting::Approximate => "approximate",
            MmRouting::TextOnly => "text_only",
        }
    }
}

/// A vision model as the tokenizer uses it: the model plus the placeholder text
/// per image and the token the engine repeats for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionPrompt {
    /// Family and processor settings.
    pub model: VisionModel,
    /// Text standing for one image in the prompt (what the chat template emits).
    pub placeholder: String,
    /// The token (text) repeated once per image token by the engine.
    pub image_token: String,
}

impl VisionPrompt {
    /// The family's defaults.
    pub fn new(family: VisionFamily) -> Self {
        VisionPrompt {
            model: VisionModel::new(family),
            placeholder: family.default_placeholder().to_string(),
            image_token: family.default_image_token().to_string(),
        }
    }
}
