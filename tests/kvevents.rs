//! KV events: decoding to the vLLM spec, ingest into an index, a ZMQ loopback with
//! gaps, restarts and replay, and tokenization with a chat template.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvpick::endpoints::{Engine, WorkerKey};
use kvpick::kv::index::{PrefixIndex, TierStore};
use kvpick::kv::tier::{self, Tier};
use kvpick::kvevents::metrics::KvEventMetrics;
use kvpick::kvevents::sglang::Sglang;
use kvpick::kvevents::subscriber::{IngestThread, KvEvents, SubscriberConfig, Target};
use kvpick::kvevents::vllm::Vllm;
use kvpick::kvevents::{BlockRemoved, BlockStored, EventDecoder, KvEvent, StorageTier};
use kvpick::kvevents::{Ingest, KvEventSink};
use kvpick::request::{
    parse_with, ApiKind, InferenceRequest, ParseOptions, Segment, TemplateInput,
};
use kvpick::telemetry::Metrics;
use kvpick::tokenize::{token_ids, Tokenizer, TokenizerPool};
use parking_lot::Mutex;
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

#[allow(dead_code)] // each test binary uses a part of it
mod support;

// ---------------------------------------------------------------------------
// An in-memory sink: the prefix index as far as events are concerned.

#[derive(Default)]
struct MemState {
    /// worker → engine hash → kvpick hash.
    blocks: HashMap<WorkerKey, HashMap<u64, u64>>,
    precise: HashMap<WorkerKey, bool>,
    clears: HashMap<WorkerKey, usize>,
    /// (worker, lower tier) → engine hash → (kvpick hash, span).
    tiers: HashMap<(WorkerKey, Tier), HashMap<u64, (u64, usize)>>,
}

#[derive(Default)]
struct MemorySink(Mutex<MemState>);

impl MemorySink {
    /// How many leading `hashes` `worker` holds.
    fn depth(&self, worker: WorkerKey, hashes: &[u64]) -> usize {
        let s = self.0.lock();
        let held: HashSet<u64> = s
            .blocks
            .get(&worker)
            .map(|m| m.values().copied().collect())
            .unwrap_or_default();
        hashes.iter().take_while(|h| held.contains(h)).count()
    }
    fn precise(&self, worker: WorkerKey) -> bool {
        self.0.lock().precise.get(&worker).copied().unwrap_or(false)
    }
    fn clears(&self, worker: WorkerKey) -> usize {
        self.0.lock().clears.get(&worker).copied().unwrap_or(0)
    }
}

fn chain(seed: u64, parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut prev = parent.unwrap_or(seed);
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            let mut buf = prev.to_le_bytes().to_vec();
            for t in b {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            prev = xxhash_rust::xxh3::xxh3_64(&buf);
            prev
        })
        .collect()
}

fn seed_of(model: &str, lora: Option<&str>) -> u64 {
    xxhash_rust::xxh3::xxh3_64(format!("{model}\0{}", lora.unwrap_or("")).as_bytes())
}

impl KvEventSink for MemorySink {
    fn seed(&self, model: &str, lora: Option<&str>) -> u64 {
        seed_of(model, lora)
    }
    fn block_hashes(&self, seed: u64, parent: Option<u64>, tokens: &[u32], bs: usize) -> Vec<u64> {
        chain(seed, parent, tokens, bs)
    }
    fn store_engine_chain(
        &self,
        worker: WorkerKey,
        _parent: Option<u64>,
        blocks: &[(u64, u64)],
        _now: Instant,
    ) {
        self.0
            .lock()
            .blocks
            .entry(worker)
            .or_default()
            .extend(blocks.iter().copied());
    }
    fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]) {
        if let Some(m) = self.0.lock().blocks.get_mut(&worker) {
            for h in engine_hashes {
                m.remove(h);
            }
        }
    }
    fn store_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
        span: usize,
    ) -> TierStore {
        let mut s = self.0.lock();
        let gpu = s.blocks.get(&worker).cloned().unwrap_or_default();
        let copies = s.tiers.entry((worker, tier)).or_default();
        let mut out = TierStore::default();
        for h in engine_hashes {
            match gpu.get(h) {
                Some(&ours) => {
                    copies.insert(*h, (ours, span));
                    out.stored += span;
                }
                None => out.orphans += 1,
            }
        }
        out
    }
    fn remove_tier_copies(&self, worker: WorkerKey, tier: Tier, engine_hashes: &[u64]) -> usize {
        let mut s = self.0.lock();
        let Some(copies) = s.tiers.get_mut(&(worker, tier)) else {
            return 0;
        };
        engine_hashes
            .iter()
            .filter_map(|h| copies.remove(h))
            .map(|(_, span)| span)
            .sum()
    }
    fn clear_worker(&self, worker: WorkerKey) {
        let mut s = self.0.lock();
        // Like PrefixIndex: the precise flag is forgotten with the blocks,
        // every tier's with the GPU's.
        s.tiers.retain(|(w, _), _| *w != worker);
        s.blocks.remove(&worker);
        s.precise.remove(&worker);
        *s.clears.entry(worker).or_default() += 1;
    }
    fn engine_block(&self, worker: WorkerKey, engine_hash: u64) -> Option<u64> {
        self.0
            .lock()
            .blocks
            .get(&worker)?
            .get(&engine_hash)
            .copied()
    }
    fn set_precise(&self, worker: WorkerKey, precise: bool) {
        self.0.lock().precise.insert(worker, precise);
    }
}

// ---------------------------------------------------------------------------
// Building payloads to the vLLM spec.

const MODEL: &str = "test-model";
const BS: usize = 4;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn ints(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|&h| Value::from(h)).collect())
}

fn toks(v: &[u32]) -> Value {
    Value::Array(v.iter().map(|&t| Value::from(t)).collect())
}

/// A 32-byte hash whose last 8 bytes are `h` (like vLLM's sha256 block hashes).
fn sha_like(h: u64) -> Value {
    let mut b = vec![0x5Au8; 24];
    b.extend_from_slice(&h.to_be_bytes());
    Value::Binary(b)
}

fn stored_array(hashes: Value, parent: Value, tokens: &[u32]) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        hashes,
        parent,
        toks(tokens),
        Value::from(BS as u64),
        Value::Nil,     // lora_id
        s("GPU"),       // medium
        Value::Nil,     // lora_name
        Value::Nil,     // extra_keys
        Value::from(0), // group_idx
        s("future"),    // a field this decoder does not know
    ])
}

fn stored_map(hashes: Value, parent: Value, tokens: &[u32]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), hashes),
        (s("parent_block_hash"), parent),
        (s("token_ids"), toks(tokens)),
        (s("block_size"), Value::from(BS as u64)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

fn removed_array(hashes: Value) -> Value {
    Value::Array(vec![s("BlockRemoved"), hashes, s("GPU")])
}

fn removed_map(hashes: Value) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), hashes),
        (s("medium"), Value::Nil),
    ])
}

fn batch_array(events: Vec<Value>, dp_rank: Option<Value>) -> Vec<u8> {
    let mut items = vec![Value::F64(1_700_000_000.5), Value::Array(events)];
    items.extend(dp_rank);
    encode(Value::Array(items))
}

fn batch_map(events: Vec<Value>, dp_rank: Value) -> Vec<u8> {
    encode(Value::Map(vec![
        (s("ts"), Value::F64(1_700_000_000.5)),
        (s("events"), Value::Array(events)),
        (s("data_parallel_rank"), dp_rank),
    ]))
}

fn encode(v: Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &v).unwrap();
    buf
}

fn w(instance_id: u64, dp_rank: u32) -> WorkerKey {
    WorkerKey {
        instance_id,
        dp_rank,
    }
}

// ---------------------------------------------------------------------------
// Decoding.

