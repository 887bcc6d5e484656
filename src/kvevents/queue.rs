//! The ingest queue between the subscriber tasks and the `kv-ingest` thread:
//! one FIFO per worker rank, served round-robin, all of them bounded together
//! by bytes.
//!
//! Invariants:
//! - The queued batches' bytes (payload, topic and [`BATCH_OVERHEAD`] each)
//!   never exceed the budget. A batch that does not fit makes room by dropping
//!   every queued batch of the rank holding the most bytes (the incoming
//!   batch counted with its sender); when that is the sender, its batch is
//!   dropped too. A dropped rank gets a [`Item::Reset`] in its place, so the
//!   batches it sends next apply to an index part that starts over. One
//!   flooding publisher thus loses its own batches, never another's.
//! - Items of one rank are applied in the order they were queued; ranks take
//!   turns, one item each, so a rank's event waits behind at most one item of
//!   each other rank, however many a flooding one has queued.
//! - Control items (live, forget, reset, flush) take no budget and are never
//!   dropped: they come at most once per connection attempt, which backs off.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use prometheus_client::encoding::EncodeLabelValue;
use prometheus_client::metrics::gauge::Gauge;

use crate::endpoints::{Engine, WorkerKey};

/// Bytes a queued batch costs beyond its payload and topic: the item itself
/// and its place in the queue, so a flood of empty messages is bounded too.
pub const BATCH_OVERHEAD: usize = 128;

/// Why a worker's part of the index was reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum ResetReason {
    /// A new connection: events before it are unknown.
    Connect,
    /// The connection was lost.
    Disconnect,
    /// Sequence numbers were skipped and could not be replayed.
    Gap,
    /// The sequence went backwards: the engine restarted.
    Restart,
    /// The ingest queue was full and batches were dropped.
    Overflow,
    /// The engine sent `AllBlocksCleared`.
    Cleared,
}

impl ResetReason {
    /// Every reason, for removing a worker rank's series.
    pub const ALL: [ResetReason; 6] = [
        ResetReason::Connect,
        ResetReason::Disconnect,
        ResetReason::Gap,
        ResetReason::Restart,
        ResetReason::Overflow,
        ResetReason::Cleared,
    ];
}

/// One thing for the ingest thread to do for a worker rank.
#[derive(Debug)]
pub enum Item {
    /// A KV-event message's topic and payload, as received at `received`.
    Batch {
        /// The engine that published it: its decoder reads the payload.
        engine: Engine,
        /// The topic frame.
        topic: Bytes,
        /// The msgpack payload.
        payload: Bytes,
        /// When the message arrived.
        received: Instant,
    },
    /// The rank's stream (re)connected (`true`) or was lost.
    Live(bool),
    /// The rank left the endpoint set.
    Forget,
    /// The rank's index part must start over.
    Reset(ResetReason),
    /// Dropped once applied: [`IngestQueue::flush`] waits for every one.
    Flush(std::sync::mpsc::SyncSender<()>),
}

impl Item {
    /// Bytes it counts against the budget.
    fn cost(&self) -> usize {
        match self {
            Item::Batch { topic, payload, .. } => payload.len() + topic.len() + BATCH_OVERHEAD,
            _ => 0,
        }
    }
}

/// Batches one rank lost to a full queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// The rank.
    pub worker: WorkerKey,
    /// Its batches dropped (queued ones and, for the sender, the incoming one).
    pub batches: u64,
}

#[derive(Debug, Default)]
struct RankQueue {
    items: VecDeque<Item>,
    bytes: usize,
}

#[derive(Debug, Default)]
struct State {
    ranks: HashMap<WorkerKey, RankQueue>,
    /// Ranks with items, in turn order; a rank is here iff its queue is non-empty.
    turns: VecDeque<WorkerKey>,
    bytes: usize,
    peak: usize,
    /// The rank whose item the ingest thread is applying.
    busy: Option<WorkerKey>,
    /// Every sender is gone: the thread ends once the queue is empty.
    senders_gone: bool,
    /// The ingest thread is gone: senders stop.
    receiver_gone: bool,
}

impl State {
    fn push(&mut self, worker: WorkerKey, item: Item) {
        let rank = self.ranks.entry(worker).or_default();
        if rank.items.is_empty() {
            self.turns.push_back(worker);
        }
        let cost = item.cost();
        rank.bytes += cost;
        rank.items.push_back(item);
        self.bytes += cost;
        self.peak = self.peak.max(self.bytes);
    }

