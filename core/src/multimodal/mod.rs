//! Multimodal routing: image blocks that equal the engines' own KV blocks.
//!
//! Pure, no network types. The parts:
//! - [`identity`]: an image's 64-bit `mm_hash` (content for `data:` URLs, URL
//!   otherwise), SGLang's pad value, the forms the engines take it in, and
//!   reading it back from vLLM `extra_keys`;
//! - [`dims`]: image size from the PNG / JPEG / WebP / GIF header;
//! - [`tokens`]: how many prompt tokens an image becomes, per model family;
//! - [`hints`]: writing the hashes into the request for the engine;
//! - [`remote`]: the optional bounded fetch-and-hash of remote image URLs
//!   (the fetcher is glue: `kvpick::multimodal::fetch`);
//! - [`routing`]: expanding a prompt's image placeholders into pad values, and
//!   normalizing vLLM event blocks into the same form.
//!
//! How precise routing gets depends on what kvpick knows ([`MmRouting`]).

pub mod dims;
pub mod hints;
pub mod identity;
pub mod remote;
pub mod routing;
pub mod tokens;

use std::sync::atomic::{AtomicU64, Ordering};

pub use tokens::{VisionFamily, VisionModel};

/// Tokens an image of unknown size is counted as (LLaVA-1.5's fixed count, the
/// order of a typical image in every supported family).
pub const DEFAULT_IMAGE_TOKENS: u32 = 576;

/// Bytes of a `data:` URL's payload read for its header; a JPEG frame header
/// after large EXIF blocks may need most of this.
pub const HEADER_BYTES: usize = 64 * 1024;

/// The prompt tokens an image URL costs: counted from the image header when the
/// URL is a `data:` URL and `model` is known, else [`DEFAULT_IMAGE_TOKENS`].
/// Decodes at most [`HEADER_BYTES`] of the payload.
pub fn estimate_image_tokens(url: &str, model: Option<&VisionModel>) -> u32 {
    model
        .and_then(|m| {
            let header = identity::data_url_header(url, HEADER_BYTES)?;
            let size = dims::image_size(&header).ok()?;
            m.image_tokens(size).ok()
        })
        .unwrap_or(DEFAULT_IMAGE_TOKENS)
}

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

/// Multimodal counters: the core counts, telemetry reads.
#[derive(Debug, Default)]
pub struct MmStats {
    content_images: AtomicU64,
    url_images: AtomicU64,
    exact: AtomicU64,
    approximate: AtomicU64,
    text_only: AtomicU64,
}

impl MmStats {
    /// Counts one image identity.
    pub fn record_image(&self, source: identity::IdentitySource) {
        match source {
            identity::IdentitySource::Content => &self.content_images,
            identity::IdentitySource::Url => &self.url_images,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one request with images, by how it was routed.
    pub fn record_request(&self, mode: MmRouting) {
        self.requests_cell(mode).fetch_add(1, Ordering::Relaxed);
    }

    /// Image identities computed from `source`.
    pub fn images(&self, source: identity::IdentitySource) -> u64 {
        match source {
            identity::IdentitySource::Content => &self.content_images,
            identity::IdentitySource::Url => &self.url_images,
        }
        .load(Ordering::Relaxed)
    }

    /// Requests with images routed in `mode`.
    pub fn requests(&self, mode: MmRouting) -> u64 {
        self.requests_cell(mode).load(Ordering::Relaxed)
    }

    fn requests_cell(&self, mode: MmRouting) -> &AtomicU64 {
        match mode {
            MmRouting::Exact => &self.exact,
            MmRouting::Approximate => &self.approximate,
            MmRouting::TextOnly => &self.text_only,
        }
    }
}
