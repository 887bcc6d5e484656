//! Chained prefix block hashes (xxh3-64).
//!
//! A prompt is cut into blocks; each block's hash covers its parent's hash and its
//! own content, so equal hashes mean equal prefixes. Every chain starts from a seed
//! derived from the model and LoRA adapter, so different models never match.
//!
//! Tenants: a request's salt (`x-tenant-id` > `nvext.cache_salt` > `cache_salt`)
//! is folded into its seed ([`request_seed`]). Only the first block reads the
//! seed, so this is vLLM's rule (the salt is an extra key of the first block
//! only, `start_token_idx == 0`): the salt changes the first block's hash and,
//! through the chain, every later one. KV events carry the salt the engine used
//! in that first block's `extra_keys`, and ingest seeds the stored chain the
//! same way, so a salted request's blocks match its own tenant's only.
//!
//! Block kinds:
//! - text: byte chunks of `byte_block` bytes (default [`DEFAULT_BYTE_BLOCK`] = 64
//!   bytes, about 16 tokens, the Gateway API Inference Extension default);
//! - token ids: blocks of `token_block` tokens (the engine's KV block size), hashed
//!   exactly as [`token_block_hashes`] does, so precise mode (KV events carry token
//!   ids) and requests with token ids produce the same hashes;
//! - images (prompts without token ids): one block per image, hashing the image's
//!   identity ([`crate::multimodal::identity::identify`]: the decoded bytes of a
//!   `data:` URL, else the URL), so the blocks after an image depend on it;
//! - images in token prompts: tokenized prompts carry SGLang's pad values at the
//!   image token positions ([`crate::multimodal`]), so their blocks are token
//!   blocks like any other and equal the engines' blocks. A vLLM event block
//!   whose image tokens cannot be paired with its `extra_keys` hashes is keyed by
//!   [`mm_block_hash`] and never equals a request block.
//!
//! Only full blocks are hashed: a trailing partial block never matches anything in
//! an engine cache. A partial block followed by a segment of another kind (text
//! then image, say) is closed early as a short block, so the chain stays defined.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

use crate::multimodal::{estimate_image_tokens, identity, VisionModel};
use crate::request::Segment;

/// Default text block size in bytes (about 16 tokens).
pub const DEFAULT_BYTE_BLOCK: usize = 64;

/// Default token block size (vLLM's default KV block size).
pub const DEFAULT_TOKEN_BLOCK: usize = 16;

/// Domain tags so text, image and token blocks of equal bytes never collide
/// (text blocks mix theirs into the seed).
const TEXT_SEED: u64 = 0x01 << 56;
const IMAGE_TAG: u8 = 0x02;
const MM_TOKENS_TAG: u8 = 0x03;

/// The chain seed for a model and optional LoRA adapter.
pub fn model_seed(model: &str, lora: Option<&str>) -> u64 {
    let mut h = Xxh3::new();
    h.update(b"kvpick/v1\0");
    h.update(model.as_bytes());
    h.update(&[0]);
    if let Some(lora) = lora {
        h.update(lora.as_bytes());
    }
    h.digest()
}

/// Tag of a salted seed, so a salt never equals a model name's bytes.
const SALT_TAG: u8 = 0x04;

/// `seed` with a tenant's salt folded in (`None`: `seed` unchanged, so unsalted
/// requests hash as before). Every block of a salted chain differs from the
/// unsalted chain's and from every other salt's.
pub fn salted_seed(seed: u64, salt: Option<&str>) -> u64 {
    match salt {
        None => seed,
        Some(salt) => {
            let mut h = Xxh3::new();
            h.update(&seed.to_le_bytes());
            h.update(&[SALT_TAG]);
            h.update(salt.as_bytes());
            h.digest()
        }
    }
}

/// The chain seed of a request for `model` with tenant salt `salt`.
pub fn request_seed(model: &str, salt: Option<&str>) -> u64 {
    salted_seed(model_seed(model, None), salt)
}