#[test]
fn decodes_array_like_batches_with_int_hashes_and_no_dp_rank() {
    let payload = batch_array(
        vec![
            stored_array(ints(&[11, 12]), Value::Nil, &[1, 2, 3, 4, 5, 6, 7, 8]),
            removed_array(ints(&[11])),
            Value::Array(vec![s("AllBlocksCleared")]),
        ],
        None,
    );
    let b = Vllm.decode(&payload).unwrap();
    assert_eq!(b.ts, 1_700_000_000.5);
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![11, 12],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
                block_size: BS,
                lora_id: None,
                tier: StorageTier::Gpu,
                lora_name: None,
                group_idx: Some(0),
                block_mm_hashes: Vec::new(),
                cache_salt: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![11],
                tier: StorageTier::Gpu,
                group_idx: None,
            }),
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn decodes_tagged_maps_with_bytes_hashes_and_nil_dp_rank() {
    let payload = batch_map(
        vec![
            stored_map(
                Value::Array(vec![sha_like(0xABCD), sha_like(0xBEEF)]),
                sha_like(7),
                &[9, 9, 9, 9, 8, 8, 8, 8],
            ),
            removed_map(Value::Array(vec![sha_like(0xABCD)])),
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        ],
        Value::Nil,
    );
    let b = Vllm.decode(&payload).unwrap();
    assert_eq!(b.dp_rank, None);
    let KvEvent::BlockStored(st) = &b.events[0] else {
        panic!("expected BlockStored, got {:?}", b.events[0])
    };
    assert_eq!(st.block_hashes, vec![0xABCD, 0xBEEF]);
    assert_eq!(st.parent_block_hash, Some(7));
    assert_eq!(st.token_ids, vec![9, 9, 9, 9, 8, 8, 8, 8]);
    assert_eq!(st.tier, StorageTier::Gpu);
    let KvEvent::BlockRemoved(rm) = &b.events[1] else {
        panic!("expected BlockRemoved")
    };
    assert_eq!(
        (rm.block_hashes.as_slice(), &rm.tier),
        (&[0xABCD][..], &StorageTier::Gpu)
    );
    assert_eq!(b.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn dp_rank_present_unknown_events_and_trailing_fields() {
    let payload = batch_array(
        vec![
            Value::Array(vec![s("SomethingNew"), Value::from(1)]),
            // Minimal old-style BlockStored: no lora_name or later fields.
            Value::Array(vec![
                s("BlockStored"),
                ints(&[5]),
                Value::from(-3i64),
                toks(&[1, 2, 3, 4]),
                Value::from(4),
                Value::from(2),
                Value::Nil,
            ]),
        ],
        Some(Value::from(3)),
    );
    let b = Vllm.decode(&payload).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert_eq!(b.events[0], KvEvent::Unknown("SomethingNew".into()));
    let KvEvent::BlockStored(st) = &b.events[1] else {
        panic!("expected BlockStored")
    };
    assert_eq!(st.parent_block_hash, Some(u64::MAX - 2));
    assert_eq!(st.lora_id, Some(2));
    assert_eq!(st.lora_name, None);
    // SGLang: `[ts, events]`, BlockStored without `medium`, BlockRemoved hashes only.
    let sglang = batch_array(
        vec![
            Value::Array(vec![
                s("BlockStored"),
                ints(&[8, 9]),
                Value::Nil,
                toks(&[1, 2, 3, 4, 5, 6, 7, 8]),
                Value::from(4),
                Value::Nil,
            ]),
            Value::Array(vec![s("BlockRemoved"), ints(&[8])]),
        ],
        None,
    );
    let b = Sglang.decode(&sglang).unwrap();
    let KvEvent::BlockStored(st) = &b.events[0] else {
        panic!("expected BlockStored")
    };
    assert_eq!((st.block_hashes.len(), &st.tier), (2, &StorageTier::Gpu));
    assert_eq!(
        b.events[1],
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![8],
            tier: StorageTier::Gpu,
            group_idx: None
        })
    );
    // A batch map with more keys than vLLM writes today still decodes.
    let mut extra = rmpv::decode::read_value(&mut &batch_map(vec![], Value::from(1))[..]).unwrap();
    if let Value::Map(m) = &mut extra {
        m.push((s("new_field"), s("x")));
    }
    assert_eq!(Vllm.decode(&encode(extra)).unwrap().dp_rank, Some(1));
    // A known event missing a required field is an error, not a panic.
    let bad = batch_array(vec![Value::Array(vec![s("BlockStored"), ints(&[1])])], None);
    assert!(Vllm.decode(&bad).is_err());
}

// ---------------------------------------------------------------------------
// Ingest: stored → lookup → removed → lookup.

#[test]
fn ingest_chains_blocks_across_events_like_the_request_side() {
    let sink = Arc::new(MemorySink::default());
    let mut ingest = Ingest::new(Arc::clone(&sink), MODEL);
    let worker = w(1, 0);
    let prompt: Vec<u32> = (100..116).collect(); // 4 blocks of 4
    let request = chain(seed_of(MODEL, None), None, &prompt, BS);

    // First two blocks, then the next two chained to the engine hash of block 2.
    let first = Vllm
        .decode(&batch_array(
            vec![stored_array(ints(&[901, 902]), Value::Nil, &prompt[..8])],
            None,
        ))
        .unwrap();
    let stats = ingest.apply(worker, None, &first, Instant::now());
    assert_eq!(stats.stored_blocks, 2);
    assert_eq!(sink.depth(worker, &request), 2);

    let second = Vllm
        .decode(&batch_map(
            vec![stored_map(
                ints(&[903, 904]),
                Value::from(902),
                &prompt[8..],
            )],
            Value::from(0),
        ))
        .unwrap();
    ingest.apply(worker, None, &second, Instant::now());
    assert_eq!(sink.depth(worker, &request), 4);
    // Another worker holds nothing; another model's seed matches nothing.
    assert_eq!(sink.depth(w(2, 0), &request), 0);
    let other_model = chain(seed_of("other", None), None, &prompt, BS);
    assert_eq!(sink.depth(worker, &other_model), 0);

    // Evicting block 3 cuts the prefix at 2.
    let rm = Vllm
        .decode(&batch_array(vec![removed_array(ints(&[903]))], None))
        .unwrap();
    let stats = ingest.apply(worker, None, &rm, Instant::now());
    assert_eq!(stats.removed_blocks, 1);
    assert_eq!(sink.depth(worker, &request), 2);

    // A block whose parent is unknown cannot be keyed: skipped and counted.
    let orphan = Vllm
        .decode(&batch_array(
            vec![stored_array(ints(&[999]), Value::from(12345), &prompt[..4])],
            None,
        ))
        .unwrap();
    let stats = ingest.apply(worker, None, &orphan, Instant::now());
    assert_eq!((stats.orphan_blocks, stats.stored_blocks), (1, 0));

    // A CPU-tier copy of a block the GPU no longer places cannot be placed:
    // an orphan, and the GPU's prefix is unchanged.
    let mut cpu = stored_array(ints(&[903]), Value::from(902), &prompt[8..12]);
    if let Value::Array(f) = &mut cpu {
        f[6] = s("CPU");
    }
    let cpu = Vllm.decode(&batch_array(vec![cpu], None)).unwrap();
    let stats = ingest.apply(worker, None, &cpu, Instant::now());
    assert_eq!(
        (stats.tier_blocks, stats.orphan_blocks, stats.ignored_events),
        (0, 1, 0)
    );
    assert_eq!(sink.depth(worker, &request), 2);

    // The topic's model seeds the chain when present.
    let topic_model = chain(seed_of("from-topic", None), None, &prompt, BS);
    ingest.apply(w(3, 0), Some("from-topic"), &first, Instant::now());
    assert_eq!(sink.depth(w(3, 0), &topic_model), 2);

    // AllBlocksCleared empties the worker.
    let clear = Vllm
        .decode(&batch_array(
            vec![Value::Array(vec![s("AllBlocksCleared")])],
            None,
        ))
        .unwrap();
    assert_eq!(ingest.apply(worker, None, &clear, Instant::now()).clears, 1);
    assert_eq!(sink.depth(worker, &request), 0);
    assert!(!sink.0.lock().blocks.contains_key(&worker));
}

#[test]
fn lora_blocks_are_seeded_by_adapter() {
    let sink = Arc::new(MemorySink::default());
    let mut ingest = Ingest::new(Arc::clone(&sink), MODEL);
    let prompt: Vec<u32> = (1..=8).collect();
    let mut ev = stored_map(ints(&[1, 2]), Value::Nil, &prompt);
    if let Value::Map(m) = &mut ev {
        for (k, v) in m.iter_mut() {
            if k.as_str() == Some("lora_name") {
                *v = s("sql-adapter");
            }
        }
    }
    let b = Vllm.decode(&batch_map(vec![ev], Value::Nil)).unwrap();
    ingest.apply(w(1, 0), None, &b, Instant::now());
    let base = chain(seed_of(MODEL, None), None, &prompt, BS);
    let lora = chain(seed_of("sql-adapter", None), None, &prompt, BS);
    assert_eq!(sink.depth(w(1, 0), &base), 0);
    assert_eq!(sink.depth(w(1, 0), &lora), 2);
}

/// vLLM's offloading connector's `BlockStored`: engine hashes only (no
/// parent, no tokens), `block_size` the offloaded block's, `medium` its tier.
fn offloaded(hashes: &[u64], block_size: usize, medium: &str) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        ints(hashes),
        Value::Nil,
        toks(&[]),
        Value::from(block_size as u64),
        Value::Nil,
        s(medium),
        Value::Nil,
    ])
}

fn removed_from(hashes: &[u64], medium: &str) -> Value {
    Value::Array(vec![s("BlockRemoved"), ints(hashes), s(medium)])
}

/// The GPU, CPU and disk leading runs `worker` holds of `hashes`.
fn tier_depths(index: &PrefixIndex, worker: WorkerKey, hashes: &[u64]) -> [usize; 3] {
    let ov = index.overlaps(hashes, Instant::now());
    [Tier::Gpu, Tier::Cpu, Tier::Disk].map(|t| ov.get(tier::holder(worker, t)))
}

