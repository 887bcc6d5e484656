//! `kvpick-anchors index`: kvpick's prefix index next to Dynamo's KV indexer.
//!
//! Three indexes run the same workloads, each cell (index × workload × workers)
//! in a child process of its own so that RSS growth is the index's alone:
//! - `kvpick`: [`PrefixIndex`], every worker precise (fed by `store_engine_chain`
//!   / `remove_engine_blocks`, engine hash = kvpick hash) from **one** thread, as
//!   production applies every KV event on its one `kv-ingest` thread
//!   (`kvevents::subscriber`: subscriber tasks only receive frames and queue them);
//!   looked up with `PrefixIndex::overlaps` (every worker's overlap, like Dynamo's
//!   `find_matches`; the answer is read per worker in O(log runs crossed), as the
//!   scheduler does);
//! - `kvpick-read-all`: the same, but each timed lookup also reads every worker's
//!   overlap from the answer (what the scheduler pays with every worker a
//!   candidate; Dynamo's timing does not include reading its map);
//! - `dynamo-crtc`: Dynamo's `ConcurrentRadixTreeCompressed` behind a
//!   `ThreadPoolIndexer` with 2 threads (events enqueued, then flushed);
//! - `dynamo-radix`: Dynamo's single-threaded `RadixTree`.
//!
//! Workloads (block hashes are chained: a block's hash names its whole prefix, as
//! kvpick's and the engines' are; Dynamo gets the same u64 as local and external
//! hash):
//! - `shared`: every worker holds a 128-block system prompt and conversations of 64
//!   blocks branching off it (16 each, fewer where `--max-entries` caps the cell:
//!   at 10,000 workers 14, so ~10 M entries); lookups are 2,048-block prompts
//!   sharing the system prompt and one conversation;
//! - `mooncake`: the public Mooncake trace's requests as hash chains, every
//!   request's blocks stored on the worker a prefix-affinity router picks (the
//!   worker that first stored the request's deepest known block, else the next in
//!   round robin); the trace is replayed `workers / 64` times with distinct salts
//!   (at least once, at most what fits `--max-entries`) so large fleets are not
//!   mostly empty; lookups are requests of the trace;
//! - `churn`: every worker holds a 32-block shared prefix and a fixed number of
//!   32-block chains (about 1 M entries in all); the main thread removes each
//!   worker's oldest chain and stores a new one, round robin, for
//!   `--churn-blocks` blocks at full speed, while a second thread looks up prompts
//!   (prefix + a chain + 64 fresh blocks) and records the latency of each. The
//!   lookups are paced, the same for every index (`--churn-lookup-every-us`, 100:
//!   10,000 lookups a second, sleeping in between; an index slower than that
//!   runs them back to back): a lookup thread looping flat out would offer each
//!   index a different load (one 50 times faster at lookups took 50 times more
//!   turns at its lock and at the 2 cores, and its ingest figure measured that).
//!   Dynamo applies events on its `ThreadPoolIndexer`'s 2 threads (the main
//!   thread only enqueues); `kvpick` on one writer thread, as production's
//!   ingest thread. `dynamo-radix` is not concurrent and sits this one out.
//!
//! Every cell reports a digest of each query's nonzero overlaps per (worker, rank);
//! the parent asserts kvpick's equal Dynamo's on every query (churn: on queries
//! after the churn settled). Dynamo is the correctness oracle as well as the
//! speed anchor.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use kvpick::endpoints::WorkerKey;
use kvpick::kv::index::{IndexConfig, PrefixIndex};
use serde::{Deserialize, Serialize};

use crate::measure::{mix, process_cpu_ns, quantile_us, rss_bytes, SchedStat, SplitMix64};

/// Blocks of the shared system prompt (`shared`).
const SYSTEM_BLOCKS: usize = 128;
/// Blocks of a conversation (`shared`).
const CONVERSATION_BLOCKS: usize = 64;
/// Conversations per worker (`shared`) unless `--max-entries` caps them.
const CONVERSATIONS: usize = 16;
/// Blocks of a looked-up prompt (`shared`): 32k tokens at 16 tokens a block.
const PROMPT_BLOCKS: usize = 2048;
/// Blocks of the shared prefix and of each chain (`churn`).
const CHURN_BLOCKS: usize = 32;
/// Entries of the churn table before churning.
const CHURN_TABLE: usize = 1_000_000;
/// Dynamo's event threads.
const EVENT_THREADS: usize = 2;

