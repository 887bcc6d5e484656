//! Image identity: the 64-bit `mm_hash` kvpick and the engines agree on.
//!
//! - `data:` URLs: xxh3-64 of the decoded bytes (the same picture sent under
//!   another media type or with different base64 line breaks is the same image);
//! - remote URLs: xxh3-64 of the URL string, unless the glue fetched the bytes
//!   (then [`content_identity`] of those bytes, equal to the `data:` identity of
//!   the same file).
//!
//! The engines are told the hash, in the form each accepts: SGLang takes 16 hex
//! digits (`mm_hashes`), vLLM a per-item multimodal UUID that it echoes back in
//! `extra_keys`, for which kvpick uses Dynamo's marker form (16 hex digits and
//! 48 zeros, 64 characters). SGLang inlines `pad_value(mm_hash)` at each image
//! token position of its `BlockStored` token ids; kvpick's routing tokens do the
//! same, so both sides hash identical token blocks.

use base64::Engine as _;
use xxhash_rust::xxh3::xxh3_64;

/// SGLang's `MM_PAD_SHIFT_VALUE`: pad values start above every real token id.
pub const MM_PAD_SHIFT_VALUE: u32 = 1_000_000;

/// SGLang keeps the low 30 bits of the hash in a pad value.
pub const MM_PAD_HASH_MASK: u64 = (1 << 30) - 1;

/// Length of a vLLM multimodal hash in `extra_keys` (a hex sha256/blake3 digest,
/// or kvpick's marker form).
pub const VLLM_MM_HASH_LEN: usize = 64;

/// The token SGLang puts at every position of an image with this hash:
/// `MM_PAD_SHIFT_VALUE + (mm_hash % 2^30)`.
pub fn pad_value(mm_hash: u64) -> u32 {
    MM_PAD_SHIFT_VALUE + (mm_hash & MM_PAD_HASH_MASK) as u32
}

/// Whether a token id is an SGLang image pad value.
pub fn is_pad_value(token: u32) -> bool {
    token >= MM_PAD_SHIFT_VALUE && u64::from(token - MM_PAD_SHIFT_VALUE) <= MM_PAD_HASH_MASK
}

/// The hash as SGLang's `mm_hashes` request field takes it: 16 lowercase hex digits.
pub fn sglang_mm_hash(mm_hash: u64) -> String {
    format!("{mm_hash:016x}")
}

/// The hash as a vLLM multimodal UUID: 16 hex digits then 48 zeros (64 chars), so
/// vLLM's `extra_keys` carry it in the 64-character form kvpick decodes.
pub fn vllm_mm_uuid(mm_hash: u64) -> String {
    format!("{mm_hash:016x}{:048}", 0)
}

/// A multimodal hash read from a vLLM `extra_keys` string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtraKeyHash {
    /// The hash: the first 16 hex digits.
    pub mm_hash: u64,
    /// Whether it is kvpick's marker form (issued by kvpick as the item's UUID);
    /// otherwise vLLM hashed the image itself and no kvpick request can match it.
    pub issued: bool,
}

/// Reads an `extra_keys` string as a multimodal hash. Only 64-character hex
/// strings are multimodal hashes; LoRA names, `cache_salt` values and other
/// strings are not (prompt-embedding keys are bytes, never strings).
pub fn parse_extra_key(s: &str) -> Option<ExtraKeyHash> {
    let b = s.as_bytes();
    if b.len() != VLLM_MM_HASH_LEN || !b.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let mm_hash = u64::from_str_radix(&s[..16], 16).ok()?;
    Some(ExtraKeyHash {
        mm_hash,
        issued: b[16..].iter().all(|&c| c == b'0'),
    })
}

/// Where an image's identity came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentitySource {
    /// The image's bytes (a `data:` URL, or a fetched remote image).
    Content,
    /// The URL string only: the same picture at two URLs is two images.
    Url,
}

impl IdentitySource {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            IdentitySource::Content => "content",
            IdentitySource::Url => "url",
        }
    }
}

/// An image's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageIdentity {
    /// The 64-bit `mm_hash`.
    pub mm_hash: u64,
    /// What it was computed from.
    pub source: IdentitySource,
}

/// Identity of image bytes.
pub fn content_identity(bytes: &[u8]) -> ImageIdentity {
    ImageIdentity {
        mm_hash: xxh3_64(bytes),
        source: IdentitySource::Content,
    }
}

/// Identity of a URL by its string.
pub fn url_identity(url: &str) -> ImageIdentity {
    ImageIdentity {
        mm_hash: xxh3_64(url.as_bytes()),
        source: IdentitySource::Url,
    }
}

/// Why a `data:` URL could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataUrlError {
    /// No `,` separates the header from the data.
    #[error("data: URL has no ',' before its data")]
    NoComma,
    /// The base64 payload does not decode.
    #[error("data: URL base64 payload does not decode")]
    Base64(#[source] base64::DecodeError),
}

/// The decoded payload of a `data:` URL; `None` when `url` is not a `data:` URL.
/// Base64 payloads may contain whitespace (line breaks), which is skipped.
pub fn decode_data_url(url: &str) -> Option<Result<Vec<u8>, DataUrlError>> {
    let rest = url
        .get(..5)
        .filter(|p| p.eq_ignore_ascii_case("data:"))
        .map(|_| &url[5..])?;
    let Some((header, data)) = rest.split_once(',') else {
        return Some(Err(DataUrlError::NoComma));
    };
    let is_b64 = header
        .rsplit(';')
        .next()
        .is_some_and(|p| p.trim().eq_ignore_ascii_case("base64"));
    if !is_b64 {
        return Some(Ok(percent_decode(data.as_bytes())));
    }
    let decoded = if data.bytes().any(|b| b.is_ascii_whitespace()) {
        let clean: Vec<u8> = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
        decode_b64(&clean)
    } else {
        decode_b64(data.as_bytes())
    };
    Some(decoded.map_err(DataUrlError::Base64))
}

