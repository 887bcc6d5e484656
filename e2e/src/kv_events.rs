//! KV events in vLLM's wire format, published over ZMQ PUB.
//!
//! Each message has three frames: the topic, an 8-byte big-endian sequence
//! number, and a msgpack payload. The payload is vLLM's `KVEventBatch` encoded
//! by msgspec with `array_like=True` (structs as arrays, tagged unions as arrays
//! whose first element is the class name):
//!
//! ```text
//! [ts: float, events: [event...], data_parallel_rank: int | nil]
//! ["BlockStored", [block_hash...], parent_block_hash | nil, [token_id...], block_size, lora_id | nil, medium | nil]
//! ["BlockRemoved", [block_hash...], medium | nil]
//! ["AllBlocksCleared"]
//! ```
//!
//! `medium` is `GPU` for the GPU pool's blocks and `CPU` for the offload
//! tier's copies, which go out as vLLM's CPU offloading connector publishes
//! them: engine hashes only (no parent, no tokens).

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use tracing::{debug, warn};
use zeromq::{Socket, SocketSend, ZmqMessage};

use crate::kvcache::CacheEvent;

/// The storage medium an event names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// The GPU pool.
    Gpu,
    /// The CPU offload tier.
    Cpu,
}

impl Medium {
    /// vLLM's name of it.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

/// One event of a batch, as the engine publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored {
        /// Block hashes, prefix order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first, if any.
        parent_block_hash: Option<u64>,
        /// The tokens of the stored blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Where the blocks are.
        medium: Medium,
    },
    /// Blocks removed.
    BlockRemoved {
        /// Block hashes.
        block_hashes: Vec<u64>,
        /// Where they were.
        medium: Medium,
    },
    /// The whole cache was cleared.
    AllBlocksCleared,
}

impl KvEvent {
    /// The engine event for a cache change.
    pub fn from_cache(event: &CacheEvent, block_size: usize) -> KvEvent {
        match event {
            CacheEvent::Stored {
                hashes,
                parent,
                tokens,
            } => KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: *parent,
                token_ids: tokens.clone(),
                block_size: block_size as u32,
                medium: Medium::Gpu,
            },
            CacheEvent::Removed(hashes) => KvEvent::BlockRemoved {
                block_hashes: hashes.clone(),
                medium: Medium::Gpu,
            },
            CacheEvent::Offloaded(hashes) => KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: block_size as u32,
                medium: Medium::Cpu,
            },
            CacheEvent::OffloadDropped(hashes) => KvEvent::BlockRemoved {
                block_hashes: hashes.clone(),
                medium: Medium::Cpu,
            },
        }
    }

    fn to_value(&self) -> Value {
        let hashes = |h: &[u64]| Value::Array(h.iter().map(|&x| Value::from(x)).collect());
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => Value::Array(vec![
                Value::from("BlockStored"),
                hashes(block_hashes),
                parent_block_hash.map_or(Value::Nil, Value::from),
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                Value::from(*block_size),
                Value::Nil,
                Value::from(medium.as_str()),
            ]),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => Value::Array(vec![
                Value::from("BlockRemoved"),
                hashes(block_hashes),
                Value::from(medium.as_str()),
            ]),
            KvEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
        }
    }
}

/// Encodes a `KVEventBatch` payload.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(KvEvent::to_value).collect()),
        dp_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

/// Seconds since the Unix epoch, as vLLM stamps batches.
pub fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A running ZMQ PUB publisher; batches sent to it go out in order with
/// consecutive sequence numbers starting at 0.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<(Vec<KvEvent>, Option<u32>)>,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Binding the PUB socket failed.
    #[error("cannot bind the KV-event socket on {endpoint}")]
    Bind {
        /// The ZMQ endpoint.
        endpoint: String,
        /// The ZMQ error.
        source: zeromq::ZmqError,
    },
}

impl Publisher {
    /// Binds a PUB socket on `host:port` (port 0 for any) and starts publishing;
    /// returns the publisher, the bound port, and the task to abort on shutdown.
    pub async fn bind(
        host: &str,
        port: u16,
        topic: String,
    ) -> Result<(Publisher, u16, tokio::task::JoinHandle<()>), PublishError> {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = format!("tcp://{host}:{port}");
        let bound = socket
            .bind(&endpoint)
            .await
            .map_err(|source| PublishError::Bind { endpoint, source })?;
        let port = match bound {
            zeromq::Endpoint::Tcp(_, p) => p,
            _ => port,
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<KvEvent>, Option<u32>)>();
        let task = tokio::spawn(async move {
            let mut seq: u64 = 0;
            while let Some((events, dp_rank)) = rx.recv().await {
                let payload = encode_batch(now_ts(), &events, dp_rank);
                let frames = vec![
                    Bytes::from(topic.clone().into_bytes()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                let msg = ZmqMessage::try_from(frames).expect("three frames are never empty");
                if let Err(e) = socket.send(msg).await {
                    warn!(error = %e, "KV-event publish failed");
                }
                debug!(seq, events = events.len(), "published KV events");
                seq += 1;
            }
        });
        Ok((Publisher { tx }, port, task))
    }

    /// Queues a batch from data-parallel rank `dp_rank` (`None` for a worker
    /// without data parallelism); dropped silently when the publisher has
    /// stopped, as a PUB socket drops.
    pub fn publish(&self, events: Vec<KvEvent>, dp_rank: Option<u32>) {
        if !events.is_empty() {
            let _ = self.tx.send((events, dp_rank));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_layout_matches_msgspec_array_like() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![5, 6],
                block_size: 16,
                medium: Medium::Gpu,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![7],
                medium: Medium::Cpu,
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_batch(1.5, &events, Some(0));
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let top = v.as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].as_f64(), Some(1.5));
        assert_eq!(top[2].as_u64(), Some(0));
        let ev = top[1].as_array().unwrap();
        let stored = ev[0].as_array().unwrap();
        assert_eq!(stored[0].as_str(), Some("BlockStored"));
        assert_eq!(stored[1].as_array().unwrap()[1].as_u64(), Some(u64::MAX));
        assert!(stored[2].is_nil());
        assert_eq!(stored[3].as_array().unwrap().len(), 2);
        assert_eq!(stored[4].as_u64(), Some(16));
        assert!(stored[5].is_nil());
        assert_eq!(stored[6].as_str(), Some("GPU"));
        let removed = ev[1].as_array().unwrap();
        assert_eq!(removed[0].as_str(), Some("BlockRemoved"));
        assert_eq!(removed.len(), 3);
        assert_eq!(removed[2].as_str(), Some("CPU"));
        assert_eq!(ev[2].as_array().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn publishes_three_frames_with_sequence_numbers() {
        use zeromq::SocketRecv;
        let (publisher, port, task) = Publisher::bind("127.0.0.1", 0, "kv".into()).await.unwrap();
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        // A SUB socket only gets messages after its subscription reached the PUB side.
        let mut got = None;
        for _ in 0..100 {
            publisher.publish(vec![KvEvent::AllBlocksCleared], None);
            if let Ok(Ok(m)) =
                tokio::time::timeout(std::time::Duration::from_millis(20), sub.recv()).await
            {
                got = Some(m);
                break;
            }
        }
        let msg = got.expect("no KV event arrived");
        assert_eq!(msg.len(), 3);
        assert_eq!(msg.get(0).unwrap().as_ref(), b"kv");
        assert_eq!(msg.get(1).unwrap().len(), 8);
        let v = rmpv::decode::read_value(&mut &msg.get(2).unwrap()[..]).unwrap();
        assert!(v.as_array().unwrap()[2].is_nil());
        task.abort();
    }
}
