//! The topology callbacks of a placement built over a fixed pool of workers: a
//! worker of that pool may report ready; any other change fails the run, since
//! the placement cannot follow it.

use aisimulate_core::replay::{Placement, WorkerTopology};
use anyhow::bail;

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