/// kvpick's hashes of `prompt` under [`MODEL`], as requests hash it.
fn request_hashes(prompt: &[u32]) -> Vec<u64> {
    let seed = kvpick::kv::hash::model_seed(MODEL, None);
    kvpick::kv::hash::token_block_hashes(seed, None, prompt, BS)
}

/// vLLM's events with `medium`, through the decoder and ingest into the
/// prefix index: GPU blocks stored with their tokens, the offloading
/// connector's CPU copies (two GPU blocks per offloaded block) and disk
/// copies by engine hash, then each medium's `BlockRemoved` dropping its own
/// copies only.
#[test]
fn each_medium_is_ingested_as_its_tier_and_removed_from_it_alone() {
    let index = Arc::new(PrefixIndex::default());
    let mut ingest = Ingest::new(Arc::clone(&index), MODEL);
    let worker = w(1, 0);
    index.set_precise(worker, true);
    let prompt: Vec<u32> = (100..124).collect(); // 6 blocks of 4
    let request = request_hashes(&prompt);
    let mut apply = |events: Vec<Value>| {
        let batch = Vllm.decode(&batch_array(events, None)).unwrap();
        ingest.apply(worker, None, &batch, Instant::now())
    };
    let engine: Vec<u64> = (901..907).collect();
    let st = apply(vec![stored_array(ints(&engine), Value::Nil, &prompt)]);
    assert_eq!(st.stored_blocks, 6);
    // Offloaded blocks of 2 GPU blocks, named by their second block's hash.
    let st = apply(vec![offloaded(&[902, 904, 906], 2 * BS, "CPU")]);
    assert_eq!((st.tier_blocks, st.orphan_blocks), (6, 0));
    let st = apply(vec![offloaded(&[901, 902, 777], BS, "DISK")]);
    assert_eq!((st.tier_blocks, st.orphan_blocks), (2, 1));
    assert_eq!(tier_depths(&index, worker, &request), [6, 6, 2]);
    // The GPU evicts its copies of the last four: the CPU's stand.
    apply(vec![removed_from(&engine[2..], "GPU")]);
    assert_eq!(tier_depths(&index, worker, &request), [2, 6, 2]);
    // The CPU drops its second offloaded block (GPU blocks 3 and 4).
    let st = apply(vec![removed_from(&[904], "CPU")]);
    assert_eq!(st.removed_blocks, 2);
    assert_eq!(tier_depths(&index, worker, &request), [2, 2, 2]);
    // Disk drops the first block: only the disk's copy goes.
    apply(vec![removed_from(&[901], "DISK")]);
    assert_eq!(tier_depths(&index, worker, &request), [2, 2, 0]);
    // A tier kvpick has no name for is ignored.
    let st = apply(vec![offloaded(&[905], BS, "LMCACHE_REMOTE")]);
    assert_eq!(st.ignored_events, 1);
    // A reset clears every tier.
    ingest.reset(worker);
    assert_eq!(tier_depths(&index, worker, &request), [0, 0, 0]);
}

/// SGLang's HiCache host tier (`CPU_TIER1`), its events shaped like the
/// GPU's, gives the worker CPU copies of the blocks its GPU stored.
#[test]
fn sglang_host_tier_events_are_cpu_copies() {
    let index = Arc::new(PrefixIndex::default());
    let mut ingest = Ingest::new(Arc::clone(&index), MODEL);
    let worker = w(1, 0);
    index.set_precise(worker, true);
    let prompt: Vec<u32> = (100..108).collect();
    let request = request_hashes(&prompt);
    let mut host = stored_array(ints(&[11, 12]), Value::Nil, &prompt);
    if let Value::Array(f) = &mut host {
        f[6] = s("CPU_TIER1");
    }
    let gpu = stored_array(ints(&[11, 12]), Value::Nil, &prompt);
    let batch = Sglang
        .decode(&batch_array(
            vec![gpu, host, removed_array(ints(&[11, 12]))],
            None,
        ))
        .unwrap();
    let st = ingest.apply(worker, None, &batch, Instant::now());
    assert_eq!((st.stored_blocks, st.tier_blocks), (2, 2));
    assert_eq!(tier_depths(&index, worker, &request), [0, 2, 0]);
}

// ---------------------------------------------------------------------------
// ZMQ loopback.

async fn publisher() -> (PubSocket, u16) {
    let mut socket = PubSocket::new();
    let ep = socket.bind("tcp://127.0.0.1:0").await.unwrap();
    let port = match ep {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("unexpected endpoint {other}"),
    };
    (socket, port)
}

fn frames(topic: &str, seq: u64, payload: Vec<u8>) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
    .unwrap()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn start(sink: &Arc<MemorySink>, replay_port: Option<u16>) -> (KvEvents, IngestThread) {
    let metrics = KvEventMetrics::register(&Metrics::new("test"));
    KvEvents::start(
        Arc::clone(sink) as Arc<dyn KvEventSink>,
        metrics,
        SubscriberConfig {
            model: MODEL.into(),
            replay_port,
            connect_timeout: Duration::from_secs(2),
            retry_delay: Duration::from_millis(20),
            ..SubscriberConfig::default()
        },
    )
}

/// Publishes seq 0 until the subscriber sees it (a PUB drops messages until the
/// subscription has arrived), so later sends are reliable.
async fn prime(
    pub_socket: &mut PubSocket,
    sink: &MemorySink,
    worker: WorkerKey,
    payload: &[u8],
    expect: &[u64],
) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.depth(worker, expect) != expect.len() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the first batch"
        );
        pub_socket
            .send(frames("", 0, payload.to_vec()))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The stream of `worker`'s engine publishing on this host's `port`.
fn loopback(worker: WorkerKey, port: u16, replay_port: Option<u16>) -> Target {
    Target {
        worker,
        engine: Engine::Vllm,
        host: "127.0.0.1".parse().unwrap(),
        port,
        replay_port,
    }
}

/// The ingest thread is owned: it applies what was queued, including a stopped
/// subscription's forget, and ends once the handles and subscriptions are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_thread_ends_once_every_sender_is_gone() {
    let (mut pub_socket, port) = publisher().await;
    let sink = Arc::new(MemorySink::default());
    let (events, ingest) = start(&sink, None);
    let worker = w(9, 0);
    let sub = events.subscribe(loopback(worker, port, None));
    let a: Vec<u32> = (0..8).collect();
    let ha = chain(seed_of(MODEL, None), None, &a, BS);
    let first = batch_array(vec![stored_array(ints(&[1, 2]), Value::Nil, &a)], None);
    prime(&mut pub_socket, &sink, worker, &first, &ha).await;
    assert!(sink.precise(worker));
    sub.stop();
    drop(events);
    tokio::time::timeout(Duration::from_secs(5), ingest.join())
        .await
        .expect("the ingest thread ended");
    // The forget was applied before the thread ended.
    assert!(!sink.precise(worker));
}

/// Each stream's batches are read by its engine's decoder, chosen on the
/// ingest thread from the engine its queued batches carry: the same bytes reach
/// the index from a vLLM and an SGLang stream, and are refused from a stream
/// marked TensorRT-LLM (whose decoder reads none), which resets that worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stream_is_decoded_by_its_engines_decoder() {
    let sink = Arc::new(MemorySink::default());
    let (events, _ingest) = start(&sink, None);
    let a: Vec<u32> = (0..8).collect();
    let ha = chain(seed_of(MODEL, None), None, &a, BS);
    let batch = batch_array(vec![stored_array(ints(&[1, 2]), Value::Nil, &a)], None);
    let mut subs = Vec::new();
    for (worker, engine) in [(w(1, 0), Engine::Vllm), (w(2, 0), Engine::Sglang)] {
        let (mut socket, port) = publisher().await;
        subs.push(events.subscribe(Target {
            engine,
            ..loopback(worker, port, None)
        }));
        prime(&mut socket, &sink, worker, &batch, &ha).await;
    }

    let trt = w(3, 0);
    let (mut socket, port) = publisher().await;
    let _trt = events.subscribe(Target {
        engine: Engine::Trtllm,
        ..loopback(trt, port, None)
    });
    eventually("a live stream", || sink.precise(trt)).await;
    let clears = sink.clears(trt);
    let deadline = Instant::now() + Duration::from_secs(5);
    // In sequence, so that only a refusal resets the worker.
    for seq in 0.. {
        if sink.clears(trt) != clears {
            break;
        }
        assert!(Instant::now() < deadline, "timed out waiting for a refusal");
        socket.send(frames("", seq, batch.clone())).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    events.flush().await;
    assert_eq!(sink.depth(trt, &ha), 0);
    assert!(
        sink.precise(trt),
        "a refused batch resets, the stream stays"
    );
}

