//! The latency models as a running server shares them: a [`Learner`] holds one
//! [`LatencyModels`] per pool behind a read-write lock, follows each routed
//! request through the flow ([`FlowObserver`]) and learns from it when it ends.
//!
//! Only requests whose decision carries [`Features`] (streamed ones, picked in
//! predicted mode) are followed. A request's TTFT is learned at its first
//! response chunk (unless its status says it failed), its decode pace at its
//! end: the next decisions know a worker's current TTFT without waiting for
//! the long decodes in between to finish. Invariants: at most [`MAX_FOLLOWED`] requests
//! are followed at once (past it a new one is not learned from); a request
//! leaves the followed set at its end, whatever the end; the models' lock is
//! taken for reading per prediction and for writing once per learned request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::{
    Ended, Features, LatencyConfig, LatencyModels, Prediction, Rejected, Timeline, WorkerSnapshot,
};
use crate::flow::{FlowEnd, FlowId, FlowObserver};
use crate::keys::WorkerKey;
use crate::scheduler::Decision;

/// Most requests followed at once.
pub const MAX_FOLLOWED: usize = 65_536;
/// Shards of the followed set (by flow id), so chunks of different requests
/// seldom wait on one another.
const SHARDS: usize = 16;

/// Upper bounds of the prediction error histogram buckets (|error| / actual TTFT).
pub const ERROR_BUCKETS: [f64; 8] = [0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0];

/// One followed request.
#[derive(Debug, Clone, Copy)]
struct Followed {
    worker: WorkerKey,
    features: Features,
    timeline: Timeline,
    /// The response's HTTP status, once its headers came.
    status: Option<u16>,
    /// Whether its TTFT was learned at its first chunk.
    first_learned: bool,
}

/// The pool's latency models, fed by the flows it observes.
#[derive(Debug)]
pub struct Learner {
    models: RwLock<LatencyModels<WorkerKey>>,
    followed: [Mutex<HashMap<FlowId, Followed>>; SHARDS],
    errors: [AtomicU64; ERROR_BUCKETS.len() + 1],
    /// Sum of the recorded errors, in millionths.
    error_sum_micros: AtomicU64,
    /// Decisions made while the pool prior was cold (scored by the heuristic).
    fallbacks: AtomicU64,
    /// Sheddable requests refused because no warm worker was predicted to
    /// meet their TTFT objective.
    slo_sheds: AtomicU64,
    /// Models from peers refused as malformed or absurd.
    refused_shared: AtomicU64,
}

impl Learner {
    /// No observations yet.
    pub fn new(config: LatencyConfig) -> Self {
        Learner {
            models: RwLock::new(LatencyModels::new(config)),
            followed: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            errors: Default::default(),
            error_sum_micros: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            slo_sheds: AtomicU64::new(0),
            refused_shared: AtomicU64::new(0),
        }
    }

    /// Whether the pool prior has seen enough to predict with; while it has
    /// not, picks use the heuristic cost.
    pub fn is_warm(&self) -> bool {
        let m = self.models.read();
        m.prior().observations() >= m.config().warm_observations
    }

    /// The prediction for `features` on `worker`: its own model once warm,
    /// else the pool prior; `None` while the pool prior is cold.
    pub fn predict(&self, worker: &WorkerKey, features: &Features) -> Option<Prediction> {
        let m = self.models.read();
        if m.prior().observations() < m.config().warm_observations {
            return None;
        }
        Some(match m.is_warm(worker) {
            true => m.predict(worker, features),
            false => Prediction {
                observations: m.observations(worker),
                recent_error: m.worker(worker).map_or(0.0, |w| w.recent_error()),
                ..m.predict_by_prior(features)
            },
        })
    }

    /// The least TTFT, in seconds, any prediction for a request with
    /// `uncached_tokens` to prefill can show (see [`LatencyModels::ttft_floor`]);
    /// `None` while the pool prior is cold.
    pub fn ttft_floor(&self, uncached_tokens: u64) -> Option<f64> {
        let m = self.models.read();
        (m.prior().observations() >= m.config().warm_observations)
            .then(|| m.ttft_floor(uncached_tokens))
    }

