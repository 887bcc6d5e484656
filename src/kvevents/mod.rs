//! Precise mode: what each worker's KV cache holds, from the engines' own KV events.
//!
//! vLLM and SGLang publish `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
//! events over ZMQ PUB. Each engine's format has its decoder in the core
//! ([`kvpick_core::kvevents`], re-exported here: [`decoder`] picks it), which
//! gives the same normalised events for every engine. kvpick keeps one
//! subscriber per ready (worker, dp rank) of an engine that publishes
//! ([`subscriber`]), queues each message with its engine ([`queue`]), and the
//! ingest thread decodes it with that engine's decoder and applies the events
//! to the prefix index through [`KvEventSink`] ([`Ingest`]); [`metrics`] counts
//! what happened.
//!
//! Keys: kvpick hashes each stored block itself, from the event's `token_ids`, with
//! the same chained function the request side uses, so a request's token blocks
//! find the blocks the engine reported. The engine's block hash is kept only to
//! find the block again when it is removed, and to continue a chain: the parent of
//! a `BlockStored` is looked up in the sink's own engine → kvpick hash map
//! ([`KvEventSink::engine_block`]), which the index's precise cap bounds. A
//! `BlockStored` whose parent is unknown (its parent was stored before kvpick
//! subscribed, was lost in a gap, or was dropped by the cap) cannot be chained and
//! is skipped (counted as orphan blocks); the engine re-stores the chain on the
//! next prompt that reaches it.
//!
//! Tiers: blocks a worker copies to CPU memory or disk (vLLM's `medium`,
//! SGLang's HiCache host tiers) are its copies of blocks its GPU events
//! stored, found by engine hash in what the GPU events placed; each tier's
//! `BlockRemoved` drops that tier's copies only ([`crate::kv::tier`]).

pub use kvpick_core::kvevents::*;

pub mod metrics;
pub mod queue;
pub mod subscriber;
pub mod zmtp;

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use crate::endpoints::WorkerKey;
use crate::kv::hash::{mm_block_hash, model_seed, salted_seed, token_block_hashes};
use crate::kv::index::{PrefixIndex, TierStore};
use crate::kv::tier::Tier;
use crate::multimodal::routing::normalize_vllm_block;
use crate::scheduler::Scheduler;

/// Where ingested events go: the prefix index plus the block hash function it uses.
/// Implemented for the scheduler core's `PrefixIndex` and for the `Scheduler` (which
/// also ends its provisional entries); tests use an in-memory sink.
///
/// Blocks are seeded with `seed(model, None)` where `model` is what requests for
/// those blocks carry in their `model` field: the LoRA adapter's name for adapter
/// blocks, else the topic's model or the configured model name; a chain whose
/// first block's `extra_keys` carry a cache salt folds it in (`kv::hash::salted_seed`),
/// as the request side does.
pub trait KvEventSink: Send + Sync {
    /// The chain seed for a model and LoRA adapter (`kv::hash::model_seed`).
    fn seed(&self, model: &str, lora: Option<&str>) -> u64 {
        model_seed(model, lora)
    }
    /// Chained hashes of the full blocks of `tokens`, chaining from `parent` or
    /// from `seed` (`kv::hash::token_block_hashes`).
    fn block_hashes(
        &self,
        seed: u64,
        parent: Option<u64>,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<u64> {
        token_block_hashes(seed, parent, tokens, block_size)
    }
    /// The key of one block that carries multimodal hashes it cannot be rewritten
    /// into pad values with (`kv::hash::mm_block_hash`).
    fn mm_block_hash(&self, parent: u64, tokens: &[u32], mm_hashes: &[u64]) -> u64 {
        mm_block_hash(parent, tokens, mm_hashes)
    }
    /// The kvpick hash of the block `worker` holds under `engine_hash`, if it
    /// holds one (the parent of a stored chain).
    fn engine_block(&self, worker: WorkerKey, engine_hash: u64) -> Option<u64>;
    /// Records that `worker` holds these (engine hash, kvpick hash) blocks, a
    /// chain following the block it holds under engine hash `parent` (`None`:
    /// from the chain's first block).
    fn store_engine_chain(
        &self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
        now: Instant,
    );
    /// Forgets the blocks the engine removed, by engine hash.
    fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]);
    /// Records that `worker` copied these blocks (by engine hash) to a lower
    /// `tier`, each covering `span` blocks of its chain
    /// ([`PrefixIndex::store_tier_copies`]).
    fn store_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
        span: usize,
    ) -> TierStore;
    /// Forgets `worker`'s copies of these blocks (by engine hash) on a lower
    /// `tier`; returns how many blocks it no longer holds there.
    fn remove_tier_copies(&self, worker: WorkerKey, tier: Tier, engine_hashes: &[u64]) -> usize;
    /// Forgets everything about `worker`.
    fn clear_worker(&self, worker: WorkerKey);
    /// Switches `worker` between precise (event-fed) and approximate mode.
    fn set_precise(&self, worker: WorkerKey, precise: bool);
}

