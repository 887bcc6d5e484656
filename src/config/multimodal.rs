//! In-process tokenization and the vision model's image tokens.

use std::path::PathBuf;

use crate::multimodal::{VisionFamily, VisionPrompt};

/// In-process tokenization and the vision model's image tokens.
#[derive(Debug, Clone, clap::Args)]
pub struct MultimodalFlags {
    /// Model directory with `tokenizer.json` (and `tokenizer_config.json` with the
    /// chat template): tokenize requests in-process so their blocks match KV events.
    #[arg(long, env = "KVPICK_TOKENIZER_DIR")]
    pub tokenizer_dir: Option<PathBuf>,

    /// Requests tokenized at once (on blocking threads, off the request path).
    #[arg(long, env = "KVPICK_TOKENIZER_THREADS", default_value_t = 2)]
    pub tokenizer_threads: usize,

    /// Vision model family of the served model (`qwen2-vl`, `qwen2.5-vl`,
    /// `qwen3-vl`, `llava-1.5`, `llava-next`): with `--tokenizer-dir`, image
    /// tokens are counted and carry SGLang pad values, so multimodal blocks match
    /// the engines' (exact multimodal routing).
    #[arg(long, env = "KVPICK_MM_MODEL_FAMILY", value_parser = parse_vision_family)]
    pub mm_model_family: Option<VisionFamily>,

    /// Vision patch size in pixels (`patch_size` of `preprocessor_config.json`).
    #[arg(long, env = "KVPICK_MM_PATCH_SIZE")]
    pub mm_patch_size: Option<u32>,

    /// Patches merged per side into one token (Qwen `merge_size`).
    #[arg(long, env = "KVPICK_MM_MERGE_SIZE")]
    pub mm_merge_size: Option<u32>,

    /// Fewest pixels after resizing (Qwen `min_pixels`).
    #[arg(long, env = "KVPICK_MM_MIN_PIXELS")]
    pub mm_min_pixels: Option<u64>,

    /// Most pixels after resizing (Qwen `max_pixels`).
    #[arg(long, env = "KVPICK_MM_MAX_PIXELS")]
    pub mm_max_pixels: Option<u64>,

    /// The token the engine repeats per image token (default per family:
    /// `<|image_pad|>`, `<image>`).
    #[arg(long, env = "KVPICK_MM_IMAGE_TOKEN")]
    pub mm_image_token: Option<String>,

    /// The text standing for one image in a prompt (default per family).
    #[arg(long, env = "KVPICK_MM_PLACEHOLDER")]
    pub mm_placeholder: Option<String>,
}

impl MultimodalFlags {
    /// The vision model the `--mm-*` flags describe, or `None` without a family.
    pub fn vision_prompt(&self) -> Option<VisionPrompt> {
        let mut v = VisionPrompt::new(self.mm_model_family?);
        let p = &mut v.model.processor;
        p.patch_size = self.mm_patch_size.unwrap_or(p.patch_size);
        p.merge_size = self.mm_merge_size.unwrap_or(p.merge_size);
        p.min_pixels = self.mm_min_pixels.unwrap_or(p.min_pixels);
        p.max_pixels = self.mm_max_pixels.unwrap_or(p.max_pixels);
        if let Some(t) = &self.mm_image_token {
            v.image_token = t.clone();
        }
        if let Some(t) = &self.mm_placeholder {
            v.placeholder = t.clone();
        }
        Some(v)
    }
}

fn parse_vision_family(s: &str) -> Result<VisionFamily, String> {
    VisionFamily::parse(s).ok_or_else(|| {
        format!("unknown vision model family {s:?} (qwen2-vl, qwen2.5-vl, qwen3-vl, llava-1.5, llava-next)")
    })
}
