//! Routing state shared between kvpick replicas: the deltas one replica's
//! decisions produce, the sink they go to, and how a peer's deltas are applied.
//!
//! The scheduler hands every decision's effects to a [`ReplicaSink`] (set once
//! with [`crate::scheduler::Scheduler::set_replica_sink`]) as [`Delta`]s: the
//! prompt recorded on a worker (approximate or provisional entries), load booked
//! and released per (worker, rank), session bindings opened and closed. The sink
//! must never block: the `kvpick` crate's implementation queues into a bounded
//! channel and drops (and counts) when it is full; a task batches and publishes.
//!
//! Peers' deltas come back through [`crate::scheduler::Scheduler::apply_peer`].
//! Their bookings are kept apart per peer in [`PeerLoads`], so that:
//! - a release never takes back more than that peer booked on that endpoint;
//! - a peer's periodic [`Delta::Loads`] report (its own bookings, absolute)
//!   replaces what was heard from it, so lost deltas are corrected within one
//!   report period;
//! - a peer not heard from for a lease loses every booking it held (a dead
//!   replica never leaves load behind).
//!
//! The learned latency models travel too ([`Delta::Models`], published
//! periodically rather than per decision): a peer's model of a worker replaces
//! the receiver's when it rests on more observations (the count is the
//! model's version, so a late or replayed older copy never overwrites a newer
//! one), and a malformed or absurd one is refused.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::endpoints::{ActiveLoad, EndpointState, Snapshot};
use crate::keys::WorkerKey;
use crate::latency::WorkerSnapshot;

/// A replica's random id, drawn at start (a restarted replica is a new peer).
pub type ReplicaId = u64;

/// One effect of a routing decision, as peers apply it.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// `worker` was sent a prompt of these chained block hashes (one delta per
    /// decision, not per block); the receiver records approximate entries, or
    /// provisional ones when `worker` is precise there.
    Prompt {
        /// The (worker, rank).
        worker: WorkerKey,
        /// The prompt's leading block hashes.
        hashes: Vec<u64>,
        /// The sender's LRU key for the touch (nanoseconds since the Unix epoch,
        /// [`crate::kv::index::PrefixIndex::key`]): block `i` ranks at `at + i`
        /// in every replica's LRU, however late the delta arrives.
        at: u64,
    },
    /// Load booked on `worker`.
    Book {
        /// The (worker, rank).
        worker: WorkerKey,
        /// Blocks booked (and of them, left to prefill).
        load: ActiveLoad,
        /// Requests it adds to the rank's in-flight count.
        requests: u32,
    },
    /// Load released on `worker`.
    Release {
        /// The (worker, rank).
        worker: WorkerKey,
        /// Blocks released.
        load: ActiveLoad,
        /// Requests it takes off the rank's in-flight count.
        requests: u32,
    },
    /// A session was bound (opened, continued or re-homed) to `decode`.
    Bind {
        /// The session id.
        session: String,
        /// The decode (worker, rank).
        decode: WorkerKey,
        /// The prefill (worker, rank), in disaggregated pools.
        prefill: Option<WorkerKey>,
        /// The binding's inactivity timeout.
        timeout: Duration,
    },
    /// A session was closed.
    Unbind {
        /// The session id.
        session: String,
    },
    /// Everything the sender has booked right now (absolute; also its
    /// heartbeat): replaces what peers hold from it.
    Loads(Vec<WorkerLoad>),
    /// The sender's latency models: its pool prior and some of its workers'
    /// (at most [`crate::latency::MAX_SHARED_MODELS`] in one delta).
    Models {
        /// The pool prior.
        prior: WorkerSnapshot,
        /// Workers' models.
        workers: Vec<(WorkerKey, WorkerSnapshot)>,
    },
}

/// One (worker, rank)'s load booked by one replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerLoad {
    /// The (worker, rank).
    pub worker: WorkerKey,
    /// Blocks booked.
    pub load: ActiveLoad,
    /// Requests in flight.
    pub requests: u32,
}

/// Where a replica's deltas go. Called on the request path: must not block.
pub trait ReplicaSink: Send + Sync + fmt::Debug {
    /// Queues `delta` for the peers (dropped if the queue is full).
    fn push(&self, delta: Delta);
}

/// What one peer has booked on each (worker, rank), and on which endpoint
/// state it was applied (an endpoint re-created by discovery starts at zero,
/// so a release goes to the state that got the booking).
#[derive(Debug, Default)]
struct Peer {
    last_heard: Option<Instant>,
    loads: HashMap<WorkerKey, Applied>,
}

#[derive(Debug)]
struct Applied {
    ep: Arc<EndpointState>,
    load: ActiveLoad,
    requests: u32,
}

/// Peers' bookings, applied to the endpoint table's load and kept per peer
/// (see the module doc). At most `max_peers` peers and one entry per
/// (worker, rank) of the table each: nothing a peer sends grows it further.
#[derive(Debug)]
pub struct PeerLoads {
    peers: parking_lot::Mutex<HashMap<ReplicaId, Peer>>,
    lease: Duration,
    max_peers: usize,
}

impl PeerLoads {
    /// A table whose peers lose their bookings after `lease` of silence.
    pub fn new(lease: Duration, max_peers: usize) -> Self {
        PeerLoads {
            peers: Default::default(),
            lease,
            max_peers,
        }
    }