impl KvEventSink for PrefixIndex {
    fn engine_block(&self, worker: WorkerKey, engine_hash: u64) -> Option<u64> {
        PrefixIndex::engine_block(self, worker, engine_hash)
    }
    fn store_engine_chain(
        &self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
        now: Instant,
    ) {
        PrefixIndex::store_engine_chain(self, worker, parent, blocks, now)
    }
    fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]) {
        PrefixIndex::remove_engine_blocks(self, worker, engine_hashes);
    }
    fn store_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
        span: usize,
    ) -> TierStore {
        PrefixIndex::store_tier_copies(self, worker, tier, engine_hashes, span)
    }
    fn remove_tier_copies(&self, worker: WorkerKey, tier: Tier, engine_hashes: &[u64]) -> usize {
        PrefixIndex::remove_tier_copies(self, worker, tier, engine_hashes)
    }
    fn clear_worker(&self, worker: WorkerKey) {
        PrefixIndex::clear_worker(self, worker)
    }
    fn set_precise(&self, worker: WorkerKey, precise: bool) {
        PrefixIndex::set_precise(self, worker, precise)
    }
}

/// The scheduler as a sink: its prefix index, and the provisional entries of
/// prompts routed to a precise worker end when that worker's events store or
/// remove their blocks (`Scheduler::settle_provisional`) or clear its cache
/// (`Scheduler::clear_provisional`).
impl KvEventSink for Scheduler {
    fn engine_block(&self, worker: WorkerKey, engine_hash: u64) -> Option<u64> {
        self.index().engine_block(worker, engine_hash)
    }
    fn store_engine_chain(
        &self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[(u64, u64)],
        now: Instant,
    ) {
        self.index().store_engine_chain(worker, parent, blocks, now);
        let ours: Vec<u64> = blocks.iter().map(|&(_, h)| h).collect();
        self.settle_provisional(worker, &ours);
    }
    fn remove_engine_blocks(&self, worker: WorkerKey, engine_hashes: &[u64]) {
        let ours = self.index().remove_engine_blocks(worker, engine_hashes);
        self.settle_provisional(worker, &ours);
    }
    fn store_tier_copies(
        &self,
        worker: WorkerKey,
        tier: Tier,
        engine_hashes: &[u64],
        span: usize,
    ) -> TierStore {
        self.index()
            .store_tier_copies(worker, tier, engine_hashes, span)
    }
    fn remove_tier_copies(&self, worker: WorkerKey, tier: Tier, engine_hashes: &[u64]) -> usize {
        self.index().remove_tier_copies(worker, tier, engine_hashes)
    }
    fn clear_worker(&self, worker: WorkerKey) {
        self.index().clear_worker(worker);
        self.clear_provisional(worker);
    }
    fn set_precise(&self, worker: WorkerKey, precise: bool) {
        self.index().set_precise(worker, precise)
    }
}

/// What applying one batch did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Events in the batch.
    pub events: u64,
    /// Blocks added to the index.
    pub stored_blocks: u64,
    /// Blocks removed from the index.
    pub removed_blocks: u64,
    /// Blocks skipped because their parent is unknown (or, copied to a lower
    /// tier, because the GPU events never placed them).
    pub orphan_blocks: u64,
    /// Blocks a lower tier now holds (copies of GPU blocks).
    pub tier_blocks: u64,
    /// Events skipped: tiers kvpick has no name for, other KV-cache groups,
    /// unknown types.
    pub ignored_events: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
    /// Stored blocks with images whose hashes kvpick issued (matchable).
    pub mm_blocks: u64,
    /// Stored blocks with images vLLM hashed itself (no kvpick request matches them).
    pub mm_native_blocks: u64,
    /// Stored blocks whose image tokens could not be paired with their hashes.
    pub mm_unmapped_blocks: u64,
}