/// The streams followed are every rank of every endpoint whose engine
/// publishes KV events, each marked with its engine.
#[test]
fn targets_are_the_ranks_of_engines_that_publish() {
    use kvpick::endpoints::{Endpoint, EndpointTable};
    let sink = Arc::new(MemorySink::default());
    let (events, _ingest) = start(&sink, None);
    let endpoint = |addr: &str, engine, dp_size| Endpoint {
        engine,
        dp_size,
        ..Endpoint::new(addr.parse().unwrap())
    };
    let table = EndpointTable::new();
    table.replace(vec![
        endpoint("10.0.0.1:8000", Engine::Vllm, 2),
        endpoint("10.0.0.2:8000", Engine::Sglang, 1),
        endpoint("10.0.0.3:8000", Engine::Trtllm, 1),
    ]);
    let mut got: Vec<(String, u16, Engine)> = events
        .targets(&table)
        .into_iter()
        .map(|t| (t.host.to_string(), t.port, t.engine))
        .collect();
    got.sort_by_key(|(h, p, _)| (h.clone(), *p));
    let port = SubscriberConfig::default().port;
    assert_eq!(
        got,
        vec![
            ("10.0.0.1".to_string(), port, Engine::Vllm),
            ("10.0.0.1".to_string(), port + 1, Engine::Vllm),
            ("10.0.0.2".to_string(), port, Engine::Sglang),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_events_reach_the_index_and_gaps_reset() {
    let (mut pub_socket, port) = publisher().await;
    let sink = Arc::new(MemorySink::default());
    let (events, _ingest) = start(&sink, None);
    let worker = w(42, 0);
    let _sub = events.subscribe(loopback(worker, port, None));
    eventually("precise mode", || sink.precise(worker)).await;

    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    let c: Vec<u32> = (70..74).collect();
    let ha = chain(seed_of(MODEL, None), None, &a, BS);
    let hb = chain(seed_of(MODEL, None), None, &b, BS);
    let hc = chain(seed_of(MODEL, None), None, &c, BS);
    let first = batch_array(
        vec![stored_array(ints(&[1, 2]), Value::Nil, &a)],
        Some(Value::from(0)),
    );
    prime(&mut pub_socket, &sink, worker, &first, &ha).await;

    // In order: applied, nothing reset.
    let clears_before = sink.clears(worker);
    pub_socket
        .send(frames(
            "kv@pod-a@test-model",
            1,
            batch_map(
                vec![stored_map(ints(&[3, 4]), Value::Nil, &b)],
                Value::from(0),
            ),
        ))
        .await
        .unwrap();
    events.flush().await;
    eventually("batch 1", || sink.depth(worker, &hb) == 2).await;
    assert_eq!(sink.depth(worker, &ha), 2);
    assert_eq!(sink.clears(worker), clears_before);

    // Seq 2 and 3 never arrive: the worker is reset, then batch 4 applies.
    pub_socket
        .send(frames(
            "",
            4,
            batch_array(vec![stored_array(ints(&[5]), Value::Nil, &c)], None),
        ))
        .await
        .unwrap();
    eventually("batch 4", || sink.depth(worker, &hc) == 1).await;
    assert_eq!(sink.clears(worker), clears_before + 1);
    assert_eq!(
        sink.depth(worker, &ha),
        0,
        "blocks from before the gap were dropped"
    );
    assert_eq!(sink.depth(worker, &hb), 0);
    assert!(sink.precise(worker), "a reset keeps a live worker precise");

    // The engine restarts: seq goes back to 0, and the worker is reset again.
    pub_socket
        .send(frames(
            "",
            0,
            batch_array(vec![stored_array(ints(&[1, 2]), Value::Nil, &a)], None),
        ))
        .await
        .unwrap();
    eventually("restart batch", || sink.depth(worker, &ha) == 2).await;
    assert_eq!(sink.depth(worker, &hc), 0);
    assert_eq!(sink.clears(worker), clears_before + 2);

    // The publisher goes away: the worker falls back to approximate mode.
    drop(pub_socket);
    eventually("approximate mode", || !sink.precise(worker)).await;
    assert_eq!(sink.depth(worker, &ha), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_repaired_from_the_replay_socket() {
    let (mut pub_socket, port) = publisher().await;
    let mut router = RouterSocket::new();
    let replay_port = match router.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, p) => p,
        other => panic!("unexpected endpoint {other}"),
    };
    let blocks: Vec<Vec<u32>> = (0..4u32).map(|i| (i * 10..i * 10 + 4).collect()).collect();
    let payloads: Vec<Vec<u8>> = blocks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            batch_array(
                vec![stored_array(ints(&[100 + i as u64]), Value::Nil, t)],
                None,
            )
        })
        .collect();
    // The engine side of replay: answer ("", start) with ("", seq, payload)… and -1.
    let served = payloads.clone();
    let replays = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&replays);
    tokio::spawn(async move {
        while let Ok(req) = router.recv().await {
            let f = req.into_vec();
            let start = u64::from_be_bytes(f[2][..].try_into().unwrap());
            seen.lock().push(start);
            for (seq, p) in served.iter().enumerate().skip(start as usize) {
                let m = ZmqMessage::try_from(vec![
                    f[0].clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&(seq as u64).to_be_bytes()),
                    Bytes::from(p.clone()),
                ])
                .unwrap();
                router.send(m).await.unwrap();
            }
            let end = ZmqMessage::try_from(vec![
                f[0].clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ])
            .unwrap();
            router.send(end).await.unwrap();
        }
    });

    let sink = Arc::new(MemorySink::default());
    let (events, _ingest) = start(&sink, Some(replay_port));
    let worker = w(7, 0);
    let _sub = events.subscribe(loopback(worker, port, Some(replay_port)));
    eventually("precise mode", || sink.precise(worker)).await;
    let hashes: Vec<Vec<u64>> = blocks
        .iter()
        .map(|t| chain(seed_of(MODEL, None), None, t, BS))
        .collect();
    prime(&mut pub_socket, &sink, worker, &payloads[0], &hashes[0]).await;
    let clears = sink.clears(worker);
    // Seq 1 and 2 are lost on the PUB socket; 3 arrives and triggers a replay.
    pub_socket
        .send(frames("", 3, payloads[3].clone()))
        .await
        .unwrap();
    eventually("batch 3", || sink.depth(worker, &hashes[3]) == 1).await;
    assert_eq!(*replays.lock(), vec![1]);
    for h in &hashes {
        assert_eq!(
            sink.depth(worker, h),
            1,
            "every block is present after replay"
        );
    }
    assert_eq!(
        sink.clears(worker),
        clears,
        "no reset when replay filled the gap"
    );
}

// ---------------------------------------------------------------------------
// Tokenization.

/// A body parsed as the ext_proc path parses it when a tokenizer is configured.
fn parsed(kind: ApiKind, body: &serde_json::Value) -> InferenceRequest {
    let options = ParseOptions {
        limits: kvpick::request::PromptLimits::NONE,
        template: true,
    };
    parse_with(&serde_json::to_vec(body).unwrap(), Some(kind), options).unwrap()
}

/// What the tokenizer renders a body from.
fn template(kind: ApiKind, body: &serde_json::Value) -> TemplateInput {
    parsed(kind, body).template.unwrap()
}

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// Token ids by looking words up in the fixture's vocabulary directly.
fn ids(words: &[&str]) -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = &json["model"]["vocab"];
    words
        .iter()
        .map(|w| {
            vocab[*w]
                .as_u64()
                .unwrap_or_else(|| panic!("{w} not in vocab")) as u32
        })
        .collect()
}

#[test]
fn chat_template_renders_like_transformers() {
    let tok = Tokenizer::load(fixture()).unwrap();
    let body = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world!"}]}
        ],
        "tools": [{"name": "weather", "z": 1, "a": "city"}]
    });
    let TemplateInput::Chat(chat) = template(ApiKind::Chat, &body) else {
        panic!("a chat")
    };
    let (text, images) = tok.render_chat(&chat).unwrap();
    assert!(images.is_empty());
    assert_eq!(
        text,
        "<s><|im_start|>system\n{\"name\": \"weather\", \"z\": 1, \"a\": \"city\"}\n<|im_end|>\n\
         <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHello\nworld!<|im_end|>\n<|im_start|>assistant\n"
    );
    // A role the template rejects raises, as transformers would.
    let bad = serde_json::json!({"model": "m", "messages": [{"role": "robot", "content": "hi"}]});
    let err = tok
        .tokenize_request(&parsed(ApiKind::Chat, &bad))
        .unwrap_err();
    let err = kvpick::error_chain::ErrorChain(&err).to_string();
    assert!(err.contains("unknown role: robot"), "{err}");
}