/// Options of `kvpick-anchors index`.
#[derive(clap::Args, Debug, Clone)]
pub struct IndexArgs {
    /// Worker counts (one dp rank each).
    #[arg(long, value_delimiter = ',', default_value = "8,64,1024,10000")]
    workers: Vec<usize>,
    /// Workloads to run.
    #[arg(long, value_delimiter = ',', default_value = "shared,mooncake,churn")]
    workloads: Vec<Kind>,
    /// Indexes to run (the parent always needs `dynamo-crtc` for ratios).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kvpick,kvpick-read-all,dynamo-crtc,dynamo-radix"
    )]
    indexes: Vec<Impl>,
    /// Upper bound on the (block, worker) entries of one cell.
    #[arg(long, default_value_t = 10_000_000)]
    max_entries: usize,
    /// Timed lookups per cell.
    #[arg(long, default_value_t = 1000)]
    queries: usize,
    /// Blocks stored plus removed during `churn`.
    #[arg(long, default_value_t = 2_000_000)]
    churn_blocks: usize,
    /// One lookup every this many microseconds during `churn` (0: back to back).
    #[arg(long, default_value_t = 100)]
    churn_lookup_every_us: u64,
    /// Trace every churn write call and lookup (span, the thread's run-queue wait)
    /// and say what the slowest lookups overlapped (a diagnosis; adds a
    /// `/proc` read around each call).
    #[arg(long)]
    churn_trace: bool,
    /// Dynamo's `RadixTree` (one node per block) runs only below this many workers.
    #[arg(long, default_value_t = 10_000)]
    radix_below: usize,
    /// The Mooncake trace (JSON lines with `hash_ids`).
    #[arg(long, default_value = "../shared/data/mooncake_synthetic_trace.jsonl")]
    trace: PathBuf,
    /// Write the report (markdown) here too.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: run one cell (`index/workload/workers`) and print its JSON.
    #[arg(long, hide = true)]
    cell: Option<String>,
}

/// A workload.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Kind {
    Shared,
    Mooncake,
    Churn,
}

/// An index under test.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Impl {
    Kvpick,
    KvpickReadAll,
    DynamoCrtc,
    DynamoRadix,
}

impl Impl {
    fn name(self) -> &'static str {
        match self {
            Impl::Kvpick => "kvpick",
            Impl::KvpickReadAll => "kvpick-read-all",
            Impl::DynamoCrtc => "dynamo-crtc",
            Impl::DynamoRadix => "dynamo-radix",
        }
    }
}

/// One stored chain: `blocks` follow `parent` (None: from the root) on `worker`.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    pub(crate) worker: u64,
    pub(crate) parent: Option<u64>,
    pub(crate) blocks: Vec<u64>,
}

/// A churn step: remove a chain, store another.
#[derive(Debug, Clone)]
struct Swap {
    worker: u64,
    removed: Vec<u64>,
    stored: Store,
}

/// Everything one cell runs, generated deterministically from its parameters.
#[derive(Debug, Default)]
struct Workload {
    fill: Vec<Store>,
    /// Queries timed on the filled, quiescent index (and checked against the oracle).
    queries: Vec<Vec<u64>>,
    churn: Vec<Swap>,
    /// Queries looked up during the churn (timed, not checked).
    churn_queries: Vec<Vec<u64>>,
    /// Queries checked after the churn settled.
    final_queries: Vec<Vec<u64>>,
    /// How this cell was scaled.
    note: String,
}

/// A chain of `n` hashes following `parent`, distinct per `salt`.
fn chain(parent: u64, salt: u64, n: usize) -> Vec<u64> {
    let mut h = parent;
    (0..n as u64)
        .map(|i| {
            h = mix(h.rotate_left(23) ^ mix(salt.wrapping_mul(0x1_0000_0001) ^ i));
            h
        })
        .collect()
}

fn shared(workers: usize, args: &IndexArgs) -> Workload {
    let per_worker = args.max_entries / workers;
    let convs =
        (per_worker.saturating_sub(SYSTEM_BLOCKS) / CONVERSATION_BLOCKS).clamp(1, CONVERSATIONS);
    let system = chain(1, 1, SYSTEM_BLOCKS);
    let tail = *system.last().expect("system prompt");
    let mut fill = Vec::with_capacity(workers * (1 + convs));
    for w in 0..workers as u64 {
        fill.push(Store {
            worker: w,
            parent: None,
            blocks: system.clone(),
        });
        for c in 0..convs as u64 {
            fill.push(Store {
                worker: w,
                parent: Some(tail),
                blocks: chain(tail, (w << 20) | c, CONVERSATION_BLOCKS),
            });
        }
    }
    let mut rng = SplitMix64(42);
    let queries = (0..args.queries)
        .map(|_| {
            let w = rng.below(workers as u64) as usize;
            let c = rng.below(convs as u64) as usize;
            let conv = &fill[w * (1 + convs) + 1 + c].blocks;
            let mut q = system.clone();
            q.extend_from_slice(conv);
            let fresh = chain(
                *conv.last().expect("conversation"),
                rng.next_u64(),
                PROMPT_BLOCKS - q.len(),
            );
            q.extend(fresh);
            q
        })
        .collect();
    Workload {
        fill,
        queries,
        note: format!(
            "{SYSTEM_BLOCKS}-block system prompt + {convs} conversations of {CONVERSATION_BLOCKS} blocks per worker"
        ),
        ..Default::default()
    }
}