impl ApplyStats {
    fn add(&mut self, o: ApplyStats) {
        self.events += o.events;
        self.stored_blocks += o.stored_blocks;
        self.removed_blocks += o.removed_blocks;
        self.orphan_blocks += o.orphan_blocks;
        self.tier_blocks += o.tier_blocks;
        self.ignored_events += o.ignored_events;
        self.clears += o.clears;
        self.mm_blocks += o.mm_blocks;
        self.mm_native_blocks += o.mm_native_blocks;
        self.mm_unmapped_blocks += o.mm_unmapped_blocks;
    }
}

/// Applies decoded batches to a [`KvEventSink`]; chains continue across events
/// through the sink's engine → kvpick hash map.
pub struct Ingest<S: ?Sized> {
    sink: std::sync::Arc<S>,
    default_model: String,
    live: HashSet<WorkerKey>,
    image_token: Option<u32>,
    /// Each live worker's GPU block size (tokens), from its GPU `BlockStored`:
    /// a lower tier's block may span several.
    gpu_block_size: HashMap<WorkerKey, usize>,
}

impl<S: KvEventSink + ?Sized> Ingest<S> {
    /// Ingest into `sink`; blocks are seeded with `default_model` unless the
    /// message topic (`kv@<pod>@<model>`) names the model.
    pub fn new(sink: std::sync::Arc<S>, default_model: impl Into<String>) -> Self {
        Ingest {
            sink,
            default_model: default_model.into(),
            live: HashSet::new(),
            image_token: None,
            gpu_block_size: HashMap::new(),
        }
    }

    /// The model's image token id: vLLM blocks with `extra_keys` mm hashes get
    /// their image-token runs rewritten into pad values (SGLang's form, which is
    /// what requests are hashed in). Without it such blocks never match.
    pub fn with_image_token(mut self, image_token: Option<u32>) -> Self {
        self.image_token = image_token;
        self
    }

    /// Applies one batch from `worker`; `model` is the topic's model, if any.
    pub fn apply(
        &mut self,
        worker: WorkerKey,
        model: Option<&str>,
        batch: &EventBatch,
        now: Instant,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for event in &batch.events {
            let s = match event {
                KvEvent::BlockStored(e) => self.stored(worker, model, e, now),
                KvEvent::BlockRemoved(e) => self.removed(worker, e),
                KvEvent::AllBlocksCleared => {
                    self.reset(worker);
                    ApplyStats {
                        clears: 1,
                        ..Default::default()
                    }
                }
                KvEvent::Unknown(_) => ApplyStats {
                    ignored_events: 1,
                    ..Default::default()
                },
            };
            stats.add(s);
            stats.events += 1;
        }
        stats
    }

    /// Forgets everything known about `worker` (gap, restart, reconnect, clear);
    /// a worker with a live stream stays precise.
    pub fn reset(&mut self, worker: WorkerKey) {
        self.sink.clear_worker(worker);
        if self.live.contains(&worker) {
            self.sink.set_precise(worker, true);
        }
    }

    /// A stream from `worker` (re)connected (`live`) or was lost: its index part
    /// starts over, precise while live and approximate otherwise.
    pub fn set_live(&mut self, worker: WorkerKey, live: bool) {
        if live {
            self.live.insert(worker);
        } else {
            self.live.remove(&worker);
            self.gpu_block_size.remove(&worker);
        }
        self.reset(worker);
        self.sink.set_precise(worker, live);
    }