    /// Drops `worker`'s queued batches (its control items stay, in order) and
    /// queues a reset after them; returns how many batches went.
    fn drop_batches(&mut self, worker: WorkerKey) -> u64 {
        let Some(rank) = self.ranks.get_mut(&worker) else {
            return 0;
        };
        let before = rank.items.len();
        rank.items.retain(|i| !matches!(i, Item::Batch { .. }));
        let dropped = (before - rank.items.len()) as u64;
        self.bytes -= rank.bytes;
        rank.bytes = 0;
        if rank.items.is_empty() {
            self.ranks.remove(&worker);
            self.turns.retain(|w| *w != worker);
        }
        self.push(worker, Item::Reset(ResetReason::Overflow));
        dropped
    }

    /// The rank holding the most queued bytes, `extra` counted for `with`.
    fn heaviest(&self, with: WorkerKey, extra: usize) -> WorkerKey {
        let own = self.ranks.get(&with).map_or(0, |r| r.bytes) + extra;
        self.ranks
            .iter()
            .filter(|(w, r)| **w != with && r.bytes > own)
            .max_by_key(|(_, r)| r.bytes)
            .map_or(with, |(w, _)| *w)
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    budget: usize,
    senders: AtomicUsize,
    gauge: Gauge,
}

/// The sending side (subscriber tasks, subscriptions, the [`super::subscriber::KvEvents`] handle).
#[derive(Debug)]
pub struct IngestQueue(Arc<Shared>);

/// The receiving side, owned by the ingest thread.
#[derive(Debug)]
pub struct Receiver(Arc<Shared>);

/// A queue of at most `budget` bytes of batches; `gauge` follows its bytes.
pub fn queue(budget: usize, gauge: Gauge) -> (IngestQueue, Receiver) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        wake: Condvar::new(),
        budget,
        senders: AtomicUsize::new(1),
        gauge,
    });
    (IngestQueue(Arc::clone(&shared)), Receiver(shared))
}

impl IngestQueue {
    /// Queues a batch from `worker`, making room as the module doc says;
    /// returns the ranks that lost batches (empty when nothing was dropped).
    pub fn push_batch(&self, worker: WorkerKey, batch: Item) -> Vec<Dropped> {
        let cost = batch.cost();
        let mut dropped = Vec::new();
        let mut s = self.0.state.lock();
        while s.bytes + cost > self.0.budget {
            let heaviest = s.heaviest(worker, cost);
            let batches = s.drop_batches(heaviest);
            if heaviest == worker {
                dropped.push(Dropped {
                    worker,
                    batches: batches + 1,
                });
                self.0.gauge.set(s.bytes as i64);
                drop(s);
                self.0.wake.notify_one();
                return dropped;
            }
            dropped.push(Dropped {
                worker: heaviest,
                batches,
            });
        }
        s.push(worker, batch);
        self.0.gauge.set(s.bytes as i64);
        drop(s);
        self.0.wake.notify_one();
        dropped
    }

    /// Queues a control item (never dropped, no budget).
    pub fn push_control(&self, worker: WorkerKey, item: Item) {
        debug_assert_eq!(item.cost(), 0);
        self.0.state.lock().push(worker, item);
        self.0.wake.notify_one();
    }

    /// Waits until every item queued before the call has been applied.
    pub async fn flush(&self) {
        let (done, wait) = std::sync::mpsc::sync_channel(0);
        {
            let mut s = self.0.state.lock();
            let mut ranks: Vec<WorkerKey> = s.turns.iter().copied().collect();
            ranks.extend(s.busy.filter(|b| !ranks.contains(b)));
            for w in ranks {
                s.push(w, Item::Flush(done.clone()));
            }
        }
        self.0.wake.notify_one();
        drop(done);
        // Every clone is dropped once applied (or with the queue): recv ends.
        let _ = tokio::task::spawn_blocking(move || wait.recv()).await;
    }

    /// The ingest thread is gone.
    pub fn is_closed(&self) -> bool {
        self.0.state.lock().receiver_gone
    }

    /// Bytes queued now, and the most ever queued.
    pub fn bytes(&self) -> (usize, usize) {
        let s = self.0.state.lock();
        (s.bytes, s.peak)
    }
}

impl Clone for IngestQueue {
    fn clone(&self) -> Self {
        self.0.senders.fetch_add(1, Ordering::Relaxed);
        IngestQueue(Arc::clone(&self.0))
    }
}