    /// The lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Peers currently holding a lease.
    pub fn peers(&self) -> usize {
        self.peers.lock().len()
    }

    /// `from` was heard at `now` (any delta renews its lease). False when the
    /// table is full of other peers (the delta is then ignored).
    pub fn heard(&self, from: ReplicaId, now: Instant) -> bool {
        let mut peers = self.peers.lock();
        if !peers.contains_key(&from) && peers.len() >= self.max_peers {
            return false;
        }
        peers.entry(from).or_default().last_heard = Some(now);
        true
    }

    /// Books `load` (and `requests`) from `from` on `worker`, if the table has it.
    pub fn book(
        &self,
        from: ReplicaId,
        snapshot: &Snapshot,
        worker: WorkerKey,
        load: ActiveLoad,
        requests: u32,
    ) {
        let Some(ep) = snapshot.by_instance(worker.instance_id) else {
            return;
        };
        if worker.dp_rank >= ep.ranks() {
            return;
        }
        let mut peers = self.peers.lock();
        let Some(peer) = peers.get_mut(&from) else {
            return;
        };
        let a = peer.loads.entry(worker).or_insert_with(|| Applied {
            ep: Arc::clone(ep),
            load: ActiveLoad::default(),
            requests: 0,
        });
        if !Arc::ptr_eq(&a.ep, ep) {
            // The endpoint was re-created: what was booked on the old state went with it.
            *a = Applied {
                ep: Arc::clone(ep),
                load: ActiveLoad::default(),
                requests: 0,
            };
        }
        a.ep.book(worker.dp_rank, load);
        a.ep.add_peer_requests(worker.dp_rank, requests);
        a.load.blocks += load.blocks;
        a.load.uncached += load.uncached;
        a.requests += requests;
    }

    /// Releases up to `load` (and `requests`) that `from` booked on `worker`.
    pub fn release(&self, from: ReplicaId, worker: WorkerKey, load: ActiveLoad, requests: u32) {
        let mut peers = self.peers.lock();
        let Some(peer) = peers.get_mut(&from) else {
            return;
        };
        let Some(a) = peer.loads.get_mut(&worker) else {
            return;
        };
        let take = ActiveLoad {
            blocks: load.blocks.min(a.load.blocks),
            uncached: load.uncached.min(a.load.uncached),
        };
        let n = requests.min(a.requests);
        a.ep.release(worker.dp_rank, take);
        a.ep.sub_peer_requests(worker.dp_rank, n);
        a.load.blocks -= take.blocks;
        a.load.uncached -= take.uncached;
        a.requests -= n;
        if a.load == ActiveLoad::default() && a.requests == 0 {
            peer.loads.remove(&worker);
        }
    }

    /// Replaces everything `from` booked with its report `loads`.
    pub fn replace(&self, from: ReplicaId, snapshot: &Snapshot, loads: &[WorkerLoad]) {
        let held: Vec<(WorkerKey, ActiveLoad, u32)> = match self.peers.lock().get(&from) {
            Some(p) => p
                .loads
                .iter()
                .map(|(k, a)| (*k, a.load, a.requests))
                .collect(),
            None => return,
        };
        for (worker, load, requests) in held {
            self.release(from, worker, load, requests);
        }
        for l in loads {
            self.book(from, snapshot, l.worker, l.load, l.requests);
        }
    }

    /// Releases every booking of peers not heard from for a lease at `now`;
    /// returns how many peers expired.
    pub fn expire(&self, now: Instant) -> usize {
        let mut peers = self.peers.lock();
        let gone: Vec<ReplicaId> = peers
            .iter()
            .filter(|(_, p)| {
                p.last_heard
                    .is_none_or(|t| now.saturating_duration_since(t) >= self.lease)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            if let Some(p) = peers.remove(id) {
                for (w, a) in p.loads {
                    a.ep.release(w.dp_rank, a.load);
                    a.ep.sub_peer_requests(w.dp_rank, a.requests);
                }
            }
        }
        gone.len()
    }

    /// This replica's own bookings: each rank's load less what peers booked there.
    pub fn own(&self, snapshot: &Snapshot) -> Vec<WorkerLoad> {
        let mut theirs: HashMap<WorkerKey, (ActiveLoad, u32)> = HashMap::new();
        for p in self.peers.lock().values() {
            for (w, a) in &p.loads {
                let t = theirs.entry(*w).or_default();
                t.0.blocks += a.load.blocks;
                t.0.uncached += a.load.uncached;
                t.1 += a.requests;
            }
        }
        let mut own = Vec::new();
        for ep in snapshot.endpoints.iter() {
            for rank in 0..ep.ranks() {
                let worker = ep.key(rank);
                let (peer_load, peer_requests) = theirs.get(&worker).copied().unwrap_or_default();
                let all = ep.active_load(rank);
                let l = WorkerLoad {
                    worker,
                    load: ActiveLoad {
                        blocks: all.blocks.saturating_sub(peer_load.blocks),
                        uncached: all.uncached.saturating_sub(peer_load.uncached),
                    },
                    requests: ep.in_flight(rank).saturating_sub(peer_requests),
                };
                if l.load != ActiveLoad::default() || l.requests > 0 {
                    own.push(l);
                }
            }
        }
        own
    }
}
