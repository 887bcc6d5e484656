//! The routing token stream of a multimodal prompt, and the same stream rebuilt
//! from vLLM `BlockStored` events.
//!
//! kvpick's canonical form is SGLang's: every image token position holds
//! `pad_value(mm_hash)`. SGLang publishes exactly that in `BlockStored.token_ids`.
//! vLLM publishes the model's image token id at those positions and the image's
//! hash in the block's `extra_keys`; [`normalize_vllm_block`] rewrites such a
//! block into the canonical form, so one request hash matches both engines.

use super::identity::pad_value;

/// One image of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptImage {
    /// Its identity hash.
    pub mm_hash: u64,
    /// Prompt tokens it becomes.
    pub tokens: u32,
}

/// Why a prompt's placeholders could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    /// The placeholder token sequence is empty.
    #[error("the image placeholder has no tokens")]
    EmptyPlaceholder,
    /// The prompt holds a different number of placeholders than images.
    #[error("prompt has {found} image placeholders for {images} images")]
    Count {
        /// Placeholders found in the token ids.
        found: usize,
        /// Images in the request.
        images: usize,
    },
}

/// Replaces each occurrence of `placeholder` (the image token's ids: one id, or
/// several when the tokenizer splits it) in `ids`, in order, by `tokens` copies
/// of the matching image's pad value. The number of occurrences must equal the
/// number of images (the engine pairs them the same way, in order).
pub fn expand_images(
    ids: &[u32],
    placeholder: &[u32],
    images: &[PromptImage],
) -> Result<Vec<u32>, ExpandError> {
    if placeholder.is_empty() {
        return Err(ExpandError::EmptyPlaceholder);
    }
    let extra: usize = images.iter().map(|i| i.tokens as usize).sum();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut found = 0;
    let mut i = 0;
    while i < ids.len() {
        if ids[i..].starts_with(placeholder) {
            if let Some(img) = images.get(found) {
                out.extend(std::iter::repeat_n(
                    pad_value(img.mm_hash),
                    img.tokens as usize,
                ));
            }
            found += 1;
            i += placeholder.len();
        } else {
            out.push(ids[i]);
            i += 1;
        }
    }
    if found != images.len() {
        return Err(ExpandError::Count {
            found,
            images: images.len(),
        });
    }
    Ok(out)
}

/// Rewrites a vLLM block into the canonical form: each maximal run of
/// `image_token` becomes the pad value of the next of `mm_hashes` (the hashes vLLM
/// listed in the block's `extra_keys`, in order). Returns `false`, leaving
/// `tokens` unchanged, when runs and hashes cannot be paired one to one (two
/// images with no token between them, or hashes without image tokens): such a
/// block has no canonical form and is keyed by its tokens and hashes instead.
pub fn normalize_vllm_block(tokens: &mut [u32], image_token: u32, mm_hashes: &[u64]) -> bool {
    let mut runs = 0;
    let mut prev = None;
    for &t in tokens.iter() {
        if t == image_token && prev != Some(image_token) {
            runs += 1;
        }
        prev = Some(t);
    }
    if runs != mm_hashes.len() || runs == 0 {
        return false;
    }
    let mut run = 0;
    let mut in_run = false;
    for t in tokens.iter_mut() {
        if *t == image_token {
            if !in_run {
                in_run = true;
                run += 1;
            }
            *t = pad_value(mm_hashes[run - 1]);
        } else {
            in_run = false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMG: u32 = 151_655;

    #[test]
    fn placeholders_expand_to_pad_values_in_order() {
        let images = [
            PromptImage {
                mm_hash: 7,
                tokens: 3,
            },
            PromptImage {
                mm_hash: 9,
                tokens: 2,
            },
        ];
        let out = expand_images(&[1, 50, IMG, 51, 2, IMG, 51], &[IMG], &images).unwrap();
        let (a, b) = (pad_value(7), pad_value(9));
        assert_eq!(out, vec![1, 50, a, a, a, 51, 2, b, b, 51]);
        // A BPE-split placeholder (several ids) is matched as a sequence.
        let out = expand_images(&[5, 60, 61, 62, 6], &[60, 61, 62], &images[..1]).unwrap();
        assert_eq!(out, vec![5, a, a, a, 6]);
        assert_eq!(
            expand_images(&[1, IMG], &[IMG], &images),
            Err(ExpandError::Count {
                found: 1,
                images: 2
            })
        );
        assert_eq!(
            expand_images(&[1], &[], &images),
            Err(ExpandError::EmptyPlaceholder)
        );
    }

    #[test]
    fn vllm_blocks_normalize_to_the_sglang_form() {
        let (a, b) = (pad_value(7), pad_value(9));
        // Tail of image 7, a separator, head of image 9.
        let mut block = vec![IMG, IMG, 10, IMG, IMG];
        assert!(normalize_vllm_block(&mut block, IMG, &[7, 9]));
        assert_eq!(block, vec![a, a, 10, b, b]);
        // Inside one image.
        let mut block = vec![IMG; 4];
        assert!(normalize_vllm_block(&mut block, IMG, &[7]));
        assert_eq!(block, vec![a; 4]);
        // Two adjacent images form one run: no canonical form.
        let mut block = vec![10, IMG, IMG, IMG];
        assert!(!normalize_vllm_block(&mut block, IMG, &[7, 9]));
        assert_eq!(block, vec![10, IMG, IMG, IMG]);
        // Hashes without image tokens.
        assert!(!normalize_vllm_block(&mut [1, 2], IMG, &[7]));
    }
}
