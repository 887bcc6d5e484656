//! How many prompt tokens an image becomes, per model family, from its size and
//! the model's image-processor settings, computed as the HuggingFace processors
//! (and so vLLM and SGLang) compute them.
//!
//! - Qwen2-VL / Qwen2.5-VL / Qwen3-VL: `smart_resize` to multiples of
//!   `patch_size × merge_size` within `[min_pixels, max_pixels]`, then one token
//!   per `merge_size²` patches;
//! - LLaVA-1.5: a fixed `(image_size / patch_size)²` (576 for CLIP ViT-L/14-336);
//! - LLaVA-NeXT: "anyres": the base grid plus the unpadded feature grid of the
//!   best-fitting pinpoint resolution, with one newline token per feature row.

use super::dims::ImageSize;

/// A vision-language model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VisionFamily {
    /// Qwen2-VL.
    Qwen2Vl,
    /// Qwen2.5-VL.
    Qwen25Vl,
    /// Qwen3-VL.
    Qwen3Vl,
    /// LLaVA-1.5.
    Llava15,
    /// LLaVA-NeXT (LLaVA-1.6).
    LlavaNext,
}

impl VisionFamily {
    /// Parses a family name (`qwen2-vl`, `qwen2.5-vl`, `qwen3-vl`, `llava-1.5`,
    /// `llava-next`; case and `_`/`-` do not matter).
    pub fn parse(s: &str) -> Option<VisionFamily> {
        let s = s.to_ascii_lowercase().replace('_', "-");
        Some(match s.as_str() {
            "qwen2-vl" | "qwen2vl" => VisionFamily::Qwen2Vl,
            "qwen2.5-vl" | "qwen25-vl" | "qwen2.5vl" => VisionFamily::Qwen25Vl,
            "qwen3-vl" | "qwen3vl" => VisionFamily::Qwen3Vl,
            "llava-1.5" | "llava" | "llava15" => VisionFamily::Llava15,
            "llava-next" | "llava-1.6" | "llavanext" => VisionFamily::LlavaNext,
            _ => return None,
        })
    }

    /// The family's name as [`VisionFamily::parse`] reads it.
    pub fn as_str(self) -> &'static str {
        match self {
            VisionFamily::Qwen2Vl => "qwen2-vl",
            VisionFamily::Qwen25Vl => "qwen2.5-vl",
            VisionFamily::Qwen3Vl => "qwen3-vl",
            VisionFamily::Llava15 => "llava-1.5",
            VisionFamily::LlavaNext => "llava-next",
        }
    }

    /// The processor settings of the family's published checkpoints.
    pub fn default_processor(self) -> ProcessorConfig {
        match self {
            VisionFamily::Qwen2Vl | VisionFamily::Qwen25Vl => ProcessorConfig {
                patch_size: 14,
                merge_size: 2,
                min_pixels: 56 * 56,
                max_pixels: 28 * 28 * 16384,
                image_size: 0,
                grid_pinpoints: Vec::new(),
            },
            VisionFamily::Qwen3Vl => ProcessorConfig {
                patch_size: 16,
                merge_size: 2,
                min_pixels: 65_536,
                max_pixels: 16_777_216,
                image_size: 0,
                grid_pinpoints: Vec::new(),
            },
            VisionFamily::Llava15 => ProcessorConfig {
                patch_size: 14,
                merge_size: 1,
                min_pixels: 0,
                max_pixels: 0,
                image_size: 336,
                grid_pinpoints: Vec::new(),
            },
            VisionFamily::LlavaNext => ProcessorConfig {
                patch_size: 14,
                merge_size: 1,
                min_pixels: 0,
                max_pixels: 0,
                image_size: 336,
                grid_pinpoints: vec![(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)],
            },
        }
    }

    /// The text a chat prompt holds per image (what the model's chat template
    /// emits for an image part, and what vLLM inserts for string-content templates).
    pub fn default_placeholder(self) -> &'static str {
        match self {
            VisionFamily::Qwen2Vl | VisionFamily::Qwen25Vl | VisionFamily::Qwen3Vl => {
                "<|vision_start|><|image_pad|><|vision_end|>"
            }
            VisionFamily::Llava15 | VisionFamily::LlavaNext => "<image>",
        }
    }

    /// The token the engine repeats once per image feature (Qwen2-VL's placeholder
    /// is two tokens around this one).
    pub fn default_image_token(self) -> &'static str {
        match self {
            VisionFamily::Qwen2Vl | VisionFamily::Qwen25Vl | VisionFamily::Qwen3Vl => {
                "<|image_pad|>"
            }
            VisionFamily::Llava15 | VisionFamily::LlavaNext => "<image>",
        }
    }
}