#[derive(Deserialize)]
struct TraceLine {
    hash_ids: Vec<u64>,
}

fn mooncake(workers: usize, args: &IndexArgs) -> anyhow::Result<Workload> {
    let text = std::fs::read_to_string(&args.trace)
        .with_context(|| format!("reading {}", args.trace.display()))?;
    let trace: Vec<Vec<u64>> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<TraceLine>(l).map(|t| t.hash_ids))
        .collect::<Result<_, _>>()
        .context("parsing the trace")?;
    let blocks: usize = trace.iter().map(Vec::len).sum();
    let copies = (workers / 64).clamp(1, (args.max_entries / blocks).max(1));
    let mut first_holder: HashMap<u64, u64> = HashMap::new();
    let mut next = 0u64;
    let mut fill = Vec::with_capacity(copies * trace.len());
    for copy in 0..copies as u64 {
        for ids in &trace {
            let mut h = mix(copy + 1);
            let hashes: Vec<u64> = ids
                .iter()
                .map(|id| {
                    h = mix(h.rotate_left(23) ^ mix(*id));
                    h
                })
                .collect();
            let worker = match hashes.iter().rev().find_map(|h| first_holder.get(h)) {
                Some(w) => *w,
                None => {
                    next = (next + 1) % workers as u64;
                    next
                }
            };
            for h in &hashes {
                first_holder.entry(*h).or_insert(worker);
            }
            fill.push(Store {
                worker,
                parent: None,
                blocks: hashes,
            });
        }
    }
    let step = (fill.len() / args.queries.max(1)).max(1);
    let queries = fill
        .iter()
        .step_by(step)
        .take(args.queries)
        .map(|s| s.blocks.clone())
        .collect();
    Ok(Workload {
        fill,
        queries,
        note: format!("trace replayed {copies}× ({blocks} prompt blocks each)"),
        ..Default::default()
    })
}

fn churn(workers: usize, args: &IndexArgs) -> Workload {
    let chains = (CHURN_TABLE / (workers * CHURN_BLOCKS)).clamp(4, 256);
    let prefix = chain(7, 7, CHURN_BLOCKS);
    let tail = *prefix.last().expect("prefix");
    let mut fill = Vec::new();
    let mut live: Vec<VecDeque<Vec<u64>>> = vec![VecDeque::new(); workers];
    let mut salt = 0u64;
    for w in 0..workers as u64 {
        fill.push(Store {
            worker: w,
            parent: None,
            blocks: prefix.clone(),
        });
        for _ in 0..chains {
            salt += 1;
            let c = chain(tail, salt, CHURN_BLOCKS);
            live[w as usize].push_back(c.clone());
            fill.push(Store {
                worker: w,
                parent: Some(tail),
                blocks: c,
            });
        }
    }
    let mut rng = SplitMix64(99);
    let prompt = |c: &[u64], rng: &mut SplitMix64| {
        let mut q = prefix.clone();
        q.extend_from_slice(c);
        q.extend(chain(*c.last().expect("chain"), rng.next_u64(), 64));
        q
    };
    let churn_queries = (0..args.queries)
        .map(|_| {
            let s = &fill[rng.below(fill.len() as u64) as usize];
            prompt(&s.blocks, &mut rng)
        })
        .collect();
    let steps = args.churn_blocks / (2 * CHURN_BLOCKS);
    let mut swaps = Vec::with_capacity(steps);
    for i in 0..steps {
        let w = i % workers;
        salt += 1;
        let c = chain(tail, salt, CHURN_BLOCKS);
        let removed = live[w].pop_front().expect("live chain");
        live[w].push_back(c.clone());
        swaps.push(Swap {
            worker: w as u64,
            removed,
            stored: Store {
                worker: w as u64,
                parent: Some(tail),
                blocks: c,
            },
        });
    }
    let final_queries = (0..args.queries)
        .map(|_| {
            let w = rng.below(workers as u64) as usize;
            let c = &live[w][rng.below(live[w].len() as u64) as usize];
            prompt(c, &mut rng)
        })
        .collect();
    Workload {
        fill,
        churn: swaps,
        churn_queries,
        final_queries,
        note: format!("{CHURN_BLOCKS}-block prefix + {chains} chains of {CHURN_BLOCKS} per worker; {steps} swaps"),
        ..Default::default()
    }
}

/// Nonzero overlaps of one query: (worker, rank, blocks).
type Overlaps = Vec<(u64, u32, u32)>;

/// An index under test, driven the way its owner drives it.
trait Subject {
    fn store(&self, s: &Store);
    fn remove(&self, worker: u64, blocks: &[u64]);
    /// Waits until everything stored or removed so far is visible.
    fn settle(&self);
    /// Nonzero overlaps of `query` over every worker.
    fn overlaps(&self, query: &[u64]) -> Overlaps;
    /// Time of the index's own lookup call for `query` (its native answer type;
    /// the input converted beforehand into a fresh vector, so that every index
    /// reads a prompt just written, as a router's freshly hashed one is).
    fn time_lookup(&self, query: &[u64]) -> Duration;
    /// (block, worker) entries, where the index counts them.
    fn entries(&self) -> usize {
        0
    }
    /// The subject if lookups may run from another thread.
    fn concurrent(&self) -> Option<&(dyn Subject + Sync)>;
}