#[test]
fn chat_and_completion_token_ids() {
    let tok = Tokenizer::load(fixture()).unwrap();
    let chat = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "The cat sat."}]});
    let segs = tok.tokenize_request(&parsed(ApiKind::Chat, &chat)).unwrap();
    let mut expect = ids(&[
        "<s>",
        "<|im_start|>",
        "user",
        "the",
        "cat",
        "sat",
        ".",
        "<|im_end|>",
    ]);
    expect.extend(ids(&["<|im_start|>", "assistant"]));
    assert_eq!(segs, vec![Segment::Tokens(expect)]);

    // Completions get BOS from the post-processor; token-id prompts pass through.
    let comp = serde_json::json!({"model": "m", "prompt": "good morning"});
    assert_eq!(
        tok.tokenize_request(&parsed(ApiKind::Completions, &comp))
            .unwrap(),
        vec![Segment::Tokens(ids(&["<s>", "good", "morning"]))]
    );
    let raw = serde_json::json!({"model": "m", "prompt": [5, 6, 7]});
    assert_eq!(
        tok.tokenize_request(&parsed(ApiKind::Completions, &raw))
            .unwrap(),
        vec![Segment::Tokens(vec![5, 6, 7])]
    );
    // Responses: instructions become a system turn.
    let resp = serde_json::json!({"model": "m", "instructions": "Be a cat.", "input": "hello"});
    let ids_resp = token_ids(
        &tok.tokenize_request(&parsed(ApiKind::Responses, &resp))
            .unwrap(),
    );
    assert_eq!(
        &ids_resp[..4],
        &ids(&["<s>", "<|im_start|>", "system", "<unk>"])[..]
    );
}

#[tokio::test]
async fn images_are_carried_through_in_place() {
    let pool = TokenizerPool::new(Tokenizer::load(fixture()).unwrap(), 2);
    let body = |url: &str| {
        template(
            ApiKind::Chat,
            &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look at this"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is in the picture?"}
            ]}]}),
        )
    };
    let segs = pool
        .tokenize(body("data:image/png;base64,AAAA"))
        .await
        .unwrap();
    assert_eq!(segs.len(), 3, "{segs:?}");
    assert_eq!(
        segs[0],
        Segment::Tokens(ids(&["<s>", "<|im_start|>", "user", "look", "at", "this"]))
    );
    assert_eq!(segs[1], Segment::Image("data:image/png;base64,AAAA".into()));
    let Segment::Tokens(after) = &segs[2] else {
        panic!("expected tokens after the image")
    };
    assert_eq!(
        &after[..5],
        &ids(&["what", "is", "in", "the", "picture"])[..]
    );
    // A different image changes only the image segment.
    let other = pool
        .tokenize(body("https://example.com/b.png"))
        .await
        .unwrap();
    assert_eq!((&other[0], &other[2]), (&segs[0], &segs[2]));
    assert_ne!(other[1], segs[1]);
}

#[tokio::test]
async fn a_huge_prompt_is_tokenized_off_the_async_thread() {
    let pool = TokenizerPool::new(Tokenizer::load(fixture()).unwrap(), 1);
    let big = "the cat sat on the mat ".repeat(10_000); // ~230 KB
    let body = template(
        ApiKind::Completions,
        &serde_json::json!({"model": "m", "prompt": big}),
    );
    let work = tokio::spawn({
        let pool = pool.clone();
        async move { pool.tokenize(body).await }
    });
    // On this single-threaded runtime, tokenizing inline would finish `work` while
    // we yield; on the blocking pool it is still running when we are back.
    tokio::task::yield_now().await;
    assert!(!work.is_finished(), "tokenization ran on the async thread");
    let segs = work.await.unwrap().unwrap();
    assert_eq!(token_ids(&segs).len(), 60_001);
}

// ---------------------------------------------------------------------------
// The real index behind the scheduler: events decide routing.

mod routing {
    use super::*;
    use kvpick::endpoints::Endpoint;
    use kvpick::kv::hash::{model_seed, token_block_hashes};
    use kvpick::kv::index::{IndexConfig, PrefixIndex};
    use kvpick::request::parse;
    use kvpick::scheduler::{PickRequest, Scheduler, SchedulerConfig};
    use kvpick::server::App;

    /// Picks a worker for `req` over the app's current endpoints.
    fn pick_body(
        app: &App,
        req: &kvpick::request::InferenceRequest,
    ) -> kvpick::scheduler::Decision {
        let pick = PickRequest {
            body: Some(req),
            ..PickRequest::default()
        };
        app.scheduler
            .pick(&pick, &app.endpoints.snapshot())
            .unwrap()
    }

    /// Worker 2's ingest into an index capping precise entries at 100, after 30
    /// `BlockStored` events of 10 fresh blocks each (each its own chain, or each
    /// continuing the previous event's last block); returns the orphan blocks.
    fn flood(chained: bool) -> (Arc<PrefixIndex>, Ingest<PrefixIndex>, u64) {
        let index = Arc::new(PrefixIndex::new(IndexConfig {
            default_precise_limit: 100,
            ..IndexConfig::default()
        }));
        let mut ingest = Ingest::new(Arc::clone(&index), MODEL);
        let mut orphans = 0;
        for e in 0..30u64 {
            let tokens: Vec<u32> = (0..10 * BS as u32).map(|t| e as u32 * 10_000 + t).collect();
            let hashes = (0..10).map(|i| sha_like(e * 100 + i + 1)).collect();
            let parent = match e {
                0 => Value::Nil,
                _ if !chained => Value::Nil,
                _ => sha_like((e - 1) * 100 + 10),
            };
            let batch = Vllm
                .decode(&batch_map(
                    vec![stored_map(Value::Array(hashes), parent, &tokens)],
                    Value::from(0),
                ))
                .unwrap();
            orphans += ingest
                .apply(w(2, 0), None, &batch, Instant::now())
                .orphan_blocks;
        }
        (index, ingest, orphans)
    }

    /// A publisher flooding `BlockStored` with new blocks: the worker's precise
    /// entries stay at the cap and the rest are counted as dropped.
    #[test]
    fn a_flood_of_stored_blocks_stays_within_the_precise_cap() {
        let (index, _, orphans) = flood(false);
        assert_eq!(index.precise_len(w(2, 0)), 100);
        assert_eq!(index.len(), 100);
        assert_eq!(index.precise_dropped(), 200);
        assert_eq!(orphans, 0);
    }

    /// One chain continued event after event past the cap: the first event beyond
    /// it is dropped, and its children are orphans (their parent is nowhere: no
    /// engine → kvpick map outside the index keeps growing).
    #[test]
    fn a_flood_of_chained_blocks_keeps_no_parent_map_beyond_the_cap() {
        let (index, mut ingest, orphans) = flood(true);
        let (b, now) = (w(2, 0), Instant::now());
        assert_eq!(index.precise_len(b), 100);
        assert_eq!(
            index.precise_dropped(),
            10,
            "only the first event past the cap"
        );
        assert_eq!(orphans, 190);
        // Evictions make room, and a chain from a kept block continues again.
        let evicted: Vec<Value> = (1..=10).map(sha_like).collect();
        let removed = Vllm
            .decode(&batch_map(
                vec![removed_map(Value::Array(evicted))],
                Value::from(0),
            ))
            .unwrap();
        ingest.apply(b, None, &removed, now);
        let tokens: Vec<u32> = (0..BS as u32).map(|t| 900_000 + t).collect();
        let more = Vllm
            .decode(&batch_map(
                vec![stored_map(
                    Value::Array(vec![sha_like(7_777)]),
                    sha_like(910),
                    &tokens,
                )],
                Value::from(0),
            ))
            .unwrap();
        assert_eq!(ingest.apply(b, None, &more, now).stored_blocks, 1);
        assert_eq!(index.precise_len(b), 91);
    }

