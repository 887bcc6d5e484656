//! The KV-event payload vLLM and SGLang share: a msgpack-encoded event batch.
//! Pure: bytes in, events out.
//!
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
//! ([`BlockStored::cache_salt`]). The engines name storage tiers their own way:
//! each decoder passes its reading of the `medium` field ([`TierNames`]).

use rmpv::Value;

use super::event::{BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent, StorageTier};
use crate::multimodal::identity::{parse_extra_key, ExtraKeyHash};

/// An engine's reading of a `medium` field (absent: `None`).
pub type TierNames = fn(Option<&str>) -> StorageTier;

/// Decodes a msgpack event-batch payload, reading `medium` fields with `tiers`.
pub fn decode_batch(payload: &[u8], tiers: TierNames) -> Result<EventBatch, DecodeError> {
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
        .map(|e| decode_event(e, tiers))
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

fn decode_event(value: &Value, tiers: TierNames) -> Result<KvEvent, DecodeError> {
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
        "BlockStored" => decode_stored(&fields, tiers).map(KvEvent::BlockStored),
        "BlockRemoved" => decode_removed(&fields, tiers).map(KvEvent::BlockRemoved),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Ok(KvEvent::Unknown(other.to_string())),
    }
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

fn decode_stored(f: &Fields<'_>, tiers: TierNames) -> Result<BlockStored, DecodeError> {
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
        tier: tiers(f.get(5, "medium").and_then(Value::as_str)),
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

fn decode_removed(f: &Fields<'_>, tiers: TierNames) -> Result<BlockRemoved, DecodeError> {
    let block_hashes = hash_list(f.get(0, "block_hashes")).ok_or(DecodeError::Event {
        event: REMOVED,
        field: "block_hashes",
    })?;
    Ok(BlockRemoved {
        block_hashes,
        tier: tiers(f.get(1, "medium").and_then(Value::as_str)),
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
    fn hash_forms() {
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
            decode_batch(b"\x92\x01", |_| StorageTier::Gpu),
            Err(DecodeError::Msgpack(_))
        ));
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &Value::from(3)).unwrap();
        assert!(matches!(
            decode_batch(&buf, |_| StorageTier::Gpu),
            Err(DecodeError::Batch("not an array or map"))
        ));
    }
}