    /// Whether `worker`'s own model has seen enough to be trusted.
    pub fn is_warm_worker(&self, worker: &WorkerKey) -> bool {
        self.models.read().is_warm(worker)
    }

    /// Learns one request on `worker` directly, its TTFT and decode pace at
    /// once (a test; a stream learns each when it shows it).
    pub fn learn(&self, worker: WorkerKey, features: &Features, seen: &super::Observed) {
        self.record_prediction_error(&worker, features, seen.ttft);
        // A refused observation changes nothing; there is nothing to tell.
        let _ = self.models.write().observe(worker, features, seen);
    }

    /// Learns a request's TTFT on `worker` when its first token is out, so
    /// the next decisions know it without waiting for the request to end.
    pub fn learn_first_token(&self, worker: WorkerKey, features: &Features, ttft: Duration) {
        self.record_prediction_error(&worker, features, ttft);
        let _ = self
            .models
            .write()
            .observe_first_token(worker, features, ttft);
    }

    /// Learns a request's time per output token on `worker`, at its end.
    pub fn learn_decode(&self, worker: WorkerKey, features: &Features, tpot: Duration) {
        let _ = self.models.write().observe_decode(worker, features, tpot);
    }

    /// Records how far the prediction for `features` on `worker` is from `ttft`.
    fn record_prediction_error(&self, worker: &WorkerKey, features: &Features, ttft: Duration) {
        let actual = ttft.as_secs_f64();
        if let Some(p) = self.predict(worker, features).filter(|_| actual > 0.0) {
            self.record_error((p.ttft - actual).abs() / actual);
        }
    }

    /// Counts a decision scored by the heuristic while the pool prior was cold.
    pub fn count_fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions scored by the heuristic because the pool prior was cold.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    /// Counts a sheddable request refused for its TTFT objective.
    pub fn count_slo_shed(&self) {
        self.slo_sheds.fetch_add(1, Ordering::Relaxed);
    }

    /// Sheddable requests refused for their TTFT objective.
    pub fn slo_sheds(&self) -> u64 {
        self.slo_sheds.load(Ordering::Relaxed)
    }

