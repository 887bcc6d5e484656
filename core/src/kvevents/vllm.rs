//! vLLM's KV events: msgspec batches over ZMQ PUB ([`super::msgpack`]), with
//! `BlockStored.medium` naming the tier: absent or `GPU` for GPU memory, `CPU`
//! for the CPU offloading connector's host copies, `DISK` for disk.

use super::event::{DecodeError, EventBatch, EventDecoder, StorageTier};
use super::msgpack;

/// The vLLM decoder.
#[derive(Debug, Clone, Copy, Default)]
pub struct Vllm;

impl EventDecoder for Vllm {
    fn publishes(&self) -> bool {
        true
    }

    fn decode(&self, payload: &[u8]) -> Result<EventBatch, DecodeError> {
        msgpack::decode_batch(payload, tier)
    }
}

/// vLLM's `medium` names, read case-insensitively.
fn tier(medium: Option<&str>) -> StorageTier {
    match medium {
        None => StorageTier::Gpu,
        Some(m) if m.eq_ignore_ascii_case("gpu") => StorageTier::Gpu,
        Some(m) if m.eq_ignore_ascii_case("cpu") => StorageTier::Cpu,
        Some(m) if m.eq_ignore_ascii_case("disk") => StorageTier::Disk,
        Some(m) => StorageTier::Other(m.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_names() {
        assert_eq!(tier(None), StorageTier::Gpu);
        assert_eq!(tier(Some("GPU")), StorageTier::Gpu);
        assert_eq!(tier(Some("gpu")), StorageTier::Gpu);
        assert_eq!(tier(Some("CPU")), StorageTier::Cpu);
        assert_eq!(tier(Some("DISK")), StorageTier::Disk);
        assert_eq!(tier(Some("LMCACHE")), StorageTier::Other("LMCACHE".into()));
    }
}
