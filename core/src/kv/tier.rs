//! Storage tiers of the prefix index: where a worker holds a block (GPU
//! memory, or a lower tier it must load the block from first), and how the
//! index keeps them apart.
//!
//! A worker's copies on a lower tier are held by a holder of their own in the
//! index, the worker's key with the tier in the top bits of its rank
//! ([`holder`]): the runs, holder sets, engine maps and precise caps of the
//! index then serve every tier as they serve the GPU's, and a lookup answers
//! each tier's leading run. Ranks stay below [`crate::endpoints::MAX_DP_SIZE`],
//! far below the tier bits, so no worker's own key is ever a tier holder.
//!
//! A block held on several tiers counts as on its best one: a candidate's
//! leading run is split into the part on the GPU, then the part only on the
//! CPU tier, then the part only on disk ([`TierBlocks::of_depths`]).

use crate::keys::WorkerKey;
use crate::kvevents::StorageTier;

/// First bit of a rank that names a tier.
const TIER_SHIFT: u32 = 30;

/// A storage tier kvpick tells apart, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// GPU memory: served without a copy.
    Gpu = 0,
    /// Host (CPU) memory: copied to the GPU before use.
    Cpu = 1,
    /// Local disk: read back before use.
    Disk = 2,
}

impl Tier {
    /// The tiers below the GPU's, best first.
    pub const LOWER: [Tier; 2] = [Tier::Cpu, Tier::Disk];

    /// The tier an event names; `None` for one kvpick has no name for.
    pub fn of(tier: &StorageTier) -> Option<Tier> {
        match tier {
            StorageTier::Gpu => Some(Tier::Gpu),
            StorageTier::Cpu => Some(Tier::Cpu),
            StorageTier::Disk => Some(Tier::Disk),
            StorageTier::Other(_) => None,
        }
    }
}

/// The index holder of `worker`'s copies on `tier` (the worker itself for the GPU).
pub fn holder(worker: WorkerKey, tier: Tier) -> WorkerKey {
    WorkerKey {
        instance_id: worker.instance_id,
        dp_rank: device(worker).dp_rank | ((tier as u32) << TIER_SHIFT),
    }
}

/// The worker an index holder stands for.
pub fn device(key: WorkerKey) -> WorkerKey {
    WorkerKey {
        instance_id: key.instance_id,
        dp_rank: key.dp_rank & ((1 << TIER_SHIFT) - 1),
    }
}

/// The tier an index holder holds.
pub fn tier_of(key: WorkerKey) -> Tier {
    match key.dp_rank >> TIER_SHIFT {
        0 => Tier::Gpu,
        1 => Tier::Cpu,
        _ => Tier::Disk,
    }
}

/// A candidate's leading prompt blocks, by the best tier each is on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBlocks {
    /// On the GPU.
    pub gpu: usize,
    /// On the CPU tier and not the GPU.
    pub cpu: usize,
    /// On disk only.
    pub disk: usize,
}

impl TierBlocks {
    /// The split of a leading run from each tier's own leading run: blocks
    /// up to the GPU's depth are on the GPU, those up to the CPU tier's
    /// beyond it on the CPU, those up to the disk's beyond both on disk.
    pub fn of_depths(gpu: usize, cpu: usize, disk: usize) -> Self {
        TierBlocks {
            gpu,
            cpu: cpu.saturating_sub(gpu),
            disk: disk.saturating_sub(gpu.max(cpu)),
        }
    }

    /// The whole leading run.
    pub fn total(&self) -> usize {
        self.gpu + self.cpu + self.disk
    }

    /// The tier whose own leading run is the whole run (the best one when
    /// several are).
    pub fn deepest(&self) -> Tier {
        match (self.cpu, self.disk) {
            (0, 0) => Tier::Gpu,
            (_, 0) => Tier::Cpu,
            _ => Tier::Disk,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_round_trip_and_never_name_a_rank() {
        let w = WorkerKey {
            instance_id: 7,
            dp_rank: 3,
        };
        for t in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
            let h = holder(w, t);
            assert_eq!((device(h), tier_of(h)), (w, t));
            assert_eq!(holder(h, Tier::Gpu), w);
        }
        assert_eq!(holder(w, Tier::Gpu), w);
        assert!(holder(w, Tier::Cpu).dp_rank >= crate::endpoints::MAX_DP_SIZE);
    }

    #[test]
    fn a_block_counts_on_its_best_tier() {
        let t = TierBlocks::of_depths(3, 8, 10);
        assert_eq!((t.gpu, t.cpu, t.disk, t.total()), (3, 5, 2, 10));
        assert_eq!(t.deepest(), Tier::Disk);
        let t = TierBlocks::of_depths(6, 4, 2);
        assert_eq!((t.gpu, t.cpu, t.disk), (6, 0, 0));
        assert_eq!(t.deepest(), Tier::Gpu);
        assert_eq!(TierBlocks::of_depths(0, 5, 5).deepest(), Tier::Cpu);
    }
}