impl Drop for IngestQueue {
    fn drop(&mut self) {
        if self.0.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.state.lock().senders_gone = true;
            self.0.wake.notify_one();
        }
    }
}

impl Receiver {
    /// The next item, the ranks taking turns; `None` once every sender is gone
    /// and the queue is empty. Blocks the calling thread.
    pub fn next(&self) -> Option<(WorkerKey, Item)> {
        let mut s = self.0.state.lock();
        s.busy = None;
        loop {
            if let Some(worker) = s.turns.pop_front() {
                let rank = s.ranks.get_mut(&worker).expect("a rank in turn has items");
                let item = rank.items.pop_front().expect("a rank in turn has items");
                let cost = item.cost();
                rank.bytes -= cost;
                let more = !rank.items.is_empty();
                if more {
                    s.turns.push_back(worker);
                } else {
                    s.ranks.remove(&worker);
                }
                s.bytes -= cost;
                s.busy = Some(worker);
                self.0.gauge.set(s.bytes as i64);
                return Some((worker, item));
            }
            if s.senders_gone {
                return None;
            }
            self.0.wake.wait(&mut s);
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.receiver_gone = true;
        // Queued flushes end with their items.
        s.ranks.clear();
        s.turns.clear();
        s.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(i: u64) -> WorkerKey {
        WorkerKey {
            instance_id: i,
            dp_rank: 0,
        }
    }

    fn batch(len: usize) -> Item {
        Item::Batch {
            engine: Engine::Vllm,
            topic: Bytes::new(),
            payload: Bytes::from(vec![0u8; len]),
            received: Instant::now(),
        }
    }

    /// What the ingest thread gets once the senders are gone, in order.
    fn drain(tx: IngestQueue, rx: &Receiver) -> Vec<(u64, &'static str)> {
        drop(tx);
        std::iter::from_fn(|| rx.next())
            .map(|(k, item)| {
                let kind = match item {
                    Item::Batch { .. } => "batch",
                    Item::Reset(_) => "reset",
                    Item::Live(_) => "live",
                    Item::Forget => "forget",
                    Item::Flush(_) => "flush",
                };
                (k.instance_id, kind)
            })
            .collect()
    }

    #[test]
    fn a_flooding_rank_loses_its_own_batches_and_ranks_take_turns() {
        let unit = 1000 - BATCH_OVERHEAD;
        let (tx, rx) = queue(5000, Gauge::default());
        tx.push_control(w(1), Item::Live(true));
        for _ in 0..4 {
            assert!(tx.push_batch(w(1), batch(unit)).is_empty());
        }
        // The other rank's batch fits only once the flooder's are gone.
        assert!(tx.push_batch(w(2), batch(unit)).is_empty());
        assert_eq!(
            tx.push_batch(w(2), batch(unit)),
            vec![Dropped {
                worker: w(1),
                batches: 4
            }]
        );
        assert_eq!(tx.bytes(), (2000, 5000));
        // The flooder's next batch fits again, after its reset.
        assert!(tx.push_batch(w(1), batch(unit)).is_empty());
        assert_eq!(
            drain(tx, &rx),
            vec![
                (1, "live"),
                (2, "batch"),
                (1, "reset"),
                (2, "batch"),
                (1, "batch"),
            ]
        );
    }

    #[test]
    fn the_heaviest_sender_loses_its_incoming_batch_too() {
        let unit = 1000 - BATCH_OVERHEAD;
        let (tx, rx) = queue(3000, Gauge::default());
        assert!(tx.push_batch(w(2), batch(unit)).is_empty());
        assert!(tx.push_batch(w(1), batch(unit)).is_empty());
        assert!(tx.push_batch(w(1), batch(unit)).is_empty());
        assert_eq!(
            tx.push_batch(w(1), batch(unit)),
            vec![Dropped {
                worker: w(1),
                batches: 3
            }]
        );
        assert!(tx.bytes().0 <= 3000);
        assert_eq!(drain(tx, &rx), vec![(2, "batch"), (1, "reset")]);
    }

    #[test]
    fn the_thread_ends_after_the_last_sender_and_the_queue() {
        let (tx, rx) = queue(10_000, Gauge::default());
        let other = tx.clone();
        tx.push_batch(w(1), batch(10));
        drop(tx);
        drop(other);
        assert!(matches!(rx.next(), Some((_, Item::Batch { .. }))));
        assert!(rx.next().is_none());
    }
}