/// Chained hashes of the full `block_size`-token blocks of `tokens`. The first block
/// chains from `parent`, or from `seed` when `parent` is `None`. Each hash is
/// xxh3-64 over the parent hash (8 bytes little-endian) and the block's token ids
/// (4 bytes little-endian each).
pub fn token_block_hashes(
    seed: u64,
    parent: Option<u64>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<u64> {
    let block_size = block_size.max(1);
    let mut prev = parent.unwrap_or(seed);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    // A publisher's block size can be anything: size the buffer by what exists.
    let mut buf = Vec::with_capacity(8 + block_size.min(tokens.len()) * 4);
    for block in tokens.chunks_exact(block_size) {
        prev = hash_token_block(&mut buf, prev, block);
        out.push(prev);
    }
    out
}

fn hash_token_block(buf: &mut Vec<u8>, parent: u64, tokens: &[u32]) -> u64 {
    buf.clear();
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64(buf)
}

/// xxh3-64 of the block's bytes seeded with the parent hash and the text tag:
/// hashed where the bytes lie, with no copy, and a 64-byte block takes xxh3's
/// short path (parent and tag as leading bytes made it 73 bytes, the longer one).
fn text_block(parent: u64, bytes: &[u8]) -> u64 {
    xxh3_64_with_seed(bytes, parent ^ TEXT_SEED)
}

fn image_block(parent: u64, reference: &str) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    h.update(&[IMAGE_TAG]);
    h.update(&identity::identify(reference).mm_hash.to_le_bytes());
    h.digest()
}

/// The key of a token block that also carries multimodal hashes it cannot be
/// rewritten into pad values with (see [`crate::multimodal::routing`]): xxh3-64
/// over the parent, a tag, the token ids and the hashes.
pub fn mm_block_hash(parent: u64, tokens: &[u32], mm_hashes: &[u64]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&parent.to_le_bytes());
    h.update(&[MM_TOKENS_TAG]);
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    for m in mm_hashes {
        h.update(&m.to_le_bytes());
    }
    h.digest()
}

/// Chained block hashes of a whole prompt (see the module docs for the rules).
/// Consecutive text segments form one byte stream and consecutive token segments
/// one token stream; a prompt of token ids only hashes exactly like
/// `token_block_hashes(seed, None, tokens, token_block)`.
pub fn request_block_hashes(
    seed: u64,
    segments: &[Segment],
    byte_block: usize,
    token_block: usize,
) -> Vec<u64> {
    hash_prompt(seed, segments, byte_block, token_block, usize::MAX, None)
}

/// A prompt's chained block hashes and what prefilling them costs: an image
/// still in the prompt (no tokenizer) is one hash block but costs the blocks of
/// the tokens it becomes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptBlocks {
    /// The chained block hashes ([`request_block_hashes`]).
    pub hashes: Vec<u64>,
    /// `(hash index, blocks beyond the one hash block)` of each image block.
    image_extra: Vec<(usize, u64)>,
    /// Blocks of the prompt past the hashing cap (not hashed, always uncached).
    beyond: usize,
    /// Tokens a block holds: `token_block` for a prompt of token ids only, else
    /// a quarter of `byte_block` (text at about four bytes a token).
    pub tokens_per_block: usize,
}

