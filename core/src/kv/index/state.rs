//! What the index holds: its settings and defaults, runs and lineages, each
//! worker's bookkeeping, the slot names and the clock, all behind the index's
//! lock in [`Inner`].

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::keys::{KeyHash, WorkerKey};
use crate::kv::lru::Lru;
use crate::kv::slots::SlotSet;
use crate::kv::table::{BlockTable, Place};

/// Default LRU bound per worker in blocks, when neither the engine's capacity nor
/// a flag says otherwise (the GIE prefix plugin's default).
pub const DEFAULT_CAPACITY_BLOCKS: usize = 31_250;

/// Default time an approximate entry stays valid after its last touch.
pub const DEFAULT_TTL: Duration = Duration::from_secs(900);

/// Default cap on a worker's precise entries until its engine's block count is known.
pub const DEFAULT_PRECISE_LIMIT: usize = 1_000_000;

/// Default slack over an engine's block count for its precise cap.
pub const DEFAULT_PRECISE_SLACK: f64 = 1.5;

/// Blocks a writer handles per lock acquisition.
pub const WRITE_CHUNK: usize = 64;

pub(super) type Map<K, V> = HashMap<K, V, KeyHash>;

/// Where a block lives: its lineage and its absolute position there. Positions
/// never change while the block exists (splits keep them, merges join only
/// neighbouring pieces of one lineage), so a location kept aside stays valid;
/// [`Inner::run_at`] finds the run covering it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Loc {
    pub(super) lineage: u32,
    pub(super) pos: u32,
}

/// Consecutive blocks with one holder set.
#[derive(Debug, Default)]
pub(super) struct Run {
    /// Absolute position of `hashes[0]` in its lineage.
    pub(super) start: u32,
    /// A deque so that a split moving a short front away does not shift the rest.
    pub(super) hashes: VecDeque<u64>,
    pub(super) holders: SlotSet,
    pub(super) lineage: u32,
    /// Whether blocks after the first may have an entry in the block table (every
    /// block does without chained hashes, and every block an approximate entry
    /// holds does); else only the first has one.
    pub(super) indexed: bool,
}

impl Run {
    pub(super) fn end(&self) -> u32 {
        self.start + self.hashes.len() as u32
    }
}

/// Per-worker bookkeeping.
#[derive(Debug, Default)]
pub(super) struct Worker {
    pub(super) key: Option<WorkerKey>,
    pub(super) capacity: Option<usize>,
    pub(super) precise_limit: Option<usize>,
    pub(super) precise: bool,
    /// Approximate entries ordered by the key of their latest touch
    /// ([`PrefixIndex::key`]).
    pub(super) recency: Lru,
    /// Stamp of the oldest live approximate entry (`u32::MAX`: none).
    pub(super) oldest: u32,
    /// Precise entries: extra engine blocks naming a kvpick hash already held
    /// precisely (beyond the first); usually empty.
    pub(super) extra: Map<u64, u32>,
    /// Approximate workers only: kvpick hashes held through a precise entry (a
    /// precise worker's held hashes are exactly its run holdings).
    pub(super) precise_held: HashSet<u64, KeyHash>,
    /// A lower tier's holder ([`crate::kv::tier`]): how many blocks each of
    /// its engine blocks covers, ending with the one its engine map locates.
    pub(super) span: u32,
}

/// Every worker's precise entries: engine hash → where the block is (its kvpick
/// hash is there), and a store's scratch, kept between calls.
#[derive(Debug, Default)]
pub(super) struct Engines {
    pub(super) maps: Map<WorkerKey, BlockTable<Loc>>,
    pub(super) plan: StorePlan,
    pub(super) placed: Vec<(Loc, bool)>,
}

/// Settings of a [`PrefixIndex`].
#[derive(Debug, Clone, Copy)]
pub struct IndexConfig {
    /// LRU bound per worker in blocks until [`PrefixIndex::set_capacity`] is called.
    pub default_capacity: usize,
    /// How long an approximate entry of a worker whose capacity is unknown
    /// stays valid after its last touch (`None`: forever). Once
    /// [`PrefixIndex::set_capacity`] gives the engine's capacity, its LRU bound
    /// alone stands for the engine's evictions: an engine under no pressure
    /// keeps its blocks however old.
    pub ttl: Option<Duration>,
    /// Cap on a worker's precise entries until [`PrefixIndex::set_precise_limit`]
    /// is called.
    pub default_precise_limit: usize,
    /// The precise cap from an engine's block count is that count times this.
    pub precise_slack: f64,
    /// Block hashes are chained (a hash names its whole prefix, so a block has one
    /// parent and follows it wherever it is stored) and every write says where its
    /// chain continues ([`PrefixIndex::store_engine_chain`]'s parent, a prompt
    /// from its first block for [`PrefixIndex::insert`]). Then the block table
    /// needs only each run's first block (and the blocks approximate entries
    /// hold): the rest are found from their parent. Off, every block has an
    /// entry (for hashes that are not chained).
    pub chained: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            default_capacity: DEFAULT_CAPACITY_BLOCKS,
            ttl: Some(DEFAULT_TTL),
            default_precise_limit: DEFAULT_PRECISE_LIMIT,
            precise_slack: DEFAULT_PRECISE_SLACK,
            chained: true,
        }
    }
}