struct Kvpick {
    index: PrefixIndex,
    /// Read every one of these workers' overlap in each timed lookup.
    read: Vec<WorkerKey>,
}

fn key(worker: u64) -> WorkerKey {
    WorkerKey {
        instance_id: worker,
        dp_rank: 0,
    }
}

impl Kvpick {
    fn new(workers: usize, read_all: bool) -> Self {
        let index = PrefixIndex::new(IndexConfig::default());
        for w in 0..workers as u64 {
            index.set_precise(key(w), true);
        }
        let read = if read_all {
            (0..workers as u64).map(key).collect()
        } else {
            Vec::new()
        };
        Kvpick { index, read }
    }
}

impl Subject for Kvpick {
    fn store(&self, s: &Store) {
        let pairs: Vec<(u64, u64)> = s.blocks.iter().map(|h| (*h, *h)).collect();
        self.index
            .store_engine_chain(key(s.worker), s.parent, &pairs, Instant::now());
    }
    fn remove(&self, worker: u64, blocks: &[u64]) {
        self.index.remove_engine_blocks(key(worker), blocks);
    }
    fn settle(&self) {}
    fn overlaps(&self, query: &[u64]) -> Overlaps {
        self.index
            .overlaps(query, Instant::now())
            .iter()
            .map(|(w, n)| (w.instance_id, w.dp_rank, n as u32))
            .collect()
    }
    fn time_lookup(&self, query: &[u64]) -> Duration {
        // A fresh copy, as Dynamo's input is converted into a fresh vector before
        // its clock starts: both indexes read input the caller just wrote.
        let query = query.to_vec();
        let t = Instant::now();
        let answer = self.index.overlaps(std::hint::black_box(&query), t);
        let read: usize = self.read.iter().map(|k| answer.get(*k)).sum();
        std::hint::black_box((answer, read));
        t.elapsed()
    }
    fn entries(&self) -> usize {
        self.index.len()
    }
    fn concurrent(&self) -> Option<&(dyn Subject + Sync)> {
        Some(self)
    }
}

/// Dynamo's event for a stored chain (a block's u64 is its local and external hash).
pub(crate) fn stored_event(s: &Store, id: u64) -> RouterEvent {
    RouterEvent::new(
        s.worker,
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: s.parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: s
                    .blocks
                    .iter()
                    .map(|h| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(*h),
                        tokens_hash: LocalBlockHash(*h),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        },
    )
}

/// Dynamo's event for removed blocks.
pub(crate) fn removed_event(worker: u64, blocks: &[u64], id: u64) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: blocks
                    .iter()
                    .map(|h| ExternalSequenceBlockHash(*h))
                    .collect(),
            }),
        },
    )
}

fn scores(s: OverlapScores) -> Overlaps {
    s.scores
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(w, n)| (w.worker_id, w.dp_rank, n))
        .collect()
}

fn local(query: &[u64]) -> Vec<LocalBlockHash> {
    query.iter().map(|h| LocalBlockHash(*h)).collect()
}

struct Crtc {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    runtime: tokio::runtime::Runtime,
    ids: std::sync::atomic::AtomicU64,
}

impl Crtc {
    fn new() -> Self {
        Crtc {
            pool: ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), EVENT_THREADS, 16),
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("tokio runtime"),
            ids: Default::default(),
        }
    }
    fn id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }
}

impl Subject for Crtc {
    fn store(&self, s: &Store) {
        self.pool
            .enqueue_event(stored_event(s, self.id()))
            .expect("dynamo indexer online");
    }
    fn remove(&self, worker: u64, blocks: &[u64]) {
        self.pool
            .enqueue_event(removed_event(worker, blocks, self.id()))
            .expect("dynamo indexer online");
    }
    fn settle(&self) {
        self.runtime.block_on(self.pool.flush());
    }
    fn overlaps(&self, query: &[u64]) -> Overlaps {
        scores(self.pool.backend().find_matches(&local(query), false))
    }
    fn time_lookup(&self, query: &[u64]) -> Duration {
        let q = local(query);
        let t = Instant::now();
        std::hint::black_box(
            self.pool
                .backend()
                .find_matches(std::hint::black_box(&q), false),
        );
        t.elapsed()
    }
    fn concurrent(&self) -> Option<&(dyn Subject + Sync)> {
        Some(self)
    }
}

/// Dynamo's single-threaded tree (not `Send`: lookups stay on the owning thread).
struct Radix(std::cell::RefCell<RadixTree>);

