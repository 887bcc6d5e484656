//! Partial hits: prompt blocks a candidate holds on a lower storage tier
//! ([`crate::kv::tier`]) save their prefill but cost their load.
//!
//! A block loaded from the CPU tier or from disk counts as a fraction of a
//! block to prefill ([`TierCosts`], one flag per tier): the candidate's prefill
//! work is its uncached blocks plus its lower-tier blocks at their fractions
//! ([`Work`]). The heuristic terms weigh that work as they weigh uncached
//! blocks; the predicted term turns it into seconds with the worker's learned
//! prefill rate, so a load costs its fraction of the learned time to prefill
//! the same blocks.
//!
//! Invariant: a fraction is in `[0, 1]`, so a candidate's work is at least its
//! uncached blocks (the pruned argmin's floors, which count those alone, stay
//! lower bounds) and at most the blocks it would prefill holding nothing.

use super::plugin::Knob;
use crate::kv::hash::PromptBlocks;
use crate::kv::tier::TierBlocks;

/// The CPU tier's load cost per block, as a fraction of prefilling the block.
pub static CPU_COST: Knob = Knob {
    flag: "tier-cost-cpu",
    env: "KVPICK_TIER_COST_CPU",
    default: 0.2,
    help: "Cost of loading a prompt block a worker holds in CPU memory, as a fraction of prefilling it (0..1)",
};

/// The disk tier's load cost per block, as a fraction of prefilling the block.
pub static DISK_COST: Knob = Knob {
    flag: "tier-cost-disk",
    env: "KVPICK_TIER_COST_DISK",
    default: 0.5,
    help: "Cost of loading a prompt block a worker holds on disk, as a fraction of prefilling it (0..1)",
};

/// The tier flags, in the order `--help` lists them.
pub static KNOBS: [&Knob; 2] = [&CPU_COST, &DISK_COST];

/// What loading a block from each lower tier costs, as a fraction of
/// prefilling it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierCosts {
    /// From CPU memory.
    pub cpu: f64,
    /// From disk.
    pub disk: f64,
}

impl Default for TierCosts {
    fn default() -> Self {
        TierCosts {
            cpu: CPU_COST.default,
            disk: DISK_COST.default,
        }
    }
}

impl TierCosts {
    /// These costs with the value of the knob named `flag` set (clamped to
    /// `[0, 1]`, a non-finite value counting 1); false when no tier knob has
    /// that flag.
    pub fn set_flag(&mut self, flag: &str, value: f64) -> bool {
        let value = if value.is_finite() {
            value.clamp(0.0, 1.0)
        } else {
            1.0
        };
        match flag {
            f if f == CPU_COST.flag => self.cpu = value,
            f if f == DISK_COST.flag => self.disk = value,
            _ => return false,
        }
        true
    }

    /// A candidate's work on `prompt` holding `held` of its leading blocks.
    pub fn work(&self, prompt: &PromptBlocks, held: TierBlocks) -> Work {
        if held.cpu == 0 && held.disk == 0 {
            return Work::cold(prompt.uncached(held.gpu));
        }
        let gpu = held.gpu;
        let cpu = gpu + held.cpu;
        let new_blocks = prompt.uncached(held.total());
        // Blocks (images' tokens included) each lower tier saves prefilling.
        let on_cpu = prompt.uncached(gpu) - prompt.uncached(cpu);
        let on_disk = prompt.uncached(cpu) - new_blocks;
        Work {
            new_blocks,
            transfer_blocks: self.cpu * on_cpu as f64 + self.disk * on_disk as f64,
        }
    }
}

/// What a candidate must do before its first token, in blocks of prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Work {
    /// Prompt blocks to prefill (those after its leading run).
    pub new_blocks: usize,
    /// Its lower-tier blocks to load, at their tiers' fractions of a block's prefill.
    pub transfer_blocks: f64,
}

impl Work {
    /// Work with nothing to load.
    pub fn cold(new_blocks: usize) -> Self {
        Work {
            new_blocks,
            transfer_blocks: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(blocks: usize) -> PromptBlocks {
        let mut p = PromptBlocks::default();
        p.hashes = (0..blocks as u64).collect();
        p
    }

    /// The same leading run costs least on the GPU, then on the CPU tier,
    /// then on disk, and most nowhere.
    #[test]
    fn a_run_costs_gpu_then_cpu_then_disk_then_cold() {
        let c = TierCosts::default();
        let p = prompt(10);
        let on = |gpu, cpu, disk| {
            let w = c.work(&p, TierBlocks { gpu, cpu, disk });
            w.new_blocks as f64 + w.transfer_blocks
        };
        let (gpu, cpu, disk, cold) = (on(8, 0, 0), on(0, 8, 0), on(0, 0, 8), on(0, 0, 0));
        assert!(
            gpu < cpu && cpu < disk && disk < cold,
            "{gpu} {cpu} {disk} {cold}"
        );
        assert_eq!(cold, 10.0);
        assert_eq!(gpu, 2.0);
        assert!((cpu - (2.0 + 8.0 * 0.2)).abs() < 1e-9);
        let mixed = c.work(&p, TierBlocks::of_depths(2, 6, 9));
        assert_eq!(mixed.new_blocks, 1);
        assert!((mixed.transfer_blocks - (4.0 * 0.2 + 3.0 * 0.5)).abs() < 1e-9);
    }

    #[test]
    fn flags_set_clamped_fractions() {
        let mut c = TierCosts::default();
        assert!(c.set_flag("tier-cost-cpu", 0.1));
        assert!(c.set_flag("tier-cost-disk", 7.0));
        assert!(!c.set_flag("tier-cost-tape", 0.3));
        assert_eq!((c.cpu, c.disk), (0.1, 1.0));
        assert!(c.set_flag("tier-cost-cpu", f64::NAN));
        assert_eq!(c.cpu, 1.0);
        assert!(c.set_flag("tier-cost-cpu", -1.0));
        assert_eq!(c.cpu, 0.0);
    }
}