/// Image-processor settings (from the model's `preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessorConfig {
    /// Vision patch size in pixels.
    pub patch_size: u32,
    /// Patches merged per side into one token (Qwen: 2).
    pub merge_size: u32,
    /// Qwen: fewest pixels after resizing.
    pub min_pixels: u64,
    /// Qwen: most pixels after resizing.
    pub max_pixels: u64,
    /// LLaVA: the vision tower's input size (336).
    pub image_size: u32,
    /// LLaVA-NeXT: candidate (height, width) resolutions.
    pub grid_pinpoints: Vec<(u32, u32)>,
}

/// Why an image's token count is unknown.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenCountError {
    /// Qwen processors reject aspect ratios above 200.
    #[error("aspect ratio {0:.0} is above 200")]
    AspectRatio(f64),
    /// The processor settings cannot be used (a zero size).
    #[error("invalid processor settings: {0}")]
    Config(&'static str),
}

/// A vision model: its family and processor settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionModel {
    /// The family (selects the token-count rule).
    pub family: VisionFamily,
    /// Processor settings.
    pub processor: ProcessorConfig,
}

impl VisionModel {
    /// A model of `family` with the family's default processor settings.
    pub fn new(family: VisionFamily) -> Self {
        VisionModel {
            family,
            processor: family.default_processor(),
        }
    }

    /// The number of prompt tokens an image of `size` becomes.
    pub fn image_tokens(&self, size: ImageSize) -> Result<u32, TokenCountError> {
        let p = &self.processor;
        match self.family {
            VisionFamily::Qwen2Vl | VisionFamily::Qwen25Vl | VisionFamily::Qwen3Vl => {
                if p.patch_size == 0 || p.merge_size == 0 {
                    return Err(TokenCountError::Config("zero patch or merge size"));
                }
                let factor = p.patch_size * p.merge_size;
                let (h, w) =
                    smart_resize(size.height, size.width, factor, p.min_pixels, p.max_pixels)?;
                let patches = u64::from(h / p.patch_size) * u64::from(w / p.patch_size);
                Ok((patches / u64::from(p.merge_size * p.merge_size)) as u32)
            }
            VisionFamily::Llava15 => {
                let side = p
                    .image_size
                    .checked_div(p.patch_size)
                    .ok_or(TokenCountError::Config("zero patch size"))?;
                Ok(side * side)
            }
            VisionFamily::LlavaNext => llava_next_tokens(p, size),
        }
    }
}

/// Python's `round` (ties to even).
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// Qwen2-VL's `smart_resize`: the (height, width) the processor resizes to.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), TokenCountError> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(TokenCountError::AspectRatio(ratio));
    }
    let mut h_bar = f.max(py_round(h / f) * f);
    let mut w_bar = f.max(py_round(w / f) * f);
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// LLaVA-NeXT's feature count (transformers' `LlavaNextProcessor`, vLLM's
/// `get_num_image_tokens`): base grid + unpadded anyres grid + one newline per row.
fn llava_next_tokens(p: &ProcessorConfig, size: ImageSize) -> Result<u32, TokenCountError> {
    if p.patch_size == 0 || p.image_size == 0 || p.grid_pinpoints.is_empty() {
        return Err(TokenCountError::Config(
            "LLaVA-NeXT needs patch size, image size and pinpoints",
        ));
    }
    let (oh, ow) = (size.height, size.width);
    let (best_h, best_w) = select_best_resolution(oh, ow, &p.grid_pinpoints);
    let scale_h = best_h / p.image_size;
    let scale_w = best_w / p.image_size;
    let side = p.image_size / p.patch_size;
    let mut cur_h = side * scale_h;
    let mut cur_w = side * scale_w;
    let original_aspect = f64::from(ow) / f64::from(oh);
    let current_aspect = f64::from(cur_w) / f64::from(cur_h);
    // `int(round(x, 7))`
    let round7 = |x: f64| ((x * 1e7).round_ties_even() / 1e7).trunc() as u32;
    if original_aspect > current_aspect {
        let new_h = round7(f64::from(oh) * (f64::from(cur_w) / f64::from(ow)));
        let pad = cur_h.saturating_sub(new_h) / 2;
        cur_h -= pad * 2;
    } else {
        let new_w = round7(f64::from(ow) * (f64::from(cur_h) / f64::from(oh)));
        let pad = cur_w.saturating_sub(new_w) / 2;
        cur_w -= pad * 2;
    }
    Ok(side * side + cur_h * cur_w + cur_h)
}

