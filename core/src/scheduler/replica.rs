//! The scheduler's side of replica sync ([`crate::replica`]): each decision's
//! effects go to the sink as they happen here, and peers' deltas are applied
//! as if this replica had made them, off the request path.
//!
//! Without a sink nothing is built: the hot path's cost is one unset check.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::{Decision, Scheduler};
use crate::endpoints::{ActiveLoad, Snapshot, WorkerKey};
use crate::replica::{Delta, PeerLoads, ReplicaId, ReplicaSink};
use crate::request::SessionAction;
use crate::sessions::SessionTurn;

impl Scheduler {
    /// Sends every decision's effects to `sink` from now on; false if a sink
    /// was already set.
    pub fn set_replica_sink(&self, sink: Arc<dyn ReplicaSink>) -> bool {
        self.replica.set(sink).is_ok()
    }

    /// Tie-breaks drawn so far from the sequence of
    /// [`SchedulerConfig::tie_break_seed`](super::SchedulerConfig::tie_break_seed).
    pub fn tie_break_draws(&self) -> u64 {
        self.tie_breaks.load(Ordering::Relaxed)
    }

    /// Continues that sequence from draw `n`. Replicas with one seed that hand
    /// the count on from pick to pick draw the very tie-breaks one scheduler
    /// making their picks would draw: a replay comparing R replicas with one
    /// then differs only by what the replicas know, not by luck.
    pub fn set_tie_break_draws(&self, n: u64) {
        self.tie_breaks.store(n, Ordering::Relaxed);
    }

    /// A decision was booked: its prompt (where it was recorded, at the LRU
    /// key it was recorded with) and load on each of its ranks.
    pub(super) fn share_decision(
        &self,
        decision: &Decision,
        hashes: &[u64],
        decode_at: Option<u64>,
        prefill_at: Option<u64>,
    ) {
        let Some(sink) = self.replica.get() else {
            return;
        };
        let record = |worker, at: Option<u64>, load, requests| {
            if let Some(at) = at {
                sink.push(Delta::Prompt {
                    worker,
                    hashes: hashes.to_vec(),
                    at,
                });
            }
            sink.push(Delta::Book {
                worker,
                load,
                requests,
            });
        };
        record(decision.decode.key(), decode_at, decision.decode_load(), 1);
        if let Some(p) = &decision.prefill {
            record(p.key(), prefill_at, decision.prefill_load(), 0);
        }
    }

    /// Load (and `requests` in flight) was booked on `worker` outside a pick.
    pub(super) fn share_book(&self, worker: WorkerKey, load: ActiveLoad, requests: u32) {
        if let Some(sink) = self.replica.get() {
            sink.push(Delta::Book {
                worker,
                load,
                requests,
            });
        }
    }

    /// Load was released on `worker`.
    pub(super) fn share_release(&self, worker: WorkerKey, load: ActiveLoad, requests: u32) {
        if let Some(sink) = self.replica.get() {
            if load != ActiveLoad::default() || requests > 0 {
                sink.push(Delta::Release {
                    worker,
                    load,
                    requests,
                });
            }
        }
    }

    /// A session turn settled as [`crate::sessions::SessionStore::settle`] did.
    pub(super) fn share_settle(
        &self,
        turn: &SessionTurn,
        decode: WorkerKey,
        prefill: Option<WorkerKey>,
        status: Option<u16>,
    ) {
        let Some(sink) = self.replica.get() else {
            return;
        };
        if turn.action == Some(SessionAction::Close) {
            sink.push(Delta::Unbind {
                session: turn.id.clone(),
            });
        } else if status.is_some_and(|c| (200..300).contains(&c)) {
            sink.push(Delta::Bind {
                session: turn.id.clone(),
                decode,
                prefill,
                timeout: turn.timeout,
            });
        }
    }

    /// Applies a peer's delta: its prompts become index entries here, its
    /// bookings load (kept per peer in `peers`), its sessions bindings.
    /// `bookings: false` applies prompts and sessions only (a warm start
    /// replaying deltas older than a lease). Emits nothing.
    pub fn apply_peer(
        &self,
        from: ReplicaId,
        delta: Delta,
        peers: &PeerLoads,
        snapshot: &Snapshot,
        bookings: bool,
        now: Instant,
    ) {
        match delta {
            Delta::Prompt { worker, hashes, at } => {
                let limit = self.config.max_prefix_blocks;
                self.record_peer_prompt(worker, &hashes[..hashes.len().min(limit)], at, now);
            }
            Delta::Book {
                worker,
                load,
                requests,
            } if bookings && peers.heard(from, now) => {
                peers.book(from, snapshot, worker, load, requests)
            }
            Delta::Release {
                worker,
                load,
                requests,
            } if bookings && peers.heard(from, now) => peers.release(from, worker, load, requests),
            Delta::Loads(loads) if bookings && peers.heard(from, now) => {
                peers.replace(from, snapshot, &loads)
            }
            Delta::Bind {
                session,
                decode,
                prefill,
                timeout,
            } => self.sessions.bind(&session, decode, prefill, timeout, now),
            Delta::Unbind { session } => {
                self.sessions.unbind(&session);
            }
            Delta::Models { prior, workers } => {
                if let Some(l) = &self.latency {
                    // Only live workers: a peer cannot fill the model cap.
                    let live = |k: &WorkerKey| {
                        snapshot
                            .by_instance(k.instance_id)
                            .is_some_and(|e| k.dp_rank < e.ranks())
                    };
                    l.restore_shared(&prior, workers.iter().filter(|(k, _)| live(k)));
                }
            }
            Delta::Book { .. } | Delta::Release { .. } | Delta::Loads(_) => {}
        }
    }
}
