//! Decoding vLLM / SGLang KV-event messages: bytes in, events out. Pure: no I/O.
//!
//! A message is a ZMQ multipart `(topic, seq, payload)`: `seq` is an 8-byte
//! big-endian counter per publisher, `payload` is a msgpack-encoded event batch.
//! msgspec encodes the batch and its events either as arrays (`array_like=True`,
//! older vLLM and SGLang) or as maps (newer vLLM); both are accepted:
//!
//! - batch: `[ts, [events], dp_rank?]` or `{"ts":…, "events":[…], "data_parallel_rank":…}`
//! - event: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name, …]` or `{"type": "BlockStored", "block_hashes": …}`;
//!   `["BlockRemoved", block_hashes, medium, …]`; `["AllBlocksCleared"]`.
//!
//! Trailing fields the decoder does not know are ignored; an unknown event type is
//! reported as [`KvEvent::Unknown`] rather than failing the batch. Block hashes are
//! integers (signed or unsigned 64-bit) or byte strings, of which the last 8 bytes
//! are read big-endian. vLLM's `extra_keys` are read for their multimodal
//! hashes ([`BlockStored::block_mm_hashes`]) and the first block's cache salt
//! ([`BlockStored::cache_salt`]).

use rmpv::Value;

use crate::multimodal::identity::{parse_extra_key, ExtraKeyHash};

/// Why a message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The multipart message does not have the (topic, seq, payload) frames.
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    /// The payload is not valid msgpack.
    #[error("payload is not msgpack")]
    Msgpack(#[source] rmpv::decode::Error),
    /// The payload is msgpack but not an event batch.
    #[error("malformed event batch: {0}")]
    Batch(&'static str),
    /// An event of a known type lacks a field or has one of the wrong type.
    #[error("malformed {event} event: field `{field}`")]
    Event {
        /// Event type.
        event: &'static str,
        /// Offending field.
        field: &'static str,
    },
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were filled and are now cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was reset.
    AllBlocksCleared,
    /// An event type this decoder does not know (its tag), ignored by ingest.
    Unknown(String),
}

/// `BlockStored`: full blocks whose KV is now in the cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one; `None` at the start of a prompt.
    pub parent_block_hash: Option<u64>,
    /// Token ids of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter id (deprecated by vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Storage tier (`"GPU"`, `"CPU"`, …); `None` means GPU.
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// KV-cache group of hybrid models; `None` for single-group models.
    pub group_idx: Option<i64>,
    /// Multimodal hashes per block, from vLLM's `extra_keys` (64-character hex
    /// strings; LoRA names, cache salts and prompt-embedding keys are left out).
    /// Empty when no block has one; otherwise one entry per block, in order.
    pub block_mm_hashes: Vec<Vec<ExtraKeyHash>>,
    /// The request's `cache_salt`, from the first block's `extra_keys`: vLLM
    /// adds it there (after the LoRA name and mm hashes) when the block starts
    /// the prompt. Only meaningful without a parent.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Storage tier; `None` means GPU.
    pub medium: Option<String>,
    /// KV-cache group of hybrid models.
    pub group_idx: Option<i64>,
}

/// A decoded event batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher timestamp (seconds since the Unix epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank that published the batch, when given.
    pub dp_rank: Option<u32>,
}

/// A topic of the form `kv@<pod>@<model>`; other topics (vLLM's default is empty)
/// give `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topic {
    /// The pod (or worker) name.
    pub pod: String,
    /// The model name.
    pub model: String,
}

/// Parses a `kv@<pod>@<model>` topic; the model may itself contain `@`.
pub fn parse_topic(topic: &[u8]) -> Option<Topic> {
    let s = std::str::from_utf8(topic).ok()?;
    let rest = s.strip_prefix("kv@")?;
    let (pod, model) = rest.split_once('@')?;
    Some(Topic {
        pod: pod.to_string(),
        model: model.to_string(),
    })
}

/// Reads the 8-byte big-endian sequence frame. vLLM's replay end marker (-1) reads
/// as `u64::MAX`.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let b: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(b))
}

