//! Keys shared by the endpoint table and the prefix index, so neither imports
//! the other: [`WorkerKey`], one worker's data-parallel rank, and [`KeyHash`], a
//! fast hasher for small keys and for block hashes.

use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

/// One (worker, data-parallel rank): the unit that owns a KV cache and a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The worker's instance id (`x-worker-instance-id`).
    pub instance_id: u64,
    /// The data-parallel rank inside the worker (`x-dp-rank`).
    pub dp_rank: u32,
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.instance_id, self.dp_rank)
    }
}

/// A fast hasher for small keys such as [`WorkerKey`] and block hashes (FxHash's
/// mixing step): every lookup and write hashes keys on the hot path.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// Build-hasher for maps keyed by [`WorkerKey`] or block hashes.
pub type KeyHash = BuildHasherDefault<KeyHasher>;