impl Subject for Radix {
    fn store(&self, s: &Store) {
        let mut tree = self.0.borrow_mut();
        tree.apply_event(stored_event(s, 0)).expect("radix store");
    }
    fn remove(&self, worker: u64, blocks: &[u64]) {
        let mut tree = self.0.borrow_mut();
        tree.apply_event(removed_event(worker, blocks, 0))
            .expect("radix remove");
    }
    fn settle(&self) {}
    fn overlaps(&self, query: &[u64]) -> Overlaps {
        scores(self.0.borrow().find_matches(local(query), false))
    }
    fn time_lookup(&self, query: &[u64]) -> Duration {
        let q = local(query);
        let tree = self.0.borrow();
        let t = Instant::now();
        std::hint::black_box(tree.find_matches(std::hint::black_box(q), false));
        t.elapsed()
    }
    fn concurrent(&self) -> Option<&(dyn Subject + Sync)> {
        None
    }
}

/// What one cell measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct CellReport {
    index: String,
    workload: String,
    workers: usize,
    note: String,
    entries: usize,
    fill_blocks: usize,
    ingest_blocks_per_s: f64,
    /// Blocks ingested per second of CPU time of the threads that ingested.
    ingest_blocks_per_cpu_s: f64,
    rss_growth_bytes: u64,
    lookup_p50_us: f64,
    lookup_p99_us: f64,
    churn_blocks_per_s: f64,
    /// Churned blocks per second of CPU time of every thread but the lookup thread.
    churn_blocks_per_cpu_s: f64,
    churn_lookups: usize,
    churn_lookup_p50_us: f64,
    churn_lookup_p99_us: f64,
    /// What the slowest churn lookups overlapped (`--churn-trace`).
    trace: String,
    /// One digest of the nonzero overlaps per checked query.
    digests: Vec<u64>,
}

fn digest(mut o: Overlaps) -> u64 {
    o.sort_unstable();
    o.iter().fold(o.len() as u64, |acc, (w, r, n)| {
        mix(acc ^ mix(*w ^ (u64::from(*r) << 48) ^ (u64::from(*n) << 20)))
    })
}

/// Digests each query's overlaps, then times the index's own lookup call on
/// each, right after an untimed pass of the same calls. That pass puts every
/// index in the same state for the timed one: the digest pass takes each index
/// a different time (kvpick's reads every worker's overlap: about 5 ms for 1,000
/// queries at 1,024 workers, against Dynamo's 1.7 ms), and a query's blocks left
/// that long ago are colder when it is timed.
fn timed_lookups(subject: &dyn Subject, queries: &[Vec<u64>]) -> (Vec<Duration>, Vec<u64>) {
    let digests = queries
        .iter()
        .map(|q| digest(subject.overlaps(q)))
        .collect();
    for q in queries {
        std::hint::black_box(subject.time_lookup(q));
    }
    let mut times = Vec::with_capacity(queries.len());
    for q in queries {
        times.push(subject.time_lookup(q));
    }
    (times, digests)
}

