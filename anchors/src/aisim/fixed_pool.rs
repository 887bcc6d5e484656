//! The topology a placement built over a fixed pool of workers accepts: an
//! aggregated replay of data-parallel size 1, whose workers may report ready;
//! any other shape or change fails the run, since the placement cannot follow it.

use aisimulate_core::replay::{Placement, WorkerTopology};
use anyhow::bail;

/// Refuses a data-parallel size other than 1.
pub fn single_rank(policy: &str, dp_size: u32) -> anyhow::Result<()> {
    if dp_size != 1 {
        bail!("{policy} placement runs dp size 1 workers, got {dp_size}");
    }
    Ok(())
}

/// Refuses a disaggregated (prefill / decode) replay.
pub fn aggregated_only<T>(policy: &str) -> anyhow::Result<T> {
    bail!("{policy} placement runs aggregated replays only")
}

/// `w` reported ready: nothing to place when the pool has it (`known`).
pub fn ready(policy: &str, known: bool, w: &WorkerTopology) -> anyhow::Result<Vec<Placement>> {
    if !known {
        bail!(
            "{policy} placement runs a fixed pool; worker {} joined",
            w.worker_id
        );
    }
    Ok(Vec::new())
}

/// `w` drains or leaves (`what`): the fixed pool cannot follow it.
pub fn changed(policy: &str, w: &WorkerTopology, what: &str) -> anyhow::Result<Vec<Placement>> {
    bail!(
        "{policy} placement runs a fixed pool; worker {} {what}",
        w.worker_id
    )
}
