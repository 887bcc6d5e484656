//! Criterion benchmarks of the scheduling core.
//!
//! - `decision/*`: one routing decision (session check, hashing, index lookup,
//!   scoring, index insert) for a 32k-token prompt (128 KiB of text, 2,048 blocks)
//!   over 64 and 1,024 workers, next to the plain fewest-in-flight picker over the
//!   same snapshot;
//! - `decision_per_endpoint/*`: the same decision for a 1 KiB prompt, with the
//!   pool size as the throughput: criterion's elements per second are endpoints
//!   per second, its time per element the cost per endpoint; next to the
//!   fewest-in-flight picker. In `prefix_1k_bytes` every worker holds the prompt
//!   and the pool is idle (the pick may stop at the first idle holder); in
//!   `prefix_1k_bytes_busy` every worker holds it and carries load, so every
//!   holder is scored; in `one_holder_1k_bytes_busy` every worker carries load
//!   and none held the prompt before the first pick, which records it on one;
//! - `hash/*` and `lookup/*`: the two prefix stages alone;
//! - `index_insert`: approximate-mode insert throughput (blocks per second), of
//!   prompts a worker holds already and of half-new prompts that make it evict;
//! - memory per indexed block: printed before the benchmarks run, measured with a
//!   counting allocator and compared with `PrefixIndex::memory_bytes`.
//!
//! Run: `cargo bench --bench scheduler -- --quick` (or `--measurement-time 2`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use kvpick::endpoints::{ActiveLoad, Endpoint, EndpointState, EndpointTable, Snapshot, WorkerKey};
use kvpick::kv::hash::{model_seed, request_block_hashes};
use kvpick::kv::index::{IndexConfig, PrefixIndex};
use kvpick::request::{parse, InferenceRequest};
use kvpick::scheduler::{PickRequest, Scheduler, SchedulerConfig};

/// Counts live heap bytes, to measure the index's real footprint.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// 32k tokens at ~4 bytes a token.
const PROMPT_BYTES: usize = 32 * 1024 * 4;

fn pool(workers: usize) -> EndpointTable {
    let t = EndpointTable::new();
    t.replace(
        (0..workers)
            .map(|i| {
                Endpoint::new(
                    format!("10.{}.{}.1:8000", i / 256, i % 256)
                        .parse()
                        .unwrap(),
                )
            })
            .collect(),
    );
    t
}

