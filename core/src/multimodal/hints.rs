//! Telling the engine the image hashes kvpick routed with, so the engine's block
//! hashes are the ones kvpick looked up.
//!
//! - SGLang: `nvext.mm_hashes`, one 16-hex-digit hash per image in prompt order,
//!   for the worker's sidecar to pass as `mm_hashes` of SGLang's
//!   `GenerateReqInput` (the field sglang#25300 adds; Dynamo's SGLang handler
//!   forwards it the same way). SGLang then puts `pad_value(hash)` at the
//!   image's token positions.
//! - vLLM: a `uuid` on each image content part (vLLM's per-item multimodal
//!   UUIDs), in kvpick's 64-character marker form, which vLLM uses as the item's
//!   hash and echoes in the blocks' `extra_keys`.

use serde_json::Value;

use super::identity::{sglang_mm_hash, vllm_mm_uuid};
use super::remote::KnownImages;

/// Which engine's request format to write the hashes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintFormat {
    /// `nvext.mm_hashes` (16 hex digits each).
    Sglang,
    /// `uuid` on each image content part (64 characters each).
    Vllm,
}

/// The `nvext` field carrying SGLang's hashes.
pub const SGLANG_FIELD: &str = "mm_hashes";

/// The hashes as `nvext.mm_hashes` holds them.
pub fn sglang_mm_hashes(hashes: &[u64]) -> Vec<String> {
    hashes.iter().map(|&h| sglang_mm_hash(h)).collect()
}

/// Writes `hashes` (one per image, in prompt order) into a chat or Responses
/// body. Returns how many images were tagged; the body is left as it was when
/// the count of image parts differs from `hashes.len()`.
pub fn add_mm_hints(body: &mut Value, format: HintFormat, hashes: &[u64]) -> usize {
    if hashes.is_empty() || image_parts(body).count() != hashes.len() {
        return 0;
    }
    match format {
        HintFormat::Sglang => {
            let Some(obj) = body.as_object_mut() else {
                return 0;
            };
            let nvext = obj
                .entry("nvext")
                .or_insert_with(|| Value::Object(Default::default()));
            if !nvext.is_object() {
                return 0;
            }
            nvext[SGLANG_FIELD] = serde_json::json!(sglang_mm_hashes(hashes));
        }
        HintFormat::Vllm => {
            for (part, &h) in image_parts_mut(body).zip(hashes) {
                part.insert("uuid".into(), Value::String(vllm_mm_uuid(h)));
            }
        }
    }
    hashes.len()
}

/// The identities of a parsed request's images, in prompt order; remote images
/// in `fetched` by their content.
pub fn image_hashes<'a>(
    urls: impl IntoIterator<Item = &'a str>,
    fetched: &KnownImages,
) -> Vec<u64> {
    urls.into_iter()
        .map(|u| fetched.identify(u).mm_hash)
        .collect()
}

/// [`add_mm_hints`] on a body's bytes: the new body, or `None` when the body is
/// not a JSON object with one image part per hash.
pub fn rewrite_body(body: &[u8], format: HintFormat, hashes: &[u64]) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    if add_mm_hints(&mut v, format, hashes) == 0 {
        return None;
    }
    serde_json::to_vec(&v).ok()
}

fn is_image_part(part: &serde_json::Map<String, Value>) -> bool {
    matches!(
        part.get("type").and_then(Value::as_str),
        Some("image_url") | Some("input_image")
    )
}

fn messages(body: &Value) -> impl Iterator<Item = &Value> {
    ["messages", "input"]
        .into_iter()
        .filter_map(|k| body.get(k).and_then(Value::as_array))
        .flatten()
}

/// The image content parts of a body, in prompt order.
pub fn image_parts(body: &Value) -> impl Iterator<Item = &serde_json::Map<String, Value>> {
    messages(body)
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter_map(Value::as_object)
        .filter(|p| is_image_part(p))
}

fn image_parts_mut(body: &mut Value) -> impl Iterator<Item = &mut serde_json::Map<String, Value>> {
    let obj = body.as_object_mut().into_iter().flat_map(|o| {
        o.iter_mut()
            .filter(|(k, _)| *k == "messages" || *k == "input")
            .map(|(_, v)| v)
    });
    obj.filter_map(Value::as_array_mut)
        .flatten()
        .filter_map(|m| m.get_mut("content").and_then(Value::as_array_mut))
        .flatten()
        .filter_map(Value::as_object_mut)
        .filter(|p| is_image_part(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body() -> Value {
        json!({"model": "m", "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "https://x/1.png"}},
            ]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/2.png"}},
            ]},
        ]})
    }

    #[test]
    fn sglang_gets_16_hex_hashes_in_order() {
        let mut b = body();
        assert_eq!(add_mm_hints(&mut b, HintFormat::Sglang, &[1, 0xabc]), 2);
        assert_eq!(
            b["nvext"]["mm_hashes"],
            json!(["0000000000000001", "0000000000000abc"])
        );
    }

    #[test]
    fn vllm_gets_a_uuid_per_image_part() {
        let mut b = body();
        assert_eq!(add_mm_hints(&mut b, HintFormat::Vllm, &[1, 2]), 2);
        let uuids: Vec<&str> = image_parts(&b)
            .map(|p| p["uuid"].as_str().unwrap())
            .collect();
        assert_eq!(uuids, vec![vllm_mm_uuid(1), vllm_mm_uuid(2)]);
        assert!(b.get("nvext").is_none());
    }

    #[test]
    fn bodies_are_rewritten_as_bytes() {
        let raw = serde_json::to_vec(&body()).unwrap();
        let hashes = image_hashes(
            ["https://x/1.png", "https://x/2.png"],
            &KnownImages::default(),
        );
        let out = rewrite_body(&raw, HintFormat::Sglang, &hashes).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["nvext"]["mm_hashes"][1], json!(sglang_mm_hash(hashes[1])));
        assert_eq!(rewrite_body(b"[1]", HintFormat::Vllm, &hashes), None);
    }

    #[test]
    fn a_count_mismatch_leaves_the_body_alone() {
        let mut b = body();
        assert_eq!(add_mm_hints(&mut b, HintFormat::Sglang, &[1]), 0);
        assert_eq!(b, body());
    }
}