/// LLaVA-NeXT's `select_best_resolution`: the pinpoint (height, width) keeping the
/// most effective resolution, then wasting the least.
fn select_best_resolution(oh: u32, ow: u32, pinpoints: &[(u32, u32)]) -> (u32, u32) {
    let mut best = pinpoints[0];
    let mut max_effective = 0u64;
    let mut min_wasted = u64::MAX;
    for &(h, w) in pinpoints {
        let scale = (f64::from(w) / f64::from(ow)).min(f64::from(h) / f64::from(oh));
        let dw = (f64::from(ow) * scale) as u64;
        let dh = (f64::from(oh) * scale) as u64;
        let effective = (dw * dh).min(u64::from(ow) * u64::from(oh));
        let wasted = u64::from(w) * u64::from(h) - effective;
        if effective > max_effective || (effective == max_effective && wasted < min_wasted) {
            max_effective = effective;
            min_wasted = wasted;
            best = (h, w);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(width: u32, height: u32) -> ImageSize {
        ImageSize { width, height }
    }

    #[test]
    fn qwen2_vl_token_counts() {
        let m = VisionModel::new(VisionFamily::Qwen2Vl);
        // 224x224 -> 8x8 merged tokens.
        assert_eq!(m.image_tokens(size(224, 224)), Ok(64));
        // 640x480: round(480/28)=17 -> 476, round(640/28)=23 -> 644: 34*46/4.
        assert_eq!(m.image_tokens(size(640, 480)), Ok(391));
        // Tiny images are scaled up to min_pixels (56x56 -> 4 tokens).
        assert_eq!(m.image_tokens(size(10, 10)), Ok(4));
        // Half-way cases round to even, like Python: 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2.
        assert_eq!(smart_resize(42, 70, 28, 0, u64::MAX), Ok((56, 56)));
        // Huge images are scaled down under max_pixels.
        let (h, w) = smart_resize(8000, 8000, 28, 3136, 1_003_520).unwrap();
        assert!(u64::from(h) * u64::from(w) <= 1_003_520);
        assert_eq!((h % 28, w % 28), (0, 0));
        assert!(matches!(
            m.image_tokens(size(10_000, 10)),
            Err(TokenCountError::AspectRatio(_))
        ));
    }

    #[test]
    fn qwen3_vl_uses_patch_16() {
        let m = VisionModel::new(VisionFamily::Qwen3Vl);
        // 512x512 -> 16x16 merged tokens.
        assert_eq!(m.image_tokens(size(512, 512)), Ok(256));
        // Scaled up to 65536 pixels: 256x256 -> 64 tokens.
        assert_eq!(m.image_tokens(size(32, 32)), Ok(64));
    }

    #[test]
    fn llava_counts() {
        let l15 = VisionModel::new(VisionFamily::Llava15);
        assert_eq!(l15.image_tokens(size(1, 1)), Ok(576));
        assert_eq!(l15.image_tokens(size(4000, 3000)), Ok(576));
        let next = VisionModel::new(VisionFamily::LlavaNext);
        // A square image picks 672x672: 24*2 rows and columns, no padding.
        assert_eq!(next.image_tokens(size(672, 672)), Ok(576 + 48 * 48 + 48));
        // 800x600 (w x h) also fits 672x672 best; the 4:3 content leaves 36 rows.
        assert_eq!(next.image_tokens(size(800, 600)), Ok(576 + 36 * 48 + 36));
        // A wide image picks 336x1008 (h x w): 24 rows x 72 columns, then unpadded.
        assert_eq!(
            select_best_resolution(300, 1000, &next.processor.grid_pinpoints),
            (336, 1008)
        );
    }

    #[test]
    fn family_names() {
        for f in [
            VisionFamily::Qwen2Vl,
            VisionFamily::Qwen25Vl,
            VisionFamily::Qwen3Vl,
            VisionFamily::Llava15,
            VisionFamily::LlavaNext,
        ] {
            assert_eq!(VisionFamily::parse(f.as_str()), Some(f));
        }
        assert_eq!(VisionFamily::parse("Qwen2_5-VL"), None);
        assert_eq!(
            VisionFamily::parse("QWEN2.5_VL"),
            Some(VisionFamily::Qwen25Vl)
        );
    }
}