/// At most the first `max` decoded bytes of a base64 `data:` URL (enough for an
/// image header), decoding only that much; `None` for other URLs.
pub fn data_url_header(url: &str, max: usize) -> Option<Vec<u8>> {
    let rest = url
        .get(..5)
        .filter(|p| p.eq_ignore_ascii_case("data:"))
        .map(|_| &url[5..])?;
    let (header, data) = rest.split_once(',')?;
    if !header
        .rsplit(';')
        .next()
        .is_some_and(|p| p.trim().eq_ignore_ascii_case("base64"))
    {
        return Some(percent_decode(&data.as_bytes()[..data.len().min(max * 3)]));
    }
    // 4 base64 characters make 3 bytes: take whole quads of non-whitespace.
    let mut clean: Vec<u8> = data
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .take(max.div_ceil(3) * 4)
        .collect();
    clean.truncate(clean.len() / 4 * 4);
    decode_b64(&clean).ok()
}

/// Base64 with or without padding.
fn decode_b64(data: &[u8]) -> Result<Vec<u8>, base64::DecodeError> {
    let cfg = base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent);
    base64::engine::GeneralPurpose::new(&base64::alphabet::STANDARD, cfg).decode(data)
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' && i + 2 < s.len() {
            if let (Some(h), Some(l)) = (hex(s[i + 1]), hex(s[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// The identity of an image URL (see [`resolve`]), without keeping its bytes.
pub fn identify(url: &str) -> ImageIdentity {
    match decode_data_url(url) {
        Some(Ok(bytes)) => content_identity(&bytes),
        _ => url_identity(url),
    }
}

/// An image reference resolved as far as kvpick can without the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The identity.
    pub identity: ImageIdentity,
    /// The image's bytes when kvpick has them (`data:` URLs).
    pub bytes: Option<Vec<u8>>,
}

/// Resolves an image URL: `data:` URLs decode to content identities with their
/// bytes; remote URLs (and undecodable `data:` URLs) get URL identities.
pub fn resolve(url: &str) -> ResolvedImage {
    match decode_data_url(url) {
        Some(Ok(bytes)) => ResolvedImage {
            identity: content_identity(&bytes),
            bytes: Some(bytes),
        },
        _ => ResolvedImage {
            identity: url_identity(url),
            bytes: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pad_values_follow_sglang() {
        assert_eq!(pad_value(0), 1_000_000);
        assert_eq!(pad_value((1 << 30) - 1), 1_000_000 + (1 << 30) - 1);
        assert_eq!(pad_value((1 << 30) | 0xCAFE), 1_000_000 + 0xCAFE);
        assert!(is_pad_value(pad_value(u64::MAX)));
        assert!(!is_pad_value(151_655));
    }

    #[test]
    fn hash_forms_round_trip_through_extra_keys() {
        let h = 0x0123_4567_89ab_cdef;
        assert_eq!(sglang_mm_hash(h), "0123456789abcdef");
        let uuid = vllm_mm_uuid(h);
        assert_eq!(uuid.len(), 64);
        assert_eq!(
            parse_extra_key(&uuid),
            Some(ExtraKeyHash {
                mm_hash: h,
                issued: true
            })
        );
        // vLLM's own digest: a hash, but not one kvpick issued.
        let native = "0123456789abcdef00112233445566778899aabbccddeefffedcba9876543210";
        assert_eq!(
            parse_extra_key(native),
            Some(ExtraKeyHash {
                mm_hash: h,
                issued: false
            })
        );
        // LoRA names, cache salts and short strings are not hashes.
        assert_eq!(parse_extra_key("my-adapter"), None);
        assert_eq!(parse_extra_key(&"g".repeat(64)), None);
        assert_eq!(parse_extra_key(&"a".repeat(63)), None);
        assert_eq!(parse_extra_key(&"a".repeat(65)), None);
    }

    #[test]
    fn data_urls_are_identified_by_content() {
        let a = resolve("data:image/png;base64,iVBORw0KGgo=");
        let b = resolve("data:image/x-png;base64,iVBOR\nw0KGgo");
        assert_eq!(
            a.identity, b.identity,
            "media type and line breaks do not matter"
        );
        assert_eq!(a.identity.source, IdentitySource::Content);
        assert_eq!(a.bytes.as_deref(), Some(&b"\x89PNG\r\n\x1a\n"[..]));
        assert_eq!(a.identity, content_identity(b"\x89PNG\r\n\x1a\n"));
        let c = resolve("https://x/cat.png");
        assert_eq!(c.identity.source, IdentitySource::Url);
        assert_ne!(c.identity, resolve("https://x/dog.png").identity);
        // Undecodable data URLs fall back to the URL.
        assert_eq!(
            resolve("data:image/png;base64,@@@").identity.source,
            IdentitySource::Url
        );
        assert_eq!(
            decode_data_url("data:text/plain,a%20b").unwrap().unwrap(),
            b"a b"
        );
        assert_eq!(
            decode_data_url("data:nocomma"),
            Some(Err(DataUrlError::NoComma))
        );
        assert_eq!(decode_data_url("https://x"), None);
        let url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==";
        assert_eq!(
            data_url_header(url, 6).unwrap(),
            b"\x89PNG\r\n",
            "only whole quads up to the limit are decoded"
        );
        assert_eq!(identify(url), resolve(url).identity);
    }
}