    fn stored(
        &mut self,
        worker: WorkerKey,
        model: Option<&str>,
        e: &BlockStored,
        now: Instant,
    ) -> ApplyStats {
        match routing_tier(&e.tier, e.group_idx) {
            None => {
                return ApplyStats {
                    ignored_events: 1,
                    ..Default::default()
                }
            }
            Some(Tier::Gpu) => {
                self.gpu_block_size.insert(worker, e.block_size);
            }
            Some(tier) => return self.copied(worker, tier, e),
        }
        let parent = match e.parent_block_hash {
            None => None,
            Some(p) => match self.sink.engine_block(worker, p) {
                Some(k) => Some(k),
                None => {
                    return ApplyStats {
                        orphan_blocks: e.block_hashes.len() as u64,
                        ..Default::default()
                    }
                }
            },
        };
        // The request side seeds with the request's `model`, which names the LoRA
        // adapter for adapter requests: seed adapter blocks with the adapter name.
        let by_id;
        let seed_model = match (&e.lora_name, e.lora_id) {
            (Some(name), _) => name.as_str(),
            // Older engines send only the numeric id: keep those blocks apart from
            // the base model's even though no request names them this way.
            (None, Some(id)) => {
                by_id = format!("lora-id:{id}");
                by_id.as_str()
            }
            (None, None) => model.unwrap_or(&self.default_model),
        };
        // A chain's first block carries the request's salt (vLLM folds it into
        // that block only); later blocks inherit it through their parent.
        let salt = e.cache_salt.as_deref().filter(|_| parent.is_none());
        let seed = salted_seed(self.sink.seed(seed_model, None), salt);
        let mut mm = ApplyStats::default();
        let ours = if e.block_mm_hashes.is_empty() {
            self.sink
                .block_hashes(seed, parent, &e.token_ids, e.block_size)
        } else {
            mm_stored_hashes(&*self.sink, self.image_token, seed, parent, e, &mut mm)
        };
        let pairs: Vec<(u64, u64)> = e.block_hashes.iter().copied().zip(ours).collect();
        self.sink
            .store_engine_chain(worker, e.parent_block_hash, &pairs, now);
        ApplyStats {
            stored_blocks: pairs.len() as u64,
            // Engine hashes without full token blocks behind them cannot be keyed.
            orphan_blocks: (e.block_hashes.len() - pairs.len()) as u64,
            ..mm
        }
    }

    /// A `BlockStored` on a lower tier: copies of blocks the GPU events
    /// placed. vLLM's offloading connector names them by engine hash alone
    /// (no tokens, no parent), an offloaded block spanning as many GPU blocks
    /// as its block size holds GPU blocks, named by the last one's hash.
    fn copied(&mut self, worker: WorkerKey, tier: Tier, e: &BlockStored) -> ApplyStats {
        let span = match self.gpu_block_size.get(&worker) {
            Some(&gpu) if gpu > 0 && e.block_size % gpu == 0 => e.block_size / gpu,
            _ => 1,
        };
        let s = self
            .sink
            .store_tier_copies(worker, tier, &e.block_hashes, span);
        ApplyStats {
            tier_blocks: s.stored as u64,
            orphan_blocks: s.orphans as u64,
            ..Default::default()
        }
    }

    /// A `BlockRemoved` drops the named tier's copies only.
    fn removed(&mut self, worker: WorkerKey, e: &BlockRemoved) -> ApplyStats {
        let removed = match routing_tier(&e.tier, e.group_idx) {
            None => {
                return ApplyStats {
                    ignored_events: 1,
                    ..Default::default()
                }
            }
            Some(Tier::Gpu) => {
                self.sink.remove_engine_blocks(worker, &e.block_hashes);
                e.block_hashes.len()
            }
            Some(tier) => self.sink.remove_tier_copies(worker, tier, &e.block_hashes),
        };
        ApplyStats {
            removed_blocks: removed as u64,
            ..Default::default()
        }
    }
}

/// kvpick's keys for a vLLM `BlockStored` whose `extra_keys` carry mm hashes:
/// block by block, image-token runs become the pad values of the block's hashes
/// (then the block hashes like any token block, as SGLang's and the request's
/// do); blocks that cannot be paired are keyed by `mm_block_hash`.
fn mm_stored_hashes<S: KvEventSink + ?Sized>(
    sink: &S,
    image_token: Option<u32>,
    seed: u64,
    parent: Option<u64>,
    e: &BlockStored,
    stats: &mut ApplyStats,
) -> Vec<u64> {
    let bs = e.block_size.max(1);
    let mut out = Vec::with_capacity(e.token_ids.len() / bs);
    let mut prev = parent;
    let mut block = Vec::with_capacity(bs);
    for (i, chunk) in e.token_ids.chunks_exact(bs).enumerate() {
        block.clear();
        block.extend_from_slice(chunk);
        let keys = e.block_mm_hashes.get(i).map_or(&[][..], Vec::as_slice);
        let hashes: Vec<u64> = keys.iter().map(|k| k.mm_hash).collect();
        let h = if hashes.is_empty() {
            sink.block_hashes(seed, prev, &block, bs)[0]
        } else {
            if keys.iter().all(|k| k.issued) {
                stats.mm_blocks += 1;
            } else {
                stats.mm_native_blocks += 1;
            }
            match image_token {
                Some(img) if normalize_vllm_block(&mut block, img, &hashes) => {
                    sink.block_hashes(seed, prev, &block, bs)[0]
                }
                _ => {
                    stats.mm_unmapped_blocks += 1;
                    sink.mm_block_hash(prev.unwrap_or(seed), &block, &hashes)
                }
            }
        };
        out.push(h);
        prev = Some(h);
    }
    out
}