/// A lineage's runs.
#[derive(Debug)]
pub(super) struct Lineage {
    /// Its runs by start; empty: the lineage is free.
    pub(super) pieces: Vec<u32>,
}

/// Which worker each slot is, both ways.
#[derive(Debug, Default, Clone)]
pub(super) struct SlotNames {
    pub(super) slots: Map<WorkerKey, u32>,
    /// Slot → worker, the inverse of `slots`.
    pub(super) keys: Vec<Option<WorkerKey>>,
}

#[derive(Debug, Default)]
pub(super) struct Inner {
    /// Block hash → location: every run's first block, and more (see [`Run::indexed`]).
    pub(super) blocks: BlockTable<Loc>,
    pub(super) runs: Vec<Run>,
    pub(super) free_runs: Vec<u32>,
    pub(super) lineages: Vec<Lineage>,
    /// Per lineage, its run when it has only one, else `u32::MAX`: most have
    /// one, and a lookup then finds the run without reading the lineage's
    /// pieces, in an array dense enough to stay in cache.
    pub(super) only_run: Vec<u32>,
    pub(super) free_lineages: Vec<u32>,
    /// [`IndexConfig::chained`].
    pub(super) chained: bool,
    /// Shared with the [`Overlaps`] answers still alive (copied on write then).
    pub(super) names: Arc<SlotNames>,
    pub(super) workers: Vec<Worker>,
    pub(super) free_slots: Vec<u32>,
    /// (oldest approximate stamp, slot) of every worker with approximate entries.
    pub(super) expiring: BTreeSet<(u32, u32)>,
    /// Slots of lower tiers' holders: while there are none, lookups read the
    /// GPU's answer alone.
    pub(super) tier_slots: usize,
    pub(super) clock: Clock,
}

/// The index's two time scales: an LRU **key** (nanoseconds since the Unix
/// epoch, the order of touches, comparable between replicas) and a **stamp**
/// (whole seconds since the index's base, what TTLs count).
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock {
    pub(super) base: Instant,
    /// The key of `base`.
    pub(super) epoch: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::at(Instant::now())
    }
}

impl Clock {
    /// A clock whose base is `base`, placed on the system clock.
    pub(super) fn at(base: Instant) -> Self {
        let wall = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let wall = wall.saturating_sub(Instant::now().saturating_duration_since(base));
        Clock {
            base,
            epoch: u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    pub(super) fn key(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.base).as_nanos();
        self.epoch
            .saturating_add(u64::try_from(since).unwrap_or(u64::MAX))
    }

    pub(super) fn stamp_of(&self, key: u64) -> u32 {
        let secs = key.saturating_sub(self.epoch) / 1_000_000_000;
        secs.min(u64::from(u32::MAX - 1)) as u32
    }
}

/// What one chunk of a precise store does for its worker, planned from the
/// worker's engine map under the read lock
/// ([`PrefixIndex::store_engine_chain`]).
#[derive(Debug, Default)]
pub(super) struct StorePlan {
    /// The blocks to hold, in chain order: the chunk, up to `stopped`.
    pub(super) chain: Vec<u64>,
    /// Chain indexes of the engine hashes mapped by this chunk, with their
    /// places in the engine map (claimed by the plan for new ones; their
    /// locations are set once the write has placed the blocks).
    pub(super) mapped: Vec<(usize, Place)>,
    /// Blocks that engine hashes remapped by this chunk named before it.
    pub(super) released: Vec<(u64, Loc)>,
    /// Remapped engine hashes first mapped earlier in this chunk (chain index).
    pub(super) released_here: Vec<usize>,
    /// Chain index of the first block beyond the worker's precise cap.
    pub(super) stopped: Option<usize>,
}