/// Decodes a msgpack event-batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value(&mut rd).map_err(DecodeError::Msgpack)?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            map_get(&value, "ts"),
            map_get(&value, "events"),
            map_get(&value, "data_parallel_rank"),
        ),
        _ => return Err(DecodeError::Batch("not an array or map")),
    };
    let ts = ts.and_then(Value::as_f64).ok_or(DecodeError::Batch("ts"))?;
    let events = events
        .and_then(Value::as_array)
        .ok_or(DecodeError::Batch("events"))?
        .iter()
        .map(decode_event)
        .collect::<Result<Vec<_>, _>>()?;
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or(DecodeError::Batch("data_parallel_rank"))?,
        ),
    };
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

fn map_get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Field access for an event encoded as a tagged array or a tagged map.
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a Value),
}

impl<'a> Fields<'a> {
    /// Field `i` (0-based, after the tag) or by name; `None` when absent.
    fn get(&self, i: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(items) => items.get(i + 1),
            Fields::Map(v) => map_get(v, name),
        }
    }
}

fn decode_event(value: &Value) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Array(items) => (
            items.first().and_then(Value::as_str),
            Fields::Array(items.as_slice()),
        ),
        Value::Map(_) => (
            map_get(value, "type").and_then(Value::as_str),
            Fields::Map(value),
        ),
        _ => return Err(DecodeError::Batch("event is not an array or map")),
    };
    let tag = tag.ok_or(DecodeError::Batch("event without a type tag"))?;
    match tag {
        "BlockStored" => decode_stored(&fields).map(KvEvent::BlockStored),
        "BlockRemoved" => decode_removed(&fields).map(KvEvent::BlockRemoved),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Ok(KvEvent::Unknown(other.to_string())),
    }
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

fn decode_stored(f: &Fields<'_>) -> Result<BlockStored, DecodeError> {
    let err = |field| DecodeError::Event {
        event: STORED,
        field,
    };
    let block_hashes = hash_list(f.get(0, "block_hashes")).ok_or(err("block_hashes"))?;
    let parent_block_hash = match f.get(1, "parent_block_hash") {
        None | Some(Value::Nil) => None,
        Some(v) => Some(block_hash(v).ok_or(err("parent_block_hash"))?),
    };
    let token_ids = f
        .get(2, "token_ids")
        .and_then(Value::as_array)
        .ok_or(err("token_ids"))?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or(err("token_ids"))?;
    let block_size = f
        .get(3, "block_size")
        .and_then(Value::as_u64)
        .filter(|&b| b > 0)
        .ok_or(err("block_size"))? as usize;
    let lora_id = opt_int(f.get(4, "lora_id"));
    let lora_name = opt_str(f.get(6, "lora_name"));
    let extra_keys = f.get(7, "extra_keys");
    Ok(BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium: opt_str(f.get(5, "medium")),
        cache_salt: extra_keys_salt(extra_keys, lora_name.as_deref(), lora_id.is_some()),
        lora_name,
        block_mm_hashes: extra_keys_mm_hashes(extra_keys),
        group_idx: opt_int(f.get(8, "group_idx")),
    })
}

/// The cache salt among the first block's `extra_keys`. vLLM lists a block's
/// keys as LoRA name, mm hashes, cache salt (first block only), prompt-embedding
/// bytes: the salt is the last plain string that is neither an mm hash nor the
/// LoRA name (when the event names the adapter only by id, the leading string
/// is its name, as vLLM always lists the adapter's name first).
fn extra_keys_salt(v: Option<&Value>, lora_name: Option<&str>, lora_id: bool) -> Option<String> {
    let first = v?.as_array()?.first()?.as_array()?;
    let strings: Vec<&str> = first
        .iter()
        .filter_map(Value::as_str)
        .filter(|s| parse_extra_key(s).is_none())
        .collect();
    let leading_lora = match lora_name {
        Some(name) => strings.first() == Some(&name),
        None => lora_id && !strings.is_empty(),
    };
    strings[usize::from(leading_lora)..]
        .last()
        .map(|s| s.to_string())
}