/// The tier an event's blocks count on for routing: blocks of the first
/// KV-cache group (group absent or 0; hybrid models repeat every block once
/// per group) on a tier kvpick names (`None`: the event is ignored). Each
/// tier has its own removal stream.
fn routing_tier(tier: &StorageTier, group: Option<i64>) -> Option<Tier> {
    Tier::of(tier).filter(|_| group.is_none_or(|g| g == 0))
}

/// How a sequence number relates to the previous one on the same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first message since (re)connecting.
    First,
    /// Exactly the next one.
    Next,
    /// Messages `from..to` (exclusive) were missed.
    Gap {
        /// First missing sequence number.
        from: u64,
        /// The sequence number that arrived.
        to: u64,
    },
    /// The sequence went backwards or repeated: the publisher restarted.
    Restart,
}

/// Tracks one publisher's sequence numbers.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Classifies `seq` and records it as the latest.
    pub fn observe(&mut self, seq: u64) -> SeqCheck {
        let check = match self.last {
            None => SeqCheck::First,
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::Next,
            Some(last) if seq > last => SeqCheck::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) => SeqCheck::Restart,
        };
        self.last = Some(seq);
        check
    }

    /// The last sequence number seen.
    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_tracker_classifies() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(5), SeqCheck::First);
        assert_eq!(t.observe(6), SeqCheck::Next);
        assert_eq!(t.observe(9), SeqCheck::Gap { from: 7, to: 9 });
        assert_eq!(t.observe(9), SeqCheck::Restart);
        assert_eq!(t.observe(0), SeqCheck::Restart);
        assert_eq!(t.observe(1), SeqCheck::Next);
        assert_eq!(t.last(), Some(1));
    }

    /// Through the scheduler as a sink, a prompt routed to a precise worker is
    /// credited there until the worker's events store its blocks, and not after
    /// the worker removes them, though its provisional TTL has not run out.
    #[test]
    fn the_scheduler_sink_ends_provisional_entries_at_the_events() {
        use crate::endpoints::{Endpoint, EndpointTable};
        use crate::scheduler::{PickRequest, SchedulerConfig};
        use std::time::Duration;

        let s = Scheduler::new(SchedulerConfig {
            provisional_ttl: Duration::from_secs(60),
            ..Default::default()
        });
        let t = EndpointTable::new();
        t.replace(vec![Endpoint::new("10.0.0.1:80".parse().unwrap())]);
        let snap = t.snapshot();
        let worker = snap.endpoints[0].key(0);
        s.set_precise(worker, true);
        let body = crate::request::parse(
            serde_json::json!({"model": "m", "prompt": "e".repeat(64 * 4)})
                .to_string()
                .as_bytes(),
            None,
        )
        .unwrap();
        let req = PickRequest {
            body: Some(&body),
            ..Default::default()
        };
        let now = Instant::now();
        let routed = s.pick_at(&req, &snap, now).unwrap();
        s.finish_at(&routed, Some(200), now);
        let overlap = || s.explain(&req, &snap, now).unwrap().candidates[0].overlap_blocks;
        assert_eq!(overlap(), 4, "provisional, no event yet");
        let ours = s.block_hashes(&body);
        let pairs: Vec<(u64, u64)> = (100..).zip(ours.iter().copied()).collect();
        s.store_engine_chain(worker, None, &pairs, now);
        assert_eq!(overlap(), 4, "held by the events now");
        s.remove_engine_blocks(worker, &[102, 103]);
        assert_eq!(
            overlap(),
            2,
            "evicted blocks are not credited provisionally"
        );
        s.remove_engine_blocks(worker, &[100, 101]);
        assert_eq!(overlap(), 0);
    }

    #[test]
    fn routing_tiers() {
        assert_eq!(routing_tier(&StorageTier::Gpu, None), Some(Tier::Gpu));
        assert_eq!(routing_tier(&StorageTier::Gpu, Some(0)), Some(Tier::Gpu));
        assert_eq!(routing_tier(&StorageTier::Cpu, None), Some(Tier::Cpu));
        assert_eq!(routing_tier(&StorageTier::Disk, Some(0)), Some(Tier::Disk));
        assert_eq!(routing_tier(&StorageTier::Other("x".into()), None), None);
        assert_eq!(routing_tier(&StorageTier::Gpu, Some(1)), None);
        assert_eq!(routing_tier(&StorageTier::Cpu, Some(1)), None);
    }
}
