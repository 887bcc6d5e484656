//! KV-event ingest: decoding alone (baseline) vs decoding plus applying to the
//! prefix index, in events per second on one core; and end-to-end staleness, from
//! a batch published on a ZMQ PUB socket over loopback to its blocks being visible
//! to index lookups.
//!
//! The workload is vLLM-shaped: map-encoded batches (current vLLM) of 16 events,
//! `BlockStored` of 4 blocks × 16 tokens with 32-byte (sha256-style) block hashes
//! chained to the previous event's last block, and one `BlockRemoved` in four
//! evicting the oldest blocks, over 8 workers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvpick::endpoints::{Engine, WorkerKey};
use kvpick::kv::hash::{model_seed, token_block_hashes};
use kvpick::kv::index::{IndexConfig, PrefixIndex};
use kvpick::kvevents::metrics::KvEventMetrics;
use kvpick::kvevents::subscriber::{KvEvents, SubscriberConfig, Target};
use kvpick::kvevents::vllm::Vllm;
use kvpick::kvevents::EventDecoder;
use kvpick::kvevents::{Ingest, KvEventSink};
use kvpick::telemetry::Metrics;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "bench-model";
const BLOCK: usize = 16;
const BLOCKS_PER_EVENT: usize = 4;
const EVENTS_PER_BATCH: usize = 16;
const WORKERS: u64 = 8;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn sha(h: u64) -> Value {
    let mut b = vec![0x11u8; 24];
    b.extend_from_slice(&h.to_be_bytes());
    Value::Binary(b)
}

fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    buf
}

fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> Value {
    let tokens: Vec<u32> = (0..(hashes.len() * BLOCK) as u32)
        .map(|t| first_token.wrapping_add(t) % 50_000)
        .collect();
    stored_with(hashes, parent, &tokens)
}

fn stored_with(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    let tokens = tokens.iter().map(|&t| Value::from(t)).collect();
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(hashes.iter().map(|&h| sha(h)).collect()),
        ),
        (s("parent_block_hash"), parent.map_or(Value::Nil, sha)),
        (s("token_ids"), Value::Array(tokens)),
        (s("block_size"), Value::from(BLOCK as u64)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            Value::Array(hashes.iter().map(|&h| sha(h)).collect()),
        ),
        (s("medium"), s("GPU")),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Map(vec![
        (s("ts"), Value::F64(1.7e9)),
        (s("events"), Value::Array(events)),
        (s("data_parallel_rank"), Value::from(0)),
    ]))
}

/// `n` batches for one worker: a chain growing by 4 blocks an event, the oldest
/// blocks evicted in every fourth event.
fn workload(n: usize, salt: u64) -> Vec<Vec<u8>> {
    let mut next = salt << 32;
    let mut parent = None;
    let mut live: VecDeque<u64> = VecDeque::new();
    (0..n)
        .map(|_| {
            let events = (0..EVENTS_PER_BATCH)
                .map(|e| {
                    if e % 4 == 3 && live.len() > 64 {
                        let gone: Vec<u64> = live.drain(..BLOCKS_PER_EVENT).collect();
                        removed(&gone)
                    } else {
                        let hashes: Vec<u64> =
                            (0..BLOCKS_PER_EVENT as u64).map(|i| next + i).collect();
                        next += BLOCKS_PER_EVENT as u64;
                        let ev = stored(&hashes, parent, next as u32);
                        parent = hashes.last().copied();
                        live.extend(&hashes);
                        ev
                    }
                })
                .collect();
            batch(events)
        })
        .collect()
}

fn index() -> Arc<PrefixIndex> {
    Arc::new(PrefixIndex::new(IndexConfig::default()))
}

fn ingest(c: &mut Criterion) {
    let batches: Vec<(WorkerKey, Vec<u8>)> = (0..WORKERS)
        .flat_map(|w| {
            workload(64, w).into_iter().map(move |b| {
                (
                    WorkerKey {
                        instance_id: w,
                        dp_rank: 0,
                    },
                    b,
                )
            })
        })
        .collect();
    let events = (batches.len() * EVENTS_PER_BATCH) as u64;
    let mut g = c.benchmark_group("kv_events");
    g.throughput(Throughput::Elements(events));
    g.bench_function("decode", |b| {
        b.iter(|| {
            for (_, p) in &batches {
                std::hint::black_box(Vllm.decode(p).unwrap());
            }
        })
    });
    g.bench_function("decode_and_index", |b| {
        b.iter_batched(
            || Ingest::new(index(), MODEL),
            |mut ing| {
                let now = Instant::now();
                for (w, p) in &batches {
                    let batch = Vllm.decode(p).unwrap();
                    ing.apply(*w, None, &batch, now);
                }
                ing
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// Published → visible: one batch of one new block per iteration, polled with a
/// lookup until it is in the index.
fn staleness(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let idx = index();
    let worker = WorkerKey {
        instance_id: 1,
        dp_rank: 0,
    };
    let (mut pub_socket, events, _sub) = rt.block_on(async {
        let mut pub_socket = PubSocket::new();
        let port = match pub_socket.bind("tcp://127.0.0.1:0").await.unwrap() {
            zeromq::Endpoint::Tcp(_, p) => p,
            other => panic!("unexpected endpoint {other}"),
        };
        let metrics = KvEventMetrics::register(&Metrics::new("bench"));
        let (events, _ingest) = KvEvents::start(
            Arc::clone(&idx) as Arc<dyn KvEventSink>,
            metrics,
            SubscriberConfig {
                model: MODEL.into(),
                ..SubscriberConfig::default()
            },
        );
        let sub = events.subscribe(Target {
            worker,
            engine: Engine::Vllm,
            host: "127.0.0.1".parse().unwrap(),
            port,
            replay_port: None,
        });
        (pub_socket, events, sub)
    });
    let seed = model_seed(MODEL, None);
    let mut seq = 0u64;
    let mut publish_and_wait = |seq: u64, wait: Duration| {
        // Every iteration stores a block never seen before (no token id repeats).
        let tokens: Vec<u32> = (0..BLOCK as u64)
            .map(|t| (seq * BLOCK as u64 + t) as u32)
            .collect();
        let payload = batch(vec![stored_with(&[seq + 1], None, &tokens)]);
        let want = token_block_hashes(seed, None, &tokens, BLOCK);
        let msg = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .unwrap();
        let start = Instant::now();
        rt.block_on(pub_socket.send(msg)).unwrap();
        let deadline = start + wait;
        loop {
            if idx.lookup(&want, &[worker], Instant::now())[0] == 1 {
                return Some(start.elapsed());
            }
            if Instant::now() > deadline {
                return None;
            }
            std::hint::spin_loop();
        }
    };
    // Until the subscription reaches the PUB socket, batches are dropped: resend.
    while publish_and_wait(seq, Duration::from_millis(50)).is_none() {}
    c.bench_function("kv_events/published_to_visible", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                seq += 1;
                total += publish_and_wait(seq, Duration::from_secs(5))
                    .expect("batch never became visible");
            }
            total
        })
    });
    drop(events);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).sample_size(20);
    targets = ingest, staleness
}
criterion_main!(benches);