/// The multimodal hashes of vLLM's `extra_keys`: a list aligned with the blocks,
/// each nil or a list of keys. A key is a string (an mm hash, a LoRA name, a
/// `cache_salt`), a `[string, start offset]` pair (vLLM 0.19+), or bytes
/// (prompt embeddings). Only 64-character hex strings are mm hashes. Shapes this
/// decoder does not know are skipped rather than failing the batch.
fn extra_keys_mm_hashes(v: Option<&Value>) -> Vec<Vec<ExtraKeyHash>> {
    let Some(blocks) = v.and_then(Value::as_array) else {
        return Vec::new();
    };
    let per_block: Vec<Vec<ExtraKeyHash>> = blocks
        .iter()
        .map(|keys| {
            keys.as_array()
                .map(|keys| {
                    keys.iter()
                        .filter_map(|k| match k {
                            Value::String(s) => s.as_str(),
                            Value::Array(pair) => pair.first().and_then(Value::as_str),
                            _ => None,
                        })
                        .filter_map(parse_extra_key)
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect();
    if per_block.iter().all(Vec::is_empty) {
        Vec::new()
    } else {
        per_block
    }
}

fn decode_removed(f: &Fields<'_>) -> Result<BlockRemoved, DecodeError> {
    let block_hashes = hash_list(f.get(0, "block_hashes")).ok_or(DecodeError::Event {
        event: REMOVED,
        field: "block_hashes",
    })?;
    Ok(BlockRemoved {
        block_hashes,
        medium: opt_str(f.get(1, "medium")),
        group_idx: opt_int(f.get(2, "group_idx")),
    })
}

fn hash_list(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_array()?.iter().map(block_hash).collect()
}

/// An engine block hash: a 64-bit integer (signed values are reinterpreted) or a
/// byte string whose last 8 bytes are read big-endian (shorter ones are zero-padded).
pub fn block_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Some(u64::from_be_bytes(buf))
        }
        _ => None,
    }
}

fn opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

fn opt_int(v: Option<&Value>) -> Option<i64> {
    v.and_then(Value::as_i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_salt_is_read_from_the_first_blocks_extra_keys() {
        let st = |v: &str| Value::String(v.into());
        let mm = format!("{:064x}", 9);
        let salt = |keys: Vec<Value>, name: Option<&str>, id: bool| {
            let v = Value::Array(vec![Value::Array(keys), Value::Nil]);
            extra_keys_salt(Some(&v), name, id)
        };
        // vLLM's order: LoRA name, mm hashes (plain or `[hash, offset]`), salt, embeds.
        let full = vec![
            st("adapter"),
            Value::Array(vec![st(&mm), Value::from(0)]),
            st(&mm),
            st("tenant"),
            Value::Binary(vec![1, 2]),
        ];
        assert_eq!(salt(full, Some("adapter"), true).as_deref(), Some("tenant"));
        assert_eq!(salt(vec![st("adapter")], Some("adapter"), false), None);
        assert_eq!(
            salt(vec![st("adapter")], None, true),
            None,
            "named by id only"
        );
        let by_id = vec![st("adapter"), st("tenant")];
        assert_eq!(salt(by_id, None, true).as_deref(), Some("tenant"));
        assert_eq!(
            salt(vec![st("tenant")], None, false).as_deref(),
            Some("tenant")
        );
        assert_eq!(salt(vec![st(&mm)], None, false), None);
        assert_eq!(extra_keys_salt(None, None, false), None);
        let later_only = Value::Array(vec![Value::Nil, Value::Array(vec![st("x")])]);
        assert_eq!(extra_keys_salt(Some(&later_only), None, false), None);
    }

    #[test]
    fn topic_forms() {
        assert_eq!(
            parse_topic(b"kv@pod-1@org/model@v2"),
            Some(Topic {
                pod: "pod-1".into(),
                model: "org/model@v2".into()
            })
        );
        assert_eq!(parse_topic(b""), None);
        assert_eq!(parse_topic(b"other"), None);
    }

    #[test]
    fn seq_and_hash_forms() {
        assert_eq!(decode_seq(&7u64.to_be_bytes()).unwrap(), 7);
        assert_eq!(decode_seq(&(-1i64).to_be_bytes()).unwrap(), u64::MAX);
        assert!(matches!(decode_seq(b"abc"), Err(DecodeError::SeqLength(3))));
        assert_eq!(block_hash(&Value::from(-2i64)), Some(u64::MAX - 1));
        let mut sha = vec![0xAAu8; 24];
        sha.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(block_hash(&Value::Binary(sha)), Some(0x0102_0304_0506_0708));
        assert_eq!(block_hash(&Value::Binary(vec![1, 2])), Some(0x0102));
        assert_eq!(block_hash(&Value::from("x")), None);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(matches!(
            decode_batch(b"\x92\x01"),
            Err(DecodeError::Msgpack(_))
        ));
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(3)).unwrap();
        assert!(matches!(
            decode_batch(&buf),
            Err(DecodeError::Batch("not an array or map"))
        ));
    }
}
