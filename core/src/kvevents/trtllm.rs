//! TensorRT-LLM: `trtllm-serve` keeps its KV-cache events in process (the
//! executor's event manager) and publishes no stream of them, so there is
//! nothing to subscribe to and its workers are routed in approximate mode. A
//! reader of a TensorRT-LLM event stream goes here, with [`EventDecoder::publishes`]
//! turned true.

use super::event::{DecodeError, EventBatch, EventDecoder};

/// The TensorRT-LLM decoder.
#[derive(Debug, Clone, Copy, Default)]
pub struct Trtllm;

impl EventDecoder for Trtllm {
    fn publishes(&self) -> bool {
        false
    }

    fn decode(&self, _payload: &[u8]) -> Result<EventBatch, DecodeError> {
        Err(DecodeError::NoStream("TensorRT-LLM"))
    }
}