/// Deterministic pseudo-random text (so blocks differ).
fn text(seed: u64, len: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

fn request(prompt: &str) -> InferenceRequest {
    parse(
        serde_json::json!({"model": "bench-model", "prompt": prompt})
            .to_string()
            .as_bytes(),
        None,
    )
    .unwrap()
}

/// A scheduler whose index looks like a busy pool: every worker holds a shared
/// 1k-token system prompt and a 4k-token history of its own; worker 0 also holds
/// the 32k-token conversation the benchmark request extends.
fn warmed(workers: usize, snap: &Snapshot, conversation: &InferenceRequest) -> Scheduler {
    let s = Scheduler::new(SchedulerConfig::default());
    let system = text(1, 4 * 1024);
    let now = Instant::now();
    for (i, e) in snap.endpoints.iter().enumerate() {
        let own = request(&format!("{system}{}", text(100 + i as u64, 16 * 1024)));
        s.index().insert(e.key(0), &s.block_hashes(&own), now);
    }
    s.index()
        .insert(snap.endpoints[0].key(0), &s.block_hashes(conversation), now);
    assert!(s.index().len() >= workers * 256);
    s
}

/// The plain picker kvpick started with: fewest in flight, random tie-break.
fn fewest_in_flight(snap: &Snapshot) -> Option<(Arc<EndpointState>, u32)> {
    let mut rng_state = 0x2545_F491_4F6C_DD1Du64;
    let mut best: Option<(u32, &Arc<EndpointState>, u32)> = None;
    let mut ties = 0u64;
    for e in &snap.endpoints {
        for rank in 0..e.ranks() {
            let load = e.in_flight(rank);
            match best {
                Some((b, _, _)) if load > b => continue,
                Some((b, _, _)) if load == b => {
                    ties += 1;
                    rng_state ^= rng_state << 13;
                    rng_state ^= rng_state >> 7;
                    if rng_state % (ties + 1) != 0 {
                        continue;
                    }
                }
                _ => ties = 0,
            }
            best = Some((load, e, rank));
        }
    }
    best.map(|(_, e, r)| (Arc::clone(e), r))
}

/// How the pool looks to one benchmarked decision.
#[derive(Clone, Copy, PartialEq)]
enum Load {
    /// No load; some worker holds the prompt.
    Idle,
    /// Every worker carries load (1–7 blocks); some worker holds the prompt.
    Busy,
    /// Every worker carries load; no worker holds the prompt before the
    /// first pick.
    BusyUnheld,
}

/// One decision for `prompt` over `workers` warmed with `conversation` (worker 0
/// holds it) and loaded as `load` says, booked and finished per iteration; next
/// to the fewest-in-flight picker over the same snapshot for an idle pool.
fn bench_pick(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    workers: usize,
    conversation: &InferenceRequest,
    prompt: &InferenceRequest,
    load: Load,
) {
    let table = pool(workers);
    let snap = table.snapshot();
    let s = warmed(workers, &snap, conversation);
    if load != Load::Idle {
        for (i, e) in snap.endpoints.iter().enumerate() {
            let blocks = 1 + i as u64 % 7;
            e.book(
                0,
                ActiveLoad {
                    blocks,
                    uncached: 0,
                },
            );
        }
    }
    let req = PickRequest {
        body: Some(prompt),
        ..Default::default()
    };
    let d = s.pick(&req, &snap).unwrap();
    if std::ptr::eq(prompt, conversation) {
        assert_eq!(d.decode.key(), snap.endpoints[0].key(0), "prefix wins");
    }
    match load {
        Load::BusyUnheld => assert_eq!(d.overlap_blocks, 0, "no worker holds it"),
        _ => assert_eq!(
            d.overlap_blocks, d.prompt_blocks,
            "the chosen worker holds it"
        ),
    }
    s.finish(&d, Some(200));
    g.bench_with_input(BenchmarkId::new(name, workers), &workers, |b, _| {
        b.iter(|| {
            let d = s.pick(black_box(&req), &snap).unwrap();
            s.finish(&d, Some(200));
            d.overlap_blocks
        })
    });
    if load == Load::Idle {
        g.bench_with_input(
            BenchmarkId::new("baseline_fewest_in_flight", workers),
            &workers,
            |b, _| b.iter(|| fewest_in_flight(black_box(&snap)).map(|(_, r)| r)),
        );
    }
}

fn bench_decision(c: &mut Criterion) {
    let system = text(1, 4 * 1024);
    let conversation = request(&format!("{system}{}", text(7, PROMPT_BYTES - system.len())));
    let short = request(&system[..1024]);
    let unheld = request(&text(9, 1024));
    let mut g = c.benchmark_group("decision");
    for workers in [64usize, 1024] {
        bench_pick(
            &mut g,
            "prefix_32k_tokens",
            workers,
            &conversation,
            &conversation,
            Load::Idle,
        );
    }
    g.finish();
    let mut g = c.benchmark_group("decision_per_endpoint");
    for workers in [64usize, 1024] {
        g.throughput(Throughput::Elements(workers as u64));
        for (name, prompt, load) in [
            ("prefix_1k_bytes", &short, Load::Idle),
            ("prefix_1k_bytes_busy", &short, Load::Busy),
            ("one_holder_1k_bytes_busy", &unheld, Load::BusyUnheld),
        ] {
            bench_pick(&mut g, name, workers, &conversation, prompt, load);
        }
    }
    g.finish();

    let seed = model_seed("bench-model", None);
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(PROMPT_BYTES as u64));
    g.bench_function("32k_tokens", |b| {
        b.iter(|| request_block_hashes(seed, black_box(&conversation.segments), 64, 16).len())
    });
    g.finish();

    let mut g = c.benchmark_group("lookup");
    for workers in [64usize, 1024] {
        let table = pool(workers);
        let snap = table.snapshot();
        let s = warmed(workers, &snap, &conversation);
        let hashes = s.block_hashes(&conversation);
        let keys: Vec<WorkerKey> = snap.endpoints.iter().map(|e| e.key(0)).collect();
        let now = Instant::now();
        g.bench_with_input(BenchmarkId::new("32k_tokens", workers), &workers, |b, _| {
            b.iter(|| s.index().lookup(black_box(&hashes), &keys, now)[0])
        });
    }
    g.finish();
}

