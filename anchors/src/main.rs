//! `kvpick-anchors`: kvpick next to public anchors on identical workloads, every
//! figure printed as a ratio to the anchor measured in the same run.
//!
//! One module per subcommand; this file only dispatches.

mod aisim;
mod index;
mod measure;
mod replay;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// kvpick's prefix index next to Dynamo's `RadixTree` and
    /// `ConcurrentRadixTreeCompressed` (through `ThreadPoolIndexer`).
    Index(index::IndexArgs),
    /// The trace replay of `kvpick-bench replay` with Dynamo's router
    /// (`DefaultWorkerSelector`, its indexer and active-sequence tracking) as one
    /// more policy, over every (capacity, speed) given.
    Replay(replay::ReplayCmd),
    /// kvpick inside NVIDIA's AISimulate beside Dynamo's KV router and round
    /// robin (`dynamo-mocker`), same engine, same trace, same run.
    Aisim(aisim::AisimArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Index(args) => index::run(args),
        Command::Replay(cmd) => replay::run(cmd),
        Command::Aisim(args) => aisim::run(args),
    }
}
