//! KV events, engine by engine: one decoder per engine format behind
//! [`EventDecoder`], each producing the same normalised [`EventBatch`]. Pure: bytes
//! in, events out, no I/O (the `kvpick` crate subscribes to the streams and
//! applies the events to the prefix index).
//!
//! - [`vllm`]: vLLM's msgspec/msgpack batches;
//! - [`sglang`]: SGLang's, the same shape with its own storage-tier names;
//! - [`trtllm`]: TensorRT-LLM, whose `trtllm-serve` publishes no event stream;
//! - [`event`]: the normalised events and the decoder trait;
//! - [`msgpack`]: the reader of the shape vLLM and SGLang share;
//! - [`frames`]: the ZMQ message's topic and sequence frames.
//!
//! [`decoder`] picks an engine's decoder; adding an engine's format is a file
//! here and one arm there. A normalised event keeps the storage tier its blocks
//! are on ([`StorageTier`]): the prefix index keeps each tier's copies apart
//! (`kv::tier`), and routing counts a lower tier's blocks as partial hits.

pub mod event;
pub mod frames;
pub mod msgpack;
pub mod sglang;
pub mod trtllm;
pub mod vllm;

pub use event::{
    BlockRemoved, BlockStored, DecodeError, EventBatch, EventDecoder, KvEvent, StorageTier,
};
pub use frames::{decode_seq, parse_topic, Topic};

use crate::endpoints::Engine;

/// The decoder of `engine`'s KV events.
pub fn decoder(engine: Engine) -> &'static dyn EventDecoder {
    match engine {
        Engine::Vllm => &vllm::Vllm,
        Engine::Sglang => &sglang::Sglang,
        Engine::Trtllm => &trtllm::Trtllm,
    }
}
