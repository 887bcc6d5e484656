//! Worker identity: the stable instance id a worker gets when it has no
//! `kvpick.io/instance-id` annotation.
//!
//! The function is deliberately simple so a sidecar in any language can compute
//! its own id: 64-bit FNV-1a over the UTF-8 bytes of `namespace/pod-name` (or of
//! `ip:port` in standalone mode), keeping the low 53 bits so the id is exact in a
//! JSON number / IEEE double.
//!
//! ```text
//! h = 0xcbf29ce484222325
//! for byte in key: h = (h XOR byte) * 0x100000001b3   (wrapping, mod 2^64)
//! id = h AND (2^53 - 1)
//! ```

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const MASK_53: u64 = (1 << 53) - 1;

/// The stable 53-bit instance id of `key` (`namespace/name` or `ip:port`).
pub fn instance_id_for(key: &str) -> u64 {
    let mut h = FNV_OFFSET;
    for b in key.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h & MASK_53
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_stay_fixed() {
        // These values are part of the public contract (README); never change them.
        assert_eq!(instance_id_for(""), 0xcbf29ce484222325 & MASK_53);
        assert_eq!(instance_id_for("a"), 0xaf63dc4c8601ec8c & MASK_53);
        assert_eq!(
            instance_id_for("default/vllm-0"),
            instance_id_for("default/vllm-0")
        );
        assert_ne!(
            instance_id_for("default/vllm-0"),
            instance_id_for("default/vllm-1")
        );
        assert!(instance_id_for("default/vllm-0") < (1 << 53));
    }
}