fn run_cell(
    which: Impl,
    kind: Kind,
    workers: usize,
    args: &IndexArgs,
) -> anyhow::Result<CellReport> {
    let workload = match kind {
        Kind::Shared => shared(workers, args),
        Kind::Mooncake => mooncake(workers, args)?,
        Kind::Churn => churn(workers, args),
    };
    let rss0 = rss_bytes();
    let subject: Box<dyn Subject> = match which {
        Impl::Kvpick => Box::new(Kvpick::new(workers, false)),
        Impl::KvpickReadAll => Box::new(Kvpick::new(workers, true)),
        Impl::DynamoCrtc => Box::new(Crtc::new()),
        Impl::DynamoRadix => Box::new(Radix(std::cell::RefCell::new(RadixTree::new()))),
    };
    let fill_blocks: usize = workload.fill.iter().map(|s| s.blocks.len()).sum();
    // CPU of the caller's thread (which applies kvpick's events) and an index's
    // own threads (Dynamo's event threads).
    let cpu0 = process_cpu_ns();
    let t = Instant::now();
    for s in &workload.fill {
        subject.store(s);
    }
    subject.settle();
    let fill_s = t.elapsed().as_secs_f64();
    let fill_cpu_s = process_cpu_ns().saturating_sub(cpu0) as f64 / 1e9;
    let rss_growth = rss_bytes().saturating_sub(rss0);
    let mut report = CellReport {
        index: which.name().into(),
        workload: format!("{kind:?}").to_lowercase(),
        workers,
        note: workload.note.clone(),
        entries: subject.entries(),
        fill_blocks,
        ingest_blocks_per_s: fill_blocks as f64 / fill_s,
        ingest_blocks_per_cpu_s: per_cpu_s(fill_blocks, fill_cpu_s),
        rss_growth_bytes: rss_growth,
        ..Default::default()
    };
    if kind == Kind::Churn {
        let subject = subject
            .concurrent()
            .context("churn needs an index that takes lookups from another thread")?;
        let done = AtomicBool::new(false);
        let churned: usize = workload
            .churn
            .iter()
            .map(|s| s.removed.len() + s.stored.blocks.len())
            .sum();
        let cpu0 = process_cpu_ns();
        let origin = Instant::now();
        let trace = args.churn_trace;
        // The lookup thread and the writer thread have ended when the CPU time is
        // read: the live threads' time plus the writer's own is the churn's.
        let (elapsed, (writes, writer_cpu_ns), (mut times, lookups)) =
            std::thread::scope(|scope| {
                let looker = scope.spawn(|| {
                    let every = Duration::from_micros(args.churn_lookup_every_us);
                    let start = Instant::now();
                    let mut times = Vec::new();
                    let mut spans = Vec::new();
                    let mut i = 0;
                    while !done.load(Ordering::Relaxed) {
                        let q = &workload.churn_queries[i % workload.churn_queries.len()];
                        if trace {
                            let (took, span) = traced(origin, || subject.time_lookup(q));
                            spans.push(Span { took, ..span });
                            times.push(took);
                        } else {
                            times.push(subject.time_lookup(q));
                        }
                        i += 1;
                        // Sleep until the next lookup is due (none when behind).
                        let due = start + every * i as u32;
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                    }
                    (times, spans)
                });
                let t = Instant::now();
                // One writer thread, as production's `kv-ingest` thread.
                let writer = scope.spawn(|| {
                    let cpu0 = SchedStat::now().cpu_ns;
                    let mut writes = Vec::new();
                    for s in &workload.churn {
                        if trace {
                            writes.push(traced(origin, || subject.remove(s.worker, &s.removed)).1);
                            writes.push(traced(origin, || subject.store(&s.stored)).1);
                        } else {
                            subject.remove(s.worker, &s.removed);
                            subject.store(&s.stored);
                        }
                    }
                    (writes, SchedStat::now().cpu_ns.saturating_sub(cpu0))
                });
                let (mut writes, writer_cpu_ns) = writer.join().expect("writer thread");
                writes.sort_unstable_by_key(|w| w.from);
                subject.settle();
                let elapsed = t.elapsed();
                done.store(true, Ordering::Relaxed);
                (
                    elapsed,
                    (writes, writer_cpu_ns),
                    looker.join().expect("lookup thread"),
                )
            });
        if trace {
            report.trace = trace_summary(&writes, &lookups);
        }
        let churn_cpu_ns = process_cpu_ns().saturating_sub(cpu0) + writer_cpu_ns;
        report.churn_blocks_per_s = churned as f64 / elapsed.as_secs_f64();
        report.churn_blocks_per_cpu_s = per_cpu_s(churned, churn_cpu_ns as f64 / 1e9);
        report.churn_lookups = times.len();
        report.churn_lookup_p50_us = quantile_us(&mut times, 0.5);
        report.churn_lookup_p99_us = quantile_us(&mut times, 0.99);
        let (mut quiet, digests) = timed_lookups(subject, &workload.final_queries);
        report.lookup_p50_us = quantile_us(&mut quiet, 0.5);
        report.lookup_p99_us = quantile_us(&mut quiet, 0.99);
        report.digests = digests;
    } else {
        let (mut times, digests) = timed_lookups(subject.as_ref(), &workload.queries);
        report.lookup_p50_us = quantile_us(&mut times, 0.5);
        report.lookup_p99_us = quantile_us(&mut times, 0.99);
        report.digests = digests;
    }
    Ok(report)
}

/// One traced call: when it ran (since the churn started), how long it took,
/// and what the scheduler did to its thread meanwhile.
#[derive(Debug, Clone, Copy)]
struct Span {
    from: Duration,
    to: Duration,
    took: Duration,
    sched: SchedStat,
}

fn traced<T>(origin: Instant, f: impl FnOnce() -> T) -> (T, Span) {
    let s0 = SchedStat::now();
    let from = origin.elapsed();
    let out = f();
    let to = origin.elapsed();
    let sched = SchedStat::now().since(s0);
    (
        out,
        Span {
            from,
            to,
            took: to - from,
            sched,
        },
    )
}

/// A run-queue wait this long means the thread was descheduled for real.
const PREEMPTED: Duration = Duration::from_micros(20);
/// A write call this long without run-queue wait is a long write section.
const LONG_WRITE: Duration = Duration::from_micros(50);