    #[test]
    fn index_stored_lookup_removed_lookup() {
        let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
        let mut ingest = Ingest::new(Arc::clone(&index), MODEL);
        let (a, b) = (w(1, 0), w(2, 1));
        let prompt: Vec<u32> = (1..=12).collect();
        let hashes = token_block_hashes(model_seed(MODEL, None), None, &prompt, BS);
        let now = Instant::now();
        let stored = Vllm
            .decode(&batch_map(
                vec![stored_map(
                    Value::Array(vec![sha_like(1), sha_like(2), sha_like(3)]),
                    Value::Nil,
                    &prompt,
                )],
                Value::from(1),
            ))
            .unwrap();
        ingest.apply(b, None, &stored, now);
        assert_eq!(index.lookup(&hashes, &[a, b], now), vec![0, 3]);
        let removed = Vllm
            .decode(&batch_map(
                vec![removed_map(Value::Array(vec![sha_like(2)]))],
                Value::from(1),
            ))
            .unwrap();
        ingest.apply(b, None, &removed, now);
        assert_eq!(index.lookup(&hashes, &[a, b], now), vec![0, 1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_whose_tokens_match_events_goes_to_that_worker() {
        // Worker B publishes KV events on 127.0.0.2; worker A has no publisher.
        let mut pub_socket = PubSocket::new();
        let port = match pub_socket.bind("tcp://127.0.0.2:0").await.unwrap() {
            zeromq::Endpoint::Tcp(_, p) => p,
            other => panic!("unexpected endpoint {other}"),
        };
        let app = App::with_scheduler(
            "pool",
            SchedulerConfig {
                token_block: BS,
                ..SchedulerConfig::default()
            },
        );
        let mut ep_a = Endpoint::new("127.0.0.1:18001".parse().unwrap());
        ep_a.kv_events_port = Some(1); // nothing listens: stays approximate
        let mut ep_b = Endpoint::new("127.0.0.2:18002".parse().unwrap());
        ep_b.kv_events_port = Some(port);
        let (key_a, key_b) = (w(ep_a.instance_id, 0), w(ep_b.instance_id, 0));
        app.endpoints.replace(vec![ep_a.clone(), ep_b.clone()]);
        let _follow = app.spawn_kv_events(
            SubscriberConfig {
                model: MODEL.into(),
                retry_delay: Duration::from_millis(20),
                ..SubscriberConfig::default()
            },
            Duration::from_millis(20),
        );
        let index = Arc::clone(app.scheduler.index());
        eventually("B precise", || index.is_precise(key_b)).await;
        assert!(!index.is_precise(key_a));

        let prompt: Vec<u32> = (200..216).collect();
        let hashes = token_block_hashes(model_seed(MODEL, None), None, &prompt, BS);
        let payload = batch_array(
            vec![stored_array(ints(&[1, 2, 3, 4]), Value::Nil, &prompt)],
            Some(Value::from(0)),
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while index.lookup(&hashes, &[key_b], Instant::now())[0] != 4 {
            assert!(Instant::now() < deadline, "events never reached the index");
            pub_socket
                .send(frames("", 0, payload.clone()))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
        let body = format!(r#"{{"model":"{MODEL}","prompt":[{}]}}"#, ids.join(","));
        let req = parse(body.as_bytes(), Some(ApiKind::Completions)).unwrap();
        for _ in 0..4 {
            let d = pick_body(&app, &req);
            assert_eq!(d.decode.key(), key_b, "routed away from the cached prefix");
            assert_eq!(d.overlap_blocks, 4);
            app.scheduler.finish(&d, Some(200));
        }
        // Dynamo's pre-tokenized prompt (`nvext.token_data`) is hashed instead of
        // the text, so a chat request carrying those ids matches the events.
        let body = serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "text that tokenizes to something else"}],
            "nvext": {"token_data": prompt},
        })
        .to_string();
        let req = parse(body.as_bytes(), Some(ApiKind::Chat)).unwrap();
        let d = pick_body(&app, &req);
        assert_eq!(d.decode.key(), key_b, "token_data ids match B's events");
        assert_eq!(d.overlap_blocks, 4);
        app.scheduler.finish(&d, Some(200));

        // A prompt nobody holds has no overlap anywhere.
        let other = parse(
            format!(r#"{{"model":"{MODEL}","prompt":[9,9,9,9,9,9,9,9]}}"#).as_bytes(),
            Some(ApiKind::Completions),
        )
        .unwrap();
        let d = pick_body(&app, &other);
        assert_eq!(d.overlap_blocks, 0);
        app.scheduler.finish(&d, Some(200));

        let b_series = |page: &str| {
            let label = format!("instance_id=\"{}\"", ep_b.instance_id);
            page.lines()
                .filter(|l| !l.starts_with('#') && l.contains(&label))
                .count()
        };
        assert!(b_series(&app.metrics.render(&app.endpoints)) > 0);

        // B leaves the endpoint set: its subscriber stops and its events are forgotten.
        app.endpoints.replace(vec![ep_a]);
        eventually("B forgotten", || {
            !index.is_precise(key_b) && index.lookup(&hashes, &[key_b], Instant::now())[0] == 0
        })
        .await;
        // ...and so are its metric series (the registry does not grow with every
        // pod that ever existed).
        eventually("B's series pruned", || {
            b_series(&app.metrics.render(&app.endpoints)) == 0
        })
        .await;
    }

    /// `nvext.use_raw_prompt` as Dynamo's preprocessor applies it: a completions
    /// prompt goes to the tokenizer as is (kvpick never templates completions),
    /// and a chat body has no raw prompt, so its chat template is still rendered
    /// (Dynamo warns "Raw prompt requested but not available"; an engine behind
    /// kvpick ignores `nvext` and renders it too). The engine's event token ids
    /// must match either way.
    #[test]
    fn use_raw_prompt_bodies_match_the_engines_events() {
        let app = App::with_scheduler(
            "pool",
            SchedulerConfig {
                token_block: BS,
                ..SchedulerConfig::default()
            },
        );
        let ep_a = Endpoint::new("127.0.0.1:18011".parse().unwrap());
        let ep_b = Endpoint::new("127.0.0.2:18012".parse().unwrap());
        let key_b = w(ep_b.instance_id, 0);
        app.endpoints.replace(vec![ep_a, ep_b]);
        let tok = Tokenizer::load(fixture()).unwrap();
        let mut ingest = Ingest::new(Arc::clone(app.scheduler.index()), MODEL);
        let chat = serde_json::json!({"model": MODEL, "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in the city?"}]});
        let comp =
            serde_json::json!({"model": MODEL, "prompt": "good morning the cat sat. the cat sat."});
        for (n, (kind, body)) in [(ApiKind::Chat, &chat), (ApiKind::Completions, &comp)]
            .into_iter()
            .enumerate()
        {
            // Engine B cached the body's tokens as the engine tokenizes them.
            let tokens = token_ids(&tok.tokenize_request(&parsed(kind, body)).unwrap());
            let full = tokens.len() / BS * BS;
            assert!(full >= 2 * BS, "prompt spans blocks");
            let engine = (0..full / BS)
                .map(|i| sha_like(n as u64 * 1000 + i as u64 + 1))
                .collect();
            let stored = Vllm
                .decode(&batch_map(
                    vec![stored_map(
                        Value::Array(engine),
                        Value::Nil,
                        &tokens[..full],
                    )],
                    Value::from(0),
                ))
                .unwrap();
            ingest.apply(key_b, None, &stored, Instant::now());

            let mut raw = body.clone();
            raw["nvext"] = serde_json::json!({"use_raw_prompt": true});
            let mut req = parse(raw.to_string().as_bytes(), Some(kind)).unwrap();
            req.segments = tok.tokenize_request(&parsed(kind, &raw)).unwrap();
            let d = pick_body(&app, &req);
            assert_eq!(
                d.decode.key(),
                key_b,
                "{kind:?}: routed away from its events"
            );
            assert_eq!(d.overlap_blocks, full / BS, "{kind:?}: every block matches");
            app.scheduler.finish(&d, Some(200));
        }
    }

    /// A chat request with text goes through the real ext_proc server, is
    /// tokenized with the fixture's chat template, and lands on the worker whose
    /// KV events hold those tokens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tokenized_chat_request_follows_the_events_through_ext_proc() {
        use kvpick::extproc::ExtProcConfig;

        let mut pub_socket = PubSocket::new();
        let port = match pub_socket.bind("tcp://127.0.0.3:0").await.unwrap() {
            zeromq::Endpoint::Tcp(_, p) => p,
            other => panic!("unexpected endpoint {other}"),
        };
        let mut app = App::with_scheduler(
            "pool",
            SchedulerConfig {
                token_block: BS,
                ..SchedulerConfig::default()
            },
        );
        app.tokenizer = Some(TokenizerPool::new(Tokenizer::load(fixture()).unwrap(), 2));
        let endpoints: Vec<Endpoint> = (1..=3)
            .map(|i| {
                let mut e = Endpoint::new(format!("127.0.0.{i}:18000").parse().unwrap());
                e.kv_events_port = Some(if i == 3 { port } else { 1 });
                e
            })
            .collect();
        let target = w(endpoints[2].instance_id, 0);
        app.endpoints.replace(endpoints);
        let _follow = app.spawn_kv_events(
            SubscriberConfig {
                model: MODEL.into(),
                retry_delay: Duration::from_millis(20),
                ..SubscriberConfig::default()
            },
            Duration::from_millis(20),
        );
        let index = Arc::clone(app.scheduler.index());
        eventually("precise", || index.is_precise(target)).await;

        // The engine cached this conversation's prompt.
        let body = serde_json::json!({"model": MODEL, "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in the city?"}]});
        let tokens = token_ids(
            &Tokenizer::load(fixture())
                .unwrap()
                .tokenize_request(&parsed(ApiKind::Chat, &body))
                .unwrap(),
        );
        let full = tokens.len() / BS * BS;
        assert!(full >= 3 * BS, "prompt long enough to span blocks");
        let hashes = token_block_hashes(model_seed(MODEL, None), None, &tokens[..full], BS);
        let engine: Vec<u64> = (1..=(full / BS) as u64).collect();
        let payload = batch_array(
            vec![stored_array(ints(&engine), Value::Nil, &tokens[..full])],
            None,
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while index.lookup(&hashes, &[target], Instant::now())[0] != hashes.len() {
            assert!(Instant::now() < deadline, "events never reached the index");
            pub_socket
                .send(frames("", 0, payload.clone()))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let ch =
            crate::support::channel(crate::support::serve(&app, ExtProcConfig::default()).await)
                .await;
        let bytes = serde_json::to_vec(&body).unwrap();
        for _ in 0..3 {
            let (_, r) = crate::support::routed_chat(&ch, &bytes, &[], None).await;
            let worker: u64 = r
                .changes
                .get("x-worker-instance-id")
                .expect("routing header")
                .parse()
                .unwrap();
            assert_eq!(worker, target.instance_id);
        }
    }

    /// One worker of [`precise_routing_follows_the_engines_reports_over_a_guess`]:
    /// its endpoint, its publisher and the next sequence number it sends.
    struct Engine {
        key: WorkerKey,
        socket: PubSocket,
        seq: u64,
    }

    impl Engine {
        /// Publishes `events` (resent under new sequence numbers until `done`
        /// holds: a PUB drops what it sends before the subscription arrives).
        async fn publish(&mut self, events: Vec<Value>, mut done: impl FnMut() -> bool) {
            let payload = batch_array(events, Some(Value::from(0)));
            let deadline = Instant::now() + Duration::from_secs(5);
            while !done() {
                assert!(Instant::now() < deadline, "events never took effect");
                self.socket
                    .send(frames("", self.seq, payload.clone()))
                    .await
                    .unwrap();
                self.seq += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// vLLM's `BlockStored` of `tokens` in blocks of 16 under `hashes`.
    fn stored16(hashes: Vec<Value>, tokens: &[u32]) -> Value {
        let mut e = stored_array(Value::Array(hashes), Value::Nil, tokens);
        if let Value::Array(fields) = &mut e {
            fields[4] = Value::from(16);
        }
        e
    }

    /// Sends a completions request for `prompt` through ext_proc, answers it
    /// with `status` as the worker would (`None`: the client goes away before
    /// any response), and returns the worker it went to.
    async fn complete(ch: &tonic::transport::Channel, prompt: &str, status: Option<&str>) -> u64 {
        use envoy_client::{BodyMode, Decision, RequestBody};
        let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
        let mut s =
            crate::support::post(ch, "/v1/completions", &[], Some(BodyMode::FullDuplex), None)
                .await;
        let whole = RequestBody::Whole {
            bytes: body.as_bytes(),
            chunk: 16 * 1024,
        };
        let Decision::Routed(r) = s.decide(BodyMode::FullDuplex, whole).await.unwrap() else {
            panic!("not routed");
        };
        if let Some(status) = status {
            s.respond(BodyMode::FullDuplex, status, &[], Some(b"{}"), 1024)
                .await
                .unwrap();
        }
        s.finish().await.unwrap();
        r.changes
            .get("x-worker-instance-id")
            .expect("routing header")
            .parse()
            .unwrap()
    }

    /// A standalone kvpick with a word-level tokenizer and three vLLM workers
    /// A, B, C publishing KV events over ZMQ,
    /// 16-token blocks, prompts of 320 tokens (20 blocks).
    /// 1. P goes to some worker X (a guess there), which answers but whose
    ///    engine never reports P (it dropped it); another worker Y then reports
    ///    P (u64 block hashes): every request for P goes to Y, though X's guess
    ///    is younger than its bounds.
    /// 2. The same with P2, cancelled before X answered, reported by Y as
    ///    32-byte (bytes) hashes.
    /// 3. A reports P1, takes its requests (a guess there too), then clears its
    ///    cache (`AllBlocksCleared`) and C reports P1: P1 goes to C.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn precise_routing_follows_the_engines_reports_over_a_guess() {
        use kvpick::extproc::ExtProcConfig;
        let mut app = App::with_scheduler(
            "pool",
            SchedulerConfig {
                token_block: 16,
                ..SchedulerConfig::default()
            },
        );
        let tok = Tokenizer::load(fixture()).unwrap();
        app.tokenizer = Some(TokenizerPool::new(Tokenizer::load(fixture()).unwrap(), 2));
        let mut endpoints = Vec::new();
        let mut engines = Vec::new();
        for i in 1..=3u8 {
            let mut socket = PubSocket::new();
            let port = match socket.bind(&format!("tcp://127.0.0.{i}:0")).await.unwrap() {
                zeromq::Endpoint::Tcp(_, p) => p,
                other => panic!("unexpected endpoint {other}"),
            };
            let mut e = Endpoint::new(format!("127.0.0.{i}:18100").parse().unwrap());
            e.kv_events_port = Some(port);
            engines.push(Engine {
                key: w(e.instance_id, 0),
                socket,
                seq: 1,
            });
            endpoints.push(e);
        }
        app.endpoints.replace(endpoints);
        let _follow = app.spawn_kv_events(
            SubscriberConfig {
                model: MODEL.into(),
                retry_delay: Duration::from_millis(20),
                ..SubscriberConfig::default()
            },
            Duration::from_millis(20),
        );
        let index = Arc::clone(app.scheduler.index());
        for e in &engines {
            eventually("precise", || index.is_precise(e.key)).await;
        }
        let ch =
            crate::support::channel(crate::support::serve(&app, ExtProcConfig::default()).await)
                .await;

        // Prompts of 320 words the fixture's tokenizer knows, one token each.
        const WORDS: [&str; 12] = [
            "hello", "world", "cat", "sat", "mat", "good", "morning", "one", "two", "three",
            "four", "five",
        ];
        let prompt = |k: usize| -> (String, Vec<u32>, Vec<u64>) {
            let text: Vec<&str> = (0..320)
                .map(|i| WORDS[(i * i + 7 * k + i / 5) % 12])
                .collect();
            let text = text.join(" ");
            let body = serde_json::json!({"model": MODEL, "prompt": text});
            let tokens = token_ids(
                &tok.tokenize_request(&parsed(ApiKind::Completions, &body))
                    .unwrap(),
            );
            let full = tokens.len() / 16 * 16;
            assert_eq!(full, 320, "one token a word");
            let tokens = tokens[..full].to_vec();
            let hashes = token_block_hashes(model_seed(MODEL, None), None, &tokens, 16);
            (text, tokens, hashes)
        };
        let ids: Vec<u64> = engines.iter().map(|e| e.key.instance_id).collect();
        let which = |id: u64| ids.iter().position(|&i| i == id).unwrap();
        let holds =
            |key: WorkerKey, hashes: &[u64]| index.lookup(hashes, &[key], Instant::now())[0];

        let mut next_engine_hash = 1u64;
        for (round, (first, bytes_hashes)) in
            [(Some("200"), false), (None, true)].into_iter().enumerate()
        {
            let (text, tokens, hashes) = prompt(round);
            // Nobody holds P: it goes to some X, whose engine never reports it.
            let x = which(complete(&ch, &text, first).await);
            let y = (x + 1) % 3;
            let engine: Vec<Value> = (0..20)
                .map(|_| {
                    next_engine_hash += 1;
                    match bytes_hashes {
                        true => sha_like(next_engine_hash),
                        false => Value::from(next_engine_hash),
                    }
                })
                .collect();
            let key = engines[y].key;
            engines[y]
                .publish(vec![stored16(engine, &tokens)], || {
                    holds(key, &hashes) == 20
                })
                .await;
            let mut to = [0usize; 3];
            for _ in 0..40 {
                to[which(complete(&ch, &text, Some("200")).await)] += 1;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            assert_eq!(
                to[y], 40,
                "round {round}: requests for a prompt Y's engine reported (X guessed it): {to:?} to A, B, C (X = {x}, Y = {y})"
            );
        }

        // A reports P1 and takes its requests; then A clears its cache and C reports P1.
        let (text, tokens, hashes) = prompt(2);
        let (a, c) = (engines[0].key, engines[2].key);
        let engine: Vec<Value> = (0..20).map(|i| Value::from(1_000 + i)).collect();
        engines[0]
            .publish(vec![stored16(engine, &tokens)], || holds(a, &hashes) == 20)
            .await;
        for _ in 0..5 {
            assert_eq!(
                which(complete(&ch, &text, Some("200")).await),
                0,
                "P1 follows A's report"
            );
        }
        engines[0]
            .publish(vec![Value::Array(vec![s("AllBlocksCleared")])], || {
                holds(a, &hashes) == 0
            })
            .await;
        let engine: Vec<Value> = (0..20).map(|i| Value::from(2_000 + i)).collect();
        engines[2]
            .publish(vec![stored16(engine, &tokens)], || holds(c, &hashes) == 20)
            .await;
        let mut to = [0usize; 3];
        for _ in 0..40 {
            to[which(complete(&ch, &text, Some("200")).await)] += 1;
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        assert_eq!(
            to[2], 40,
            "after A cleared its cache and C reported P1: {to:?} to A, B, C"
        );
    }

    /// A vLLM `BlockStored` whose first block carries the request's `cache_salt`
    /// in its `extra_keys` (later events chain from it with no salt): only
    /// requests salted alike find the chain.
    #[test]
    fn salted_events_match_requests_of_the_same_tenant_only() {
        let scheduler = Scheduler::new(SchedulerConfig {
            token_block: BS,
            ..SchedulerConfig::default()
        });
        let mut ingest = Ingest::new(Arc::clone(scheduler.index()), MODEL);
        let (b, now) = (w(2, 0), Instant::now());
        let prompt: Vec<u32> = (300..316).collect();
        let mut first = stored_map(
            Value::Array(vec![sha_like(1), sha_like(2)]),
            Value::Nil,
            &prompt[..8],
        );
        let extra = Value::Array(vec![Value::Array(vec![s("tenant-a")]), Value::Nil]);
        if let Value::Map(fields) = &mut first {
            fields.push((s("extra_keys"), extra));
        }
        let rest = stored_map(
            Value::Array(vec![sha_like(3), sha_like(4)]),
            sha_like(2),
            &prompt[8..],
        );
        let batch = Vllm
            .decode(&batch_map(vec![first, rest], Value::from(0)))
            .unwrap();
        let KvEvent::BlockStored(e) = &batch.events[0] else {
            panic!("not a BlockStored");
        };
        assert_eq!(e.cache_salt.as_deref(), Some("tenant-a"));
        assert_eq!(ingest.apply(b, None, &batch, now).stored_blocks, 4);

        let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
        let overlap = |salt: &str| {
            let body = format!(
                r#"{{"model":"{MODEL}","prompt":[{}]{salt}}}"#,
                ids.join(",")
            );
            let req = parse(body.as_bytes(), Some(ApiKind::Completions)).unwrap();
            scheduler
                .index()
                .lookup(&scheduler.block_hashes(&req), &[b], now)[0]
        };
        assert_eq!(overlap(r#","cache_salt":"tenant-a""#), 4);
        assert_eq!(overlap(r#","nvext":{"cache_salt":"tenant-a"}"#), 4);
        assert_eq!(overlap(r#","cache_salt":"tenant-b""#), 0, "another tenant");
        assert_eq!(overlap(""), 0, "an unsalted request");
    }
}

// ---------------------------------------------------------------------------
// Hostile publishers: the transport's maximum message size.

/// A TCP listener that answers every connection with `wire` (then holds it
/// open); returns its port and how many connections it has accepted.
async fn hostile_publisher(wire: Vec<u8>) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let wire = wire.clone();
            tokio::spawn(async move {
                let _ = s.write_all(&wire).await;
                let mut sink = [0u8; 256];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    (port, accepted)
}

/// A ZMTP 3.0 PUB's greeting and READY, as libzmq sends them.
fn zmtp_pub_handshake() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    let body = [&b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"[..]].concat();
    g.extend_from_slice(&[0x04, body.len() as u8]);
    g.extend_from_slice(&body);
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frames_and_garbage_drop_their_publisher_while_a_good_one_keeps_flowing() {
    // One publisher declares a 2^62-byte frame after a valid handshake (before:
    // the ZMQ codec reserved it at once and the process aborted); another sends
    // bytes that are not ZMTP at all.
    let mut huge = zmtp_pub_handshake();
    huge.push(0x02);
    huge.extend_from_slice(&(1u64 << 62).to_be_bytes());
    let (huge_port, huge_conns) = hostile_publisher(huge).await;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: Vec<u8> = (0..65_536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let (garbage_port, garbage_conns) = hostile_publisher(garbage).await;
    // A third declares one frame just past the default maximum message size.
    let mut big = zmtp_pub_handshake();
    big.push(0x02);
    big.extend_from_slice(&(64u64 << 20).to_be_bytes());
    let (big_port, big_conns) = hostile_publisher(big).await;

    let (mut pub_socket, port) = publisher().await;
    let sink = Arc::new(MemorySink::default());
    let (events, _ingest) = start(&sink, None);
    let good = w(1, 0);
    let localhost: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let _subs: Vec<_> = [
        (good, port),
        (w(2, 0), huge_port),
        (w(3, 0), garbage_port),
        (w(4, 0), big_port),
    ]
    .into_iter()
    .map(|(worker, port)| {
        events.subscribe(Target {
            worker,
            engine: Engine::Vllm,
            host: localhost,
            port,
            replay_port: None,
        })
    })
    .collect();

    let a: Vec<u32> = (0..8).collect();
    let ha = chain(seed_of(MODEL, None), None, &a, BS);
    let first = batch_array(vec![stored_array(ints(&[1, 2]), Value::Nil, &a)], None);
    prime(&mut pub_socket, &sink, good, &first, &ha).await;

    // Each hostile publisher is dropped (it holds its end open) and reconnected
    // to, over and over.
    for (what, conns) in [
        ("huge frame", &huge_conns),
        ("garbage", &garbage_conns),
        ("frame past the maximum", &big_conns),
    ] {
        eventually(what, || {
            conns.load(std::sync::atomic::Ordering::SeqCst) >= 3
        })
        .await;
    }

    // The well-behaved publisher is still being ingested.
    let b: Vec<u32> = (100..108).collect();
    let hb = chain(seed_of(MODEL, None), None, &b, BS);
    pub_socket
        .send(frames(
            "",
            1,
            batch_array(vec![stored_array(ints(&[3, 4]), Value::Nil, &b)], None),
        ))
        .await
        .unwrap();
    eventually("batch after the hostile publishers", || {
        sink.depth(good, &hb) == 2
    })
    .await;
    assert!(sink.precise(good));
    assert_eq!(sink.depth(good, &ha), 2);
}

/// One worker's publisher floods large valid `BlockStored` batches (8,000
/// blocks with 32-byte hashes, about 370 kB each; the latency bound is one
/// batch's ingest, which for 30,000 blocks nears a second in a debug build) as
/// fast as ZMQ carries them.
/// The queued bytes never pass the budget, and another worker's events still
/// take effect within a second, 20 times over. Before the byte bound and the
/// per-worker turns, the queue held 4,096 batches of any size, in one FIFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_publisher_is_bounded_by_bytes_and_starves_no_other_worker() {
    const BUDGET: usize = 8 << 20;
    let (mut flood_socket, flood_port) = publisher().await;
    let (mut good_socket, good_port) = publisher().await;
    let sink = Arc::new(MemorySink::default());
    let metrics = KvEventMetrics::register(&Metrics::new("test"));
    let (events, _ingest) = KvEvents::start(
        Arc::clone(&sink) as Arc<dyn KvEventSink>,
        metrics,
        SubscriberConfig {
            model: MODEL.into(),
            connect_timeout: Duration::from_secs(2),
            retry_delay: Duration::from_millis(20),
            max_queued_bytes: BUDGET,
            ..SubscriberConfig::default()
        },
    );
    let (flooder, good) = (w(66, 0), w(7, 0));
    let _subs = [
        events.subscribe(loopback(flooder, flood_port, None)),
        events.subscribe(loopback(good, good_port, None)),
    ];
    let a: Vec<u32> = (0..8).collect();
    let ha = chain(seed_of(MODEL, None), None, &a, BS);
    let first = batch_array(vec![stored_array(ints(&[1, 2]), Value::Nil, &a)], None);
    prime(&mut good_socket, &sink, good, &first, &ha).await;

    let blocks = 4_000u64;
    let tokens: Vec<u32> = (0..(blocks as u32) * BS as u32).collect();
    let hashes = Value::Array((0..blocks).map(sha_like).collect());
    let big = Bytes::from(batch_array(
        vec![stored_array(hashes, Value::Nil, &tokens)],
        None,
    ));
    assert!(big.len() > 150_000, "{} bytes", big.len());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooding = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let msg = ZmqMessage::try_from(vec![
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    big.clone(),
                ])
                .unwrap();
                flood_socket.send(msg).await.unwrap();
                seq += 1;
                if seq % 8 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    eventually("the flood filling the queue", || {
        events.queued_bytes().1 > BUDGET / 2
    })
    .await;

    let mut slowest = Duration::ZERO;
    for i in 1..=20u32 {
        let toks: Vec<u32> = (1_000_000 + i * 8..1_000_000 + i * 8 + 8).collect();
        let expect = chain(seed_of(MODEL, None), None, &toks, BS);
        let payload = batch_array(
            vec![stored_array(
                ints(&[u64::from(i) * 10, u64::from(i) * 10 + 1]),
                Value::Nil,
                &toks,
            )],
            None,
        );
        let sent = Instant::now();
        good_socket
            .send(frames("", u64::from(i), payload))
            .await
            .unwrap();
        while sink.depth(good, &expect) != 2 {
            assert!(
                sent.elapsed() < Duration::from_secs(1),
                "round {i}: the other worker's event waited over 1 s behind the flood"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        slowest = slowest.max(sent.elapsed());
        let (_, peak) = events.queued_bytes();
        assert!(peak <= BUDGET, "round {i}: {peak} bytes queued");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flooding.await.unwrap();
    let (_, peak) = events.queued_bytes();
    assert!(peak <= BUDGET, "{peak} bytes queued, budget {BUDGET}");
    assert!(
        sink.precise(good) && sink.depth(good, &ha) == 2,
        "never reset"
    );
    assert!(sink.clears(flooder) > 1, "the flooder was reset");
    eprintln!("slowest event of the other worker: {slowest:?}; peak queued {peak} bytes");
}