fn bench_insert(c: &mut Criterion) {
    let idx = PrefixIndex::new(IndexConfig {
        default_capacity: 65_536,
        ttl: None,
        ..IndexConfig::default()
    });
    let chains: Vec<Vec<u64>> = (0..64u64)
        .map(|w| {
            (0..2048u64)
                .map(|i| (w << 32 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect()
        })
        .collect();
    let now = Instant::now();
    let mut g = c.benchmark_group("index_insert");
    g.throughput(Throughput::Elements(2048));
    let mut n = 0u64;
    g.bench_function("2048_blocks", |b| {
        b.iter(|| {
            n += 1;
            let w = WorkerKey {
                instance_id: n % 64,
                dp_rank: 0,
            };
            idx.insert(w, black_box(&chains[(n as usize * 7) % 64]), now);
        })
    });
    // Churn, as the overhead bench's large chat bodies make it: each prompt is
    // a worker's own 1,024 held blocks then 1,024 blocks it never saw, and the
    // LRU bound (8,192 blocks) evicts as many old ones.
    let churn = PrefixIndex::new(IndexConfig {
        default_capacity: 8_192,
        ttl: None,
        ..IndexConfig::default()
    });
    let mut prompt: Vec<u64> = Vec::with_capacity(2048);
    let mut n = 0u64;
    g.bench_function("2048_blocks_half_new", |b| {
        b.iter(|| {
            n += 1;
            let w = n % 64;
            prompt.clear();
            prompt.extend((0..2048u64).map(|i| {
                let fresh = if i < 1024 { 0 } else { n };
                (w << 48 | fresh << 12 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            }));
            let key = WorkerKey {
                instance_id: w,
                dp_rank: 0,
            };
            churn.insert(key, black_box(&prompt), now);
        })
    });
    g.finish();
}

/// Prints the heap bytes per indexed (block, worker) entry.
fn report_memory() {
    let before = LIVE.load(Ordering::Relaxed);
    let idx = PrefixIndex::new(IndexConfig {
        default_capacity: 1 << 20,
        ttl: None,
        ..IndexConfig::default()
    });
    let now = Instant::now();
    let workers = 64u64;
    let per_worker = 16_384u64;
    for w in 0..workers {
        let hashes: Vec<u64> = (0..per_worker)
            .map(|i| (w << 32 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        idx.insert(
            WorkerKey {
                instance_id: w,
                dp_rank: 0,
            },
            &hashes,
            now,
        );
    }
    // Popular blocks: a 512-block prefix shared by every worker.
    let shared: Vec<u64> = (0..512u64)
        .map(|i| i.wrapping_mul(0xD6E8_FEB8_6659_FD93))
        .collect();
    for w in 0..workers {
        idx.insert(
            WorkerKey {
                instance_id: w,
                dp_rank: 0,
            },
            &shared,
            now,
        );
    }
    let measured = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let entries = idx.len() as f64;
    println!(
        "memory: {} entries ({} distinct-block entries + 512 blocks x {} workers), \
         measured {:.1} bytes/entry, estimate {:.1} bytes/entry",
        idx.len(),
        workers * per_worker,
        workers,
        measured / entries,
        idx.memory_bytes() as f64 / entries
    );
    drop(black_box(idx));
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = bench_decision, bench_insert
}

fn main() {
    report_memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
