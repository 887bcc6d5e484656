//! SGLang's KV events: the same msgpack batches as vLLM's ([`super::msgpack`]);
//! token ids carry images as pad values already, and there are no `extra_keys`.
//! With HiCache, `medium` names the tier: absent or `GPU` for device memory,
//! `CPU_TIER1` / `CPU_TIER2` (any `CPU…` name) for the host-memory tier.

use super::event::{DecodeError, EventBatch, EventDecoder, StorageTier};
use super::msgpack;

/// The SGLang decoder.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sglang;

impl EventDecoder for Sglang {
    fn publishes(&self) -> bool {
        true
    }

    fn decode(&self, payload: &[u8]) -> Result<EventBatch, DecodeError> {
        msgpack::decode_batch(payload, tier)
    }
}

/// SGLang's `medium` names, read case-insensitively.
fn tier(medium: Option<&str>) -> StorageTier {
    let Some(m) = medium else {
        return StorageTier::Gpu;
    };
    let upper = m.to_ascii_uppercase();
    if upper == "GPU" {
        StorageTier::Gpu
    } else if upper.starts_with("CPU") {
        StorageTier::Cpu
    } else if upper == "DISK" {
        StorageTier::Disk
    } else {
        StorageTier::Other(m.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_names() {
        assert_eq!(tier(None), StorageTier::Gpu);
        assert_eq!(tier(Some("GPU")), StorageTier::Gpu);
        assert_eq!(tier(Some("CPU_TIER1")), StorageTier::Cpu);
        assert_eq!(tier(Some("cpu_tier2")), StorageTier::Cpu);
        assert_eq!(tier(Some("L3")), StorageTier::Other("L3".into()));
    }
}