    /// The prediction error histogram: (upper bound, count in that bucket
    /// alone) per bucket, the last bound `f64::MAX`; the sum of the errors.
    pub fn errors(&self) -> (Vec<(f64, u64)>, f64) {
        let buckets = ERROR_BUCKETS
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(&self.errors)
            .map(|(b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        let sum = self.error_sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        (buckets, sum)
    }

    /// Models to share with peers: the pool prior and at most `max` workers'
    /// models in key order, starting after `after` (wrapping round), so
    /// successive calls cover every worker. `None` before any observation.
    pub fn shared(
        &self,
        after: Option<WorkerKey>,
        max: usize,
    ) -> Option<(WorkerSnapshot, Vec<(WorkerKey, WorkerSnapshot)>)> {
        let m = self.models.read();
        if m.prior().observations() == 0 {
            return None;
        }
        let mut keys = m.keys();
        keys.sort_unstable();
        let start = after.map_or(0, |a| keys.partition_point(|k| *k <= a));
        let workers = keys[start..]
            .iter()
            .chain(&keys[..start])
            .take(max)
            .filter_map(|k| Some((*k, m.snapshot(k)?)))
            .collect();
        Some((m.prior_snapshot(), workers))
    }

    /// Adopts a peer's prior and worker models where they rest on more
    /// observations than this replica's; refused ones are counted
    /// ([`Learner::refused_shared`]).
    pub fn restore_shared<'a>(
        &self,
        prior: &WorkerSnapshot,
        workers: impl Iterator<Item = &'a (WorkerKey, WorkerSnapshot)>,
    ) {
        let mut m = self.models.write();
        let mut refused = u64::from(m.restore_prior(prior).is_err());
        for (k, s) in workers {
            refused += u64::from(m.restore(*k, s).is_err());
        }
        if refused > 0 {
            tracing::debug!(refused, "refused malformed shared latency models");
            self.refused_shared.fetch_add(refused, Ordering::Relaxed);
        }
    }

    /// Shared models refused as malformed or absurd.
    pub fn refused_shared(&self) -> u64 {
        self.refused_shared.load(Ordering::Relaxed)
    }

    /// Adopts a peer's model of `worker` when it rests on more observations.
    pub fn restore(&self, worker: WorkerKey, snapshot: &WorkerSnapshot) -> Result<(), Rejected> {
        self.models.write().restore(worker, snapshot)
    }

    /// Adopts a peer's pool prior when it rests on more observations.
    pub fn restore_prior(&self, snapshot: &WorkerSnapshot) -> Result<(), Rejected> {
        self.models.write().restore_prior(snapshot)
    }

    /// Keeps only the models of workers `live` accepts.
    pub fn retain(&self, live: impl FnMut(&WorkerKey) -> bool) {
        self.models.write().retain(live);
    }

    /// Workers with a model of their own.
    pub fn workers(&self) -> usize {
        self.models.read().len()
    }

    /// Requests followed now.
    pub fn following(&self) -> usize {
        self.followed.iter().map(|s| s.lock().len()).sum()
    }

    fn record_error(&self, err: f64) {
        if !err.is_finite() {
            return;
        }
        let i = ERROR_BUCKETS
            .iter()
            .position(|b| err <= *b)
            .unwrap_or(ERROR_BUCKETS.len());
        self.errors[i].fetch_add(1, Ordering::Relaxed);
        self.error_sum_micros
            .fetch_add((err.min(1e6) * 1e6) as u64, Ordering::Relaxed);
    }

    fn shard(&self, flow: FlowId) -> &Mutex<HashMap<FlowId, Followed>> {
        &self.followed[flow.0 as usize % SHARDS]
    }
}

impl FlowObserver for Learner {
    fn routed(&self, flow: FlowId, decision: &Decision, at: Instant) {
        let mut shard = self.shard(flow).lock();
        let Some(features) = decision.latency_features else {
            // A replaced decision that no longer teaches stops being followed.
            shard.remove(&flow);
            return;
        };
        if shard.len() >= MAX_FOLLOWED / SHARDS && !shard.contains_key(&flow) {
            return;
        }
        shard.insert(
            flow,
            Followed {
                worker: decision.decode.key(),
                features,
                timeline: Timeline::new(at),
                status: None,
                first_learned: false,
            },
        );
    }

    fn responded(&self, flow: FlowId, _decision: &Decision, _at: Instant, status: Option<u16>) {
        if let Some(f) = self.shard(flow).lock().get_mut(&flow) {
            f.status = status;
        }
    }

    fn first_chunk(&self, flow: FlowId, decision: &Decision, at: Instant, bytes: usize) {
        let learn = {
            let mut shard = self.shard(flow).lock();
            let Some(f) = shard.get_mut(&flow) else {
                return;
            };
            // The gateway may have served it from a fallback.
            f.worker = decision.decode.key();
            f.timeline.chunk(at, bytes);
            // An error's body is no first token; a response without a status
            // line counts as served, as at its end.
            let served = f.status.is_none_or(|s| (200..300).contains(&s));
            let ttft = f.timeline.ttft().filter(|_| served);
            f.first_learned = ttft.is_some();
            ttft.map(|t| (f.worker, f.features, t))
        };
        if let Some((worker, features, ttft)) = learn {
            self.learn_first_token(worker, &features, ttft);
        }
    }

    fn chunk(&self, flow: FlowId, _decision: &Decision, at: Instant, bytes: usize) {
        if let Some(f) = self.shard(flow).lock().get_mut(&flow) {
            f.timeline.chunk(at, bytes);
        }
    }

    fn ended(&self, flow: FlowId, _decision: &Decision, _at: Instant, end: FlowEnd) {
        let Some(f) = self.shard(flow).lock().remove(&flow) else {
            return;
        };
        let ended = match end {
            // A response without a status line still showed its chunks.
            FlowEnd::Finished { status } => Ended::Status(status.unwrap_or(200)),
            FlowEnd::Cancelled => Ended::Cancelled,
        };
        match (f.timeline.finish(ended), f.first_learned) {
            (Some(seen), false) => self.learn(f.worker, &f.features, &seen),
            (Some(super::Observed { tpot: Some(t), .. }), true) => {
                self.learn_decode(f.worker, &f.features, t)
            }
            _ => {}
        }
    }
}