impl PromptBlocks {
    /// Hashes the first `max_blocks` blocks of `segments` (the blocks past them
    /// count as uncached); images are sized with `vision` ([`estimate_image_tokens`]).
    pub fn of(
        seed: u64,
        segments: &[Segment],
        (byte_block, token_block): (usize, usize),
        max_blocks: usize,
        vision: Option<&VisionModel>,
    ) -> Self {
        let mut images = Vec::new();
        let hashes = hash_prompt(
            seed,
            segments,
            byte_block,
            token_block,
            max_blocks,
            Some(&mut images),
        );
        let beyond = if hashes.len() < max_blocks {
            0
        } else {
            // Past the cap: the prompt's blocks less those hashed.
            blocks_by_length(segments, byte_block, token_block).saturating_sub(hashes.len())
        };
        let urls = segments.iter().filter_map(|s| match s {
            Segment::Image(url) => Some(url),
            _ => None,
        });
        let image_extra = images
            .into_iter()
            .zip(urls)
            .map(|(at, url)| {
                let blocks = u64::from(estimate_image_tokens(url, vision))
                    .div_ceil(token_block.max(1) as u64);
                (at, blocks.saturating_sub(1))
            })
            .filter(|&(_, extra)| extra > 0)
            .collect();
        let token_ids =
            !segments.is_empty() && segments.iter().all(|s| matches!(s, Segment::Tokens(_)));
        PromptBlocks {
            hashes,
            image_extra,
            beyond,
            tokens_per_block: if token_ids {
                token_block
            } else {
                byte_block / 4
            }
            .max(1),
        }
    }

    /// Adds `blocks` of the prompt that were never hashed (token ids the parse
    /// only counted) to the uncached tail.
    pub fn and_unhashed(mut self, blocks: usize) -> Self {
        self.beyond = self.beyond.saturating_add(blocks);
        self
    }

    /// Blocks left to prefill on a worker holding the first `overlap` hash
    /// blocks: each uncached image counts its token blocks.
    pub fn uncached(&self, overlap: usize) -> usize {
        let images: u64 = self
            .image_extra
            .iter()
            .filter(|&&(at, _)| at >= overlap)
            .map(|&(_, extra)| extra)
            .sum();
        self.hashes
            .len()
            .saturating_sub(overlap)
            .saturating_add(self.beyond)
            .saturating_add(usize::try_from(images).unwrap_or(usize::MAX))
    }
}

/// A prompt's blocks by length: its text and token ids in blocks (partial ones
/// counted), one per image.
fn blocks_by_length(segments: &[Segment], byte_block: usize, token_block: usize) -> usize {
    let (bytes, tokens, pictures) =
        segments
            .iter()
            .fold((0usize, 0usize, 0usize), |(b, t, i), s| match s {
                Segment::Text(x) => (b + x.len(), t, i),
                Segment::Tokens(x) => (b, t + x.len(), i),
                Segment::Image(_) => (b, t, i + 1),
            });
    bytes.div_ceil(byte_block.max(1)) + tokens.div_ceil(token_block.max(1)) + pictures
}

/// [`request_block_hashes`] of at most `max` blocks, recording the hash index of
/// each image block in `images` when given.
fn hash_prompt(
    seed: u64,
    segments: &[Segment],
    byte_block: usize,
    token_block: usize,
    max: usize,
    mut images: Option<&mut Vec<usize>>,
) -> Vec<u64> {
    let byte_block = byte_block.max(1);
    let token_block = token_block.max(1);
    // Sized once: a long prompt's hashes would otherwise be copied per doubling.
    let mut out = Vec::with_capacity(blocks_by_length(segments, byte_block, token_block).min(max));
    let mut prev = seed;
    let mut text: Vec<u8> = Vec::new();
    let mut toks: Vec<u32> = Vec::new();
    let mut buf = Vec::new();
    for seg in segments {
        if out.len() >= max {
            break;
        }
        match seg {
            Segment::Text(t) => {
                if !toks.is_empty() {
                    prev = hash_token_block(&mut buf, prev, &toks);
                    out.push(prev);
                    toks.clear();
                }
                let mut bytes = t.as_bytes();
                if !text.is_empty() {
                    let take = (byte_block - text.len()).min(bytes.len());
                    text.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if text.len() == byte_block {
                        prev = text_block(prev, &text);
                        out.push(prev);
                        text.clear();
                    }
                }
                let mut chunks = bytes.chunks_exact(byte_block);
                for c in (&mut chunks).take(max.saturating_sub(out.len())) {
                    prev = text_block(prev, c);
                    out.push(prev);
                }
                text.extend_from_slice(chunks.remainder());
            }
            Segment::Tokens(t) => {
                if !text.is_empty() {
                    prev = text_block(prev, &text);
                    out.push(prev);
                    text.clear();
                }
                let mut ids = t.as_slice();
                if !toks.is_empty() {
                    let take = (token_block - toks.len()).min(ids.len());
                    toks.extend_from_slice(&ids[..take]);
                    ids = &ids[take..];
                    if toks.len() == token_block {
                        prev = token_block_hash_push(&mut buf, &mut out, prev, &toks);
                        toks.clear();
                    }
                }
                let mut chunks = ids.chunks_exact(token_block);
                for c in (&mut chunks).take(max.saturating_sub(out.len())) {
                    prev = token_block_hash_push(&mut buf, &mut out, prev, c);
                }
                toks.extend_from_slice(chunks.remainder());
            }
            Segment::Image(url) => {
                if !text.is_empty() {
                    prev = text_block(prev, &text);
                    out.push(prev);
                    text.clear();
                }
                if !toks.is_empty() {
                    prev = token_block_hash_push(&mut buf, &mut out, prev, &toks);
                    toks.clear();
                }
                prev = image_block(prev, url);
                if let Some(at) = images.as_deref_mut() {
                    at.push(out.len());
                }
                out.push(prev);
            }
        }
    }
    out.truncate(max);
    if let Some(at) = images {
        at.retain(|&i| i < max);
    }
    out
}

