//! The normalised KV events every engine's decoder produces, and the decoder
//! trait ([`EventDecoder`]).

use crate::multimodal::identity::ExtraKeyHash;

/// Reads one engine's KV-event messages.
pub trait EventDecoder: Send + Sync {
    /// Whether the engine publishes its KV events on a ZMQ PUB socket of its
    /// own, for kvpick to subscribe to.
    fn publishes(&self) -> bool;
    /// Decodes one message's payload into normalised events.
    fn decode(&self, payload: &[u8]) -> Result<EventBatch, DecodeError>;
}

/// The storage tier a block is on. Engines that name none mean the GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StorageTier {
    /// GPU memory: what a request is served from without a copy.
    #[default]
    Gpu,
    /// Host (CPU) memory.
    Cpu,
    /// Local disk.
    Disk,
    /// A tier this decoder has no name for (the engine's name).
    Other(String),
}

/// Why a message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The multipart message does not have the (topic, seq, payload) frames.
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame must be 8 bytes, got {0}")]
    SeqLength(usize),
    /// The payload is not valid msgpack.
    #[error("payload is not msgpack")]
    Msgpack(#[source] rmpv::decode::Error),
    /// The payload is msgpack but not an event batch.
    #[error("malformed event batch: {0}")]
    Batch(&'static str),
    /// An event of a known type lacks a field or has one of the wrong type.
    #[error("malformed {event} event: field `{field}`")]
    Event {
        /// Event type.
        event: &'static str,
        /// Offending field.
        field: &'static str,
    },
    /// The engine publishes no KV-event stream kvpick can read.
    #[error("{0} publishes no KV events kvpick reads")]
    NoStream(&'static str),
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were filled and are now cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was reset.
    AllBlocksCleared,
    /// An event type this decoder does not know (its tag), ignored by ingest.
    Unknown(String),
}

/// `BlockStored`: full blocks whose KV is now in the cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one; `None` at the start of a prompt.
    pub parent_block_hash: Option<u64>,
    /// Token ids of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter id (deprecated by vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// The storage tier the blocks were stored on.
    pub tier: StorageTier,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// KV-cache group of hybrid models; `None` for single-group models.
    pub group_idx: Option<i64>,
    /// Multimodal hashes per block, from vLLM's `extra_keys` (64-character hex
    /// strings; LoRA names, cache salts and prompt-embedding keys are left out).
    /// Empty when no block has one; otherwise one entry per block, in order.
    pub block_mm_hashes: Vec<Vec<ExtraKeyHash>>,
    /// The request's `cache_salt`, from the first block's `extra_keys`: vLLM
    /// adds it there (after the LoRA name and mm hashes) when the block starts
    /// the prompt. Only meaningful without a parent.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// The storage tier the blocks were removed from.
    pub tier: StorageTier,
    /// KV-cache group of hybrid models.
    pub group_idx: Option<i64>,
}

/// A decoded event batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher timestamp (seconds since the Unix epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank that published the batch, when given.
    pub dp_rank: Option<u32>,
}