/// Write-call latencies, and for the slowest 1 % of lookups what was going on
/// (not exclusive): the lookup thread itself waiting for a core (preempted, or
/// woken from a sleep on a lock and not run at once), a write call in flight
/// whose thread waited for a core (descheduled writer), a long write call that
/// did not (long write section); or none of these.
fn trace_summary(writes: &[Span], lookups: &[Span]) -> String {
    let waited = |s: &Span| Duration::from_nanos(s.sched.run_delay_ns) >= PREEMPTED;
    let mut walls: Vec<Duration> = writes.iter().map(|w| w.took).collect();
    let descheduled = writes.iter().filter(|w| waited(w)).count();
    let long = writes
        .iter()
        .filter(|w| w.took >= LONG_WRITE && !waited(w))
        .count();
    let mut took: Vec<Duration> = lookups.iter().map(|l| l.took).collect();
    let p99 = Duration::from_secs_f64(quantile_us(&mut took, 0.99) / 1e6);
    let (mut own, mut writer_out, mut writer_long, mut quiet) = (0, 0, 0, 0);
    let mut slow = 0;
    for l in lookups.iter().filter(|l| l.took >= p99) {
        slow += 1;
        // Writes are in time order: those in flight during the lookup.
        let first = writes.partition_point(|w| w.to <= l.from);
        let during: Vec<&Span> = writes[first..]
            .iter()
            .take_while(|w| w.from < l.to)
            .collect();
        let out = during.iter().any(|w| waited(w));
        let long = during.iter().any(|w| w.took >= LONG_WRITE);
        own += usize::from(waited(l));
        writer_out += usize::from(out);
        writer_long += usize::from(long);
        quiet += usize::from(!(waited(l) || out || long));
    }
    format!(
        "{} write calls, µs p50 {:.1} / p99 {:.1} / max {:.0}; {descheduled} waited ≥ {} µs for a core, {long} ran ≥ {} µs without waiting. Lookups ≥ p99 ({:.1} µs): {slow}, of which (not exclusive) the lookup thread waited for a core {own}, a write in flight whose thread waited for a core {writer_out}, a long write in flight {writer_long}; none of these {quiet}.",
        writes.len(),
        quantile_us(&mut walls, 0.5),
        quantile_us(&mut walls, 0.99),
        quantile_us(&mut walls, 1.0),
        PREEMPTED.as_micros(),
        LONG_WRITE.as_micros(),
        p99.as_secs_f64() * 1e6,
    )
}