fn token_block_hash_push(buf: &mut Vec<u8>, out: &mut Vec<u64>, parent: u64, t: &[u32]) -> u64 {
    let h = hash_token_block(buf, parent, t);
    out.push(h);
    h
}

/// How many blocks a prompt occupies for load accounting: like
/// [`request_block_hashes`] but counting a trailing partial block, and at least 1.
/// Images still in the prompt (not tokenized) count the tokens they will become
/// ([`estimate_image_tokens`]); tokenized images are already token ids.
pub fn request_size_blocks(segments: &[Segment], byte_block: usize, token_block: usize) -> u64 {
    request_size_blocks_for(segments, byte_block, token_block, None)
}

/// [`request_size_blocks`] with the vision model that sizes images.
pub fn request_size_blocks_for(
    segments: &[Segment],
    byte_block: usize,
    token_block: usize,
    vision: Option<&VisionModel>,
) -> u64 {
    let (mut bytes, mut tokens) = (0usize, 0usize);
    for s in segments {
        match s {
            Segment::Text(t) => bytes += t.len(),
            Segment::Tokens(t) => tokens += t.len(),
            Segment::Image(url) => tokens += estimate_image_tokens(url, vision) as usize,
        }
    }
    let blocks =
        bytes.div_ceil(byte_block.max(1)) as u64 + tokens.div_ceil(token_block.max(1)) as u64;
    blocks.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Segment {
        Segment::Text(s.to_string())
    }

    #[test]
    fn a_capped_prompt_hashes_its_leading_blocks_and_counts_the_rest_uncached() {
        let segs = [
            text(&"a".repeat(64 * 10 + 5)),
            Segment::Tokens((0..64).collect()),
        ];
        let all = request_block_hashes(3, &segs, 64, 16);
        assert_eq!(all.len(), 15); // 10 text + the 5-byte short block + 4 token blocks
        for cap in [1, 4, 10, 11, 12, 15] {
            let p = PromptBlocks::of(3, &segs, (64, 16), cap, None);
            assert_eq!(p.hashes, all[..cap], "cap {cap}");
            // Past the cap the prompt counts by length: 11 text + 4 token blocks.
            assert_eq!(p.uncached(0), 15, "cap {cap}");
            assert_eq!(p.uncached(cap), 15 - cap, "cap {cap}");
        }
        let whole = PromptBlocks::of(3, &segs, (64, 16), 16, None);
        assert_eq!((whole.hashes.len(), whole.uncached(0)), (15, 15));
    }

    #[test]
    fn seeds_differ_by_model_and_lora() {
        let a = model_seed("m", None);
        assert_ne!(a, model_seed("m2", None));
        assert_ne!(a, model_seed("m", Some("adapter")));
        assert_eq!(a, model_seed("m", None));
        let toks: Vec<u32> = (0..32).collect();
        assert_ne!(
            token_block_hashes(a, None, &toks, 16),
            token_block_hashes(model_seed("m2", None), None, &toks, 16)
        );
    }

    #[test]
    fn a_salt_changes_the_first_block_and_so_the_whole_chain() {
        let seed = model_seed("m", None);
        assert_eq!(
            salted_seed(seed, None),
            seed,
            "unsalted requests hash as before"
        );
        assert_eq!(request_seed("m", None), seed);
        let toks: Vec<u32> = (0..48).collect();
        let chain = |salt| token_block_hashes(request_seed("m", salt), None, &toks, 16);
        let (plain, a, b) = (chain(None), chain(Some("a")), chain(Some("b")));
        assert_eq!(a, chain(Some("a")));
        for other in [&plain, &b] {
            assert!(a.iter().zip(other).all(|(x, y)| x != y));
        }
        // Only the first block reads the salt: the rest chain from their parent.
        assert_eq!(token_block_hashes(0, Some(a[0]), &toks[16..], 16), a[1..]);
        // A salt never reads as a model name.
        assert_ne!(request_seed("m", Some("x")), model_seed("mx", None));
        assert_ne!(request_seed("m", Some("x")), model_seed("m", Some("x")));
    }

    #[test]
    fn token_chain_hashes_full_blocks_and_chains_parents() {
        let toks: Vec<u32> = (0..40).collect();
        let all = token_block_hashes(7, None, &toks, 16);
        assert_eq!(all.len(), 2, "the 8 trailing tokens are not hashed");
        // Continuing from a parent equals hashing the whole sequence.
        let tail = token_block_hashes(7, Some(all[0]), &toks[16..32], 16);
        assert_eq!(tail, vec![all[1]]);
        // A change in block 0 changes every later block.
        let mut other = toks.clone();
        other[3] = 999;
        let changed = token_block_hashes(7, None, &other, 16);
        assert_ne!(changed[0], all[0]);
        assert_ne!(changed[1], all[1]);
        // A change in block 1 keeps block 0.
        let mut late = toks.clone();
        late[20] = 999;
        let late = token_block_hashes(7, None, &late, 16);
        assert_eq!(late[0], all[0]);
        assert_ne!(late[1], all[1]);
    }

    #[test]
    fn token_prompts_hash_like_the_token_chain() {
        let toks: Vec<u32> = (100..150).collect();
        let direct = token_block_hashes(5, None, &toks, 16);
        let split = vec![
            Segment::Tokens(toks[..10].to_vec()),
            Segment::Tokens(toks[10..].to_vec()),
        ];
        assert_eq!(request_block_hashes(5, &split, 64, 16), direct);
    }

    #[test]
    fn a_text_block_is_its_bytes_hashed_with_the_tagged_parent_as_seed() {
        for (parent, bytes) in [(0u64, &b""[..]), (7, b"abc"), (u64::MAX, &[b'x'; 64][..])] {
            let mut h = Xxh3::with_seed(parent ^ TEXT_SEED);
            h.update(bytes);
            assert_eq!(text_block(parent, bytes), h.digest());
        }
        // The parent and the tag both count: a token block of the same bytes
        // under the same parent, or another parent, hashes otherwise.
        let block = [b'y'; 64];
        assert_ne!(text_block(1, &block), text_block(2, &block));
        let tokens: Vec<u32> = block
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_ne!(
            text_block(1, &block),
            hash_token_block(&mut Vec::new(), 1, &tokens)
        );
    }

    #[test]
    fn text_blocks_are_byte_chunks_across_segments() {
        let s = "a".repeat(64 * 3 + 10);
        let whole = request_block_hashes(1, &[text(&s)], 64, 16);
        assert_eq!(whole.len(), 3);
        let parts = request_block_hashes(1, &[text(&s[..100]), text(&s[100..])], 64, 16);
        assert_eq!(parts, whole);
        // A longer prompt extends the chain: shared leading blocks.
        let longer = request_block_hashes(1, &[text(&format!("{s}{}", "b".repeat(200)))], 64, 16);
        assert_eq!(&longer[..3], &whole[..]);
        assert_eq!(longer.len(), 6);
    }

    #[test]
    fn images_are_mixed_into_the_chain() {
        let pre = "p".repeat(128);
        let post = "q".repeat(128);
        let req = |img: &str| {
            request_block_hashes(
                1,
                &[text(&pre), Segment::Image(img.into()), text(&post)],
                64,
                16,
            )
        };
        let a = req("https://x/cat.png");
        let b = req("https://x/cat.png");
        let c = req("https://x/dog.png");
        assert_eq!(a, b, "same image and text share every block");
        assert_eq!(a.len(), 5);
        assert_eq!(&a[..2], &c[..2], "text before the image is shared");
        assert!(a[2..].iter().zip(&c[2..]).all(|(x, y)| x != y));
    }

    #[test]
    fn size_counts_partial_blocks() {
        assert_eq!(request_size_blocks(&[], 64, 16), 1);
        assert_eq!(request_size_blocks(&[text(&"x".repeat(65))], 64, 16), 2);
        // 17 tokens plus an image of unknown size (576 tokens): 593 tokens.
        assert_eq!(
            request_size_blocks(
                &[Segment::Tokens(vec![1; 17]), Segment::Image("u".into())],
                64,
                16
            ),
            38
        );
    }

    #[test]
    fn images_count_their_tokens_in_load() {
        use crate::multimodal::{VisionFamily, VisionModel};
        use base64::Engine as _;
        let png = crate::multimodal::dims::samples::png(640, 480);
        let url = format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&png)
        );
        let qwen = VisionModel::new(VisionFamily::Qwen2Vl);
        // 391 image tokens (Qwen2-VL, 640x480) in blocks of 16.
        assert_eq!(
            request_size_blocks_for(&[Segment::Image(url)], 64, 16, Some(&qwen)),
            25
        );
    }

    #[test]
    fn uncached_images_count_their_token_blocks_in_prefill() {
        // 2 text blocks, the image (576 tokens = 36 blocks of 16), 2 text blocks.
        let segs = [
            text(&"p".repeat(128)),
            Segment::Image("https://x/cat.png".into()),
            text(&"q".repeat(128)),
        ];
        let p = PromptBlocks::of(1, &segs, (64, 16), usize::MAX, None);
        assert_eq!(p.hashes, request_block_hashes(1, &segs, 64, 16));
        assert_eq!(p.uncached(0), 4 + 36);
        assert_eq!(p.uncached(2), 2 + 36, "the image is still to prefill");
        assert_eq!(p.uncached(3), 2, "a cached image costs nothing");
        assert_eq!(p.uncached(5), 0);
        let plain = PromptBlocks::of(1, &[text(&"p".repeat(128))], (64, 16), usize::MAX, None);
        assert_eq!(plain.uncached(1), 1);
    }

    #[test]
    fn images_are_identified_by_content() {
        let post = text(&"q".repeat(64));
        let a = request_block_hashes(
            1,
            &[
                Segment::Image("data:image/png;base64,AAAA".into()),
                post.clone(),
            ],
            64,
            16,
        );
        let b = request_block_hashes(
            1,
            &[Segment::Image("data:image/jpeg;base64,AA\nAA".into()), post],
            64,
            16,
        );
        assert_eq!(a, b, "the same bytes are the same image");
        assert_ne!(
            mm_block_hash(1, &[5, 5], &[7]),
            mm_block_hash(1, &[5, 5], &[8])
        );
        assert_ne!(
            mm_block_hash(1, &[5, 5], &[7]),
            token_block_hashes(1, None, &[5, 5], 2)[0]
        );
    }
}