/// Runs one cell in a child process (fresh heap: RSS growth is the index's alone).
fn spawn_cell(
    which: Impl,
    kind: Kind,
    workers: usize,
    args: &IndexArgs,
) -> anyhow::Result<CellReport> {
    let exe = std::env::current_exe()?;
    let list = |v: &[usize]| {
        v.iter()
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let out = Command::new(exe)
        .arg("index")
        .arg("--cell")
        .arg(format!(
            "{}/{}/{workers}",
            which.name(),
            format!("{kind:?}").to_lowercase()
        ))
        .args(["--max-entries", &args.max_entries.to_string()])
        .args(["--queries", &args.queries.to_string()])
        .args(["--churn-blocks", &args.churn_blocks.to_string()])
        .args([
            "--churn-lookup-every-us",
            &args.churn_lookup_every_us.to_string(),
        ])
        .args(["--workers", &list(&args.workers)])
        .args(args.churn_trace.then_some("--churn-trace"))
        .arg("--trace")
        .arg(&args.trace)
        .output()
        .context("running a cell")?;
    if !out.status.success() {
        bail!(
            "cell {} {kind:?} {workers} failed: {}",
            which.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout)?;
    let line = text.lines().last().context("cell printed nothing")?;
    Ok(serde_json::from_str(line)?)
}

fn parse_cell(cell: &str) -> anyhow::Result<(Impl, Kind, usize)> {
    use clap::ValueEnum;
    let parts: Vec<&str> = cell.split('/').collect();
    let [i, k, w] = parts[..] else {
        bail!("cell is index/workload/workers");
    };
    Ok((
        Impl::from_str(i, true).map_err(anyhow::Error::msg)?,
        Kind::from_str(k, true).map_err(anyhow::Error::msg)?,
        w.parse()?,
    ))
}

/// CPU time shorter than this is not measured well: the kernel adds a running
/// thread's time to its `schedstat` at scheduler ticks (4 ms here).
const MIN_CPU_S: f64 = 0.1;

/// Blocks per CPU-second, 0 (shown as –) when `cpu_s` is too short to measure.
fn per_cpu_s(blocks: usize, cpu_s: f64) -> f64 {
    if cpu_s >= MIN_CPU_S {
        blocks as f64 / cpu_s
    } else {
        0.0
    }
}

/// Millions, or – for 0 (not measured).
fn mega(x: f64) -> String {
    if x > 0.0 {
        format!("{:.2} M", x / 1e6)
    } else {
        "–".into()
    }
}

fn ratio(x: f64, anchor: f64) -> String {
    if anchor > 0.0 && x > 0.0 {
        format!("{:.2}×", x / anchor)
    } else {
        "–".into()
    }
}

/// Runs every cell, checks overlaps against Dynamo and prints the tables.
pub fn run(args: IndexArgs) -> anyhow::Result<()> {
    if let Some(cell) = &args.cell {
        let (which, kind, workers) = parse_cell(cell)?;
        let report = run_cell(which, kind, workers, &args)?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let mut md = String::new();
    md.push_str("Ratios are to Dynamo's `ConcurrentRadixTreeCompressed` (ThreadPoolIndexer, 2 threads) in the same run; below 1× is better for latency and bytes, above 1× for ingest. Ingest per CPU-second divides by the CPU time of the threads that ingested (Dynamo: its 2 event threads and the enqueuing thread; `kvpick`: its one ingest thread, as production's `kv-ingest` thread), which does not depend on how many cores each side got on a shared machine.\n");
    let mut mismatches = 0usize;
    for kind in &args.workloads {
        let mut notes = Vec::new();
        md.push_str(&format!("\n### {kind:?}\n\n"));
        if *kind == Kind::Churn {
            md.push_str("| workers | index | entries | churn blocks/s | ratio | blocks per CPU-s | ratio | lookups during churn | lookup p50 / p99 during churn (µs) | ratio p50 / p99 | quiet p50 / p99 (µs) | overlaps = Dynamo |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        } else {
            md.push_str("| workers | index | entries | lookup p50 / p99 (µs) | ingest blocks/s | bytes per entry (RSS) | ratio p50 / p99 | ratio ingest | ingest blocks per CPU-s | ratio | ratio bytes | overlaps = Dynamo |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        }
        for &workers in &args.workers {
            let mut cells: Vec<CellReport> = Vec::new();
            for &which in &args.indexes {
                if which == Impl::DynamoRadix
                    && (workers >= args.radix_below || *kind == Kind::Churn)
                {
                    continue;
                }
                eprintln!("cell {} {kind:?} {workers}", which.name());
                cells.push(spawn_cell(which, *kind, workers, &args)?);
            }
            let entries = cells.iter().map(|c| c.entries).max().unwrap_or(0).max(1);
            let anchor = cells
                .iter()
                .find(|c| c.index == Impl::DynamoCrtc.name())
                .cloned();
            let oracle = anchor.as_ref().map(|a| a.digests.clone());
            for c in &cells {
                let same = match &oracle {
                    Some(o) => {
                        let bad = o.iter().zip(&c.digests).filter(|(a, b)| a != b).count()
                            + o.len().abs_diff(c.digests.len());
                        mismatches += bad;
                        if bad == 0 {
                            format!("{}/{}", c.digests.len(), c.digests.len())
                        } else {
                            format!("**{bad} differ**")
                        }
                    }
                    None => "no oracle".into(),
                };
                let a = anchor.clone().unwrap_or_default();
                let bytes = c.rss_growth_bytes as f64 / entries as f64;
                let a_bytes = a.rss_growth_bytes as f64 / entries as f64;
                if *kind == Kind::Churn {
                    md.push_str(&format!(
                        "| {workers} | {} | {entries} | {:.2} M | {} | {} | {} | {} | {:.1} / {:.1} | {} / {} | {:.1} / {:.1} | {same} |\n",
                        c.index,
                        c.churn_blocks_per_s / 1e6,
                        ratio(c.churn_blocks_per_s, a.churn_blocks_per_s),
                        mega(c.churn_blocks_per_cpu_s),
                        ratio(c.churn_blocks_per_cpu_s, a.churn_blocks_per_cpu_s),
                        c.churn_lookups,
                        c.churn_lookup_p50_us,
                        c.churn_lookup_p99_us,
                        ratio(c.churn_lookup_p50_us, a.churn_lookup_p50_us),
                        ratio(c.churn_lookup_p99_us, a.churn_lookup_p99_us),
                        c.lookup_p50_us,
                        c.lookup_p99_us,
                    ));
                } else {
                    md.push_str(&format!(
                        "| {workers} | {} | {entries} | {:.1} / {:.1} | {:.2} M | {bytes:.0} | {} / {} | {} | {} | {} | {} | {same} |\n",
                        c.index,
                        c.lookup_p50_us,
                        c.lookup_p99_us,
                        c.ingest_blocks_per_s / 1e6,
                        ratio(c.lookup_p50_us, a.lookup_p50_us),
                        ratio(c.lookup_p99_us, a.lookup_p99_us),
                        ratio(c.ingest_blocks_per_s, a.ingest_blocks_per_s),
                        mega(c.ingest_blocks_per_cpu_s),
                        ratio(c.ingest_blocks_per_cpu_s, a.ingest_blocks_per_cpu_s),
                        ratio(bytes, a_bytes),
                    ));
                }
            }
            if let Some(c) = cells.first() {
                notes.push(format!("{workers} workers: {}.", c.note));
            }
            for c in cells.iter().filter(|c| !c.trace.is_empty()) {
                notes.push(format!("Trace {} {workers}: {}", c.index, c.trace));
            }
        }
        md.push('\n');
        md.push_str(&notes.join(" "));
        md.push('\n');
    }
    println!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md)?;
    }
    if mismatches > 0 {
        bail!("{mismatches} queries where an index's overlaps differ from Dynamo's");
    }
    Ok(())
}
