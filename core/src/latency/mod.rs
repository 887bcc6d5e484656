//! Learned latency: per-worker online models of time to first token (TTFT) and
//! time per output token (TPOT), fitted from what the gateway sees of each
//! routed request, and predicted per candidate at the cost of a dot product.
//!
//! - [`features`]: a request's [`Features`] at decision time and its
//!   [`Observed`] times (from a [`Timeline`] of response chunks).
//! - [`rls`]: the fitter, recursive least squares with forgetting and
//!   non-negative coefficients.
//! - [`model`]: one worker's [`WorkerModel`] and its [`Prediction`].
//! - [`learner`]: the [`Learner`] a server shares, fed by the request flow.
//!
//! [`LatencyModels`] keeps one model per worker plus a pool-wide prior that
//! learns from every observation; a worker seen for the first time starts from
//! the prior. Invariants: at most [`LatencyConfig::max_workers`] models (the
//! least recently updated goes first, and [`LatencyModels::retain`] drops gone
//! workers); an observation is checked before it touches any model, and a
//! refused one changes nothing; an update costs O(terms²) with terms ≤ 6
//! (O(terms³) at worst, when the fit's projection holds coefficients at 0,
//! [`rls`]) and allocates only when a new worker enters. [`LatencyModels`] is pure: no
//! clock, no I/O, no lock ([`Learner`] shares it).

pub mod features;
mod floor;
pub mod learner;
pub mod model;
pub mod rls;
pub mod slots;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

pub use features::{Ended, Features, Observed, Rejected, Timeline};
pub use learner::Learner;
pub use model::{Prediction, WorkerModel, WorkerSnapshot};

use features::{TPOT_TERMS, TTFT_TERMS};
use floor::{Source, TtftFloor};

/// Most worker models one shared delta carries
/// ([`crate::replica::Delta::Models`]).
pub const MAX_SHARED_MODELS: usize = 256;

/// How the models learn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyConfig {
    /// Most workers with a model of their own.
    pub max_workers: usize,
    /// Observations before a worker's own model is trusted
    /// ([`LatencyModels::is_warm`]); colder workers use the heuristic cost.
    pub warm_observations: u64,
    /// Forgetting factor per observation of a worker's model, in `(0, 1]`:
    /// the fit follows roughly the last `1 / (1 - forget)` observations.
    pub forget: f64,
    /// Forgetting factor of the pool prior (it sees every worker's traffic).
    pub prior_forget: f64,
    /// Initial variance of each coefficient of a new model: how freely its
    /// first observations move it away from where it started.
    pub initial_variance: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        LatencyConfig {
            max_workers: 4096,
            warm_observations: 32,
            forget: 0.98,
            prior_forget: 0.999,
            initial_variance: 10.0,
        }
    }
}

impl LatencyConfig {
    /// The configuration with out-of-range values brought in range.
    fn sane(mut self) -> Self {
        self.max_workers = self.max_workers.max(1);
        let unit = |f: f64, d: f64| {
            if f.is_finite() && f > 0.0 && f <= 1.0 {
                f
            } else {
                d
            }
        };
        let d = LatencyConfig::default();
        self.forget = unit(self.forget, d.forget);
        self.prior_forget = unit(self.prior_forget, d.prior_forget);
        if !(self.initial_variance.is_finite() && self.initial_variance > 0.0) {
            self.initial_variance = d.initial_variance;
        }
        self
    }
}

/// Where the pool prior starts before any observation: a mid-size model on a
/// current data-centre GPU (20 ms overhead, 10k prefill tokens/s, 20 ms per
/// waiting request, 1 ms per running request, 100 ms per request beyond the
/// slots; 10 ms per output token, 0.2 ms more per running request). Only
/// predictions for a cold pool use it; the scheduler uses the heuristic cost
/// there.
const STARTING_TTFT: [f64; TTFT_TERMS] = [0.02, 0.1, 0.1, 0.02, 0.001, 0.1];
const STARTING_TPOT: [f64; TPOT_TERMS] = [0.01, 0.0002, 0.0, 0.0];

/// Per-worker latency models keyed by `K` (a worker, or a worker's dp rank).
#[derive(Debug, Clone)]
pub struct LatencyModels<K> {
    config: LatencyConfig,
    prior: WorkerModel,
    workers: HashMap<K, WorkerModel>,
    clock: u64,
    /// The least TTFT the prior and the warm workers' models predict.
    floor: TtftFloor<K>,
    /// The pool's sequence-slot capacity: the largest the prior or any
    /// worker's model has confirmed (0: none yet). Never decreases.
    pool_slots: f64,
}

impl<K: Copy + Eq + Hash> LatencyModels<K> {
    /// No workers yet; the prior at its starting point.
    pub fn new(config: LatencyConfig) -> Self {
        let config = config.sane();
        let prior = WorkerModel::new(STARTING_TTFT, STARTING_TPOT, config.initial_variance);
        LatencyModels {
            floor: TtftFloor::new(&prior),
            prior,
            workers: HashMap::with_capacity(config.max_workers.min(1024)),
            config,
            clock: 0,
            pool_slots: 0.0,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &LatencyConfig {
        &self.config
    }

    /// Learns one request on `worker`. A refused observation changes nothing.
    pub fn observe(
        &mut self,
        worker: K,
        features: &Features,
        seen: &Observed,
    ) -> Result<(), Rejected> {
        features.check()?;
        seen.check()?;
        self.teach(worker, |m, forget| m.learn(features, seen, forget));
        self.refloor(worker);
        Ok(())
    }

    /// Learns one request's TTFT on `worker` as soon as its first token is
    /// out (its decode pace follows with [`LatencyModels::observe_decode`]).
    /// A refused observation changes nothing.
    pub fn observe_first_token(
        &mut self,
        worker: K,
        features: &Features,
        ttft: Duration,
    ) -> Result<(), Rejected> {
        features.check()?;
        Observed { ttft, tpot: None }.check()?;
        let secs = ttft.as_secs_f64();
        self.teach(worker, |m, forget| m.learn_ttft(features, secs, forget));
        self.refloor(worker);
        Ok(())
    }

    /// Learns one request's time per output token on `worker`, at its end.
    /// A refused observation changes nothing.
    pub fn observe_decode(
        &mut self,
        worker: K,
        features: &Features,
        tpot: Duration,
    ) -> Result<(), Rejected> {
        features.check()?;
        Observed {
            ttft: Duration::from_secs(1),
            tpot: Some(tpot),
        }
        .check()?;
        let secs = tpot.as_secs_f64();
        self.teach(worker, |m, forget| m.learn_tpot(features, secs, forget));
        Ok(())
    }

    /// Teaches `worker`'s model, then the pool prior, one lesson, each at its
    /// own forgetting factor.
    fn teach(&mut self, worker: K, lesson: impl Fn(&mut WorkerModel, f64)) {
        let (forget, prior_forget) = (self.config.forget, self.config.prior_forget);
        let model = self.model_of(worker);
        lesson(model, forget);
        let slots = model.slots();
        lesson(&mut self.prior, prior_forget);
        self.pool_slots = self.pool_slots.max(slots).max(self.prior.slots());
    }

    /// `worker`'s model, made from the prior when it has none (evicting the
    /// least recently updated at a full map), touched now.
    fn model_of(&mut self, worker: K) -> &mut WorkerModel {
        self.clock += 1;
        if !self.workers.contains_key(&worker) && self.workers.len() >= self.config.max_workers {
            self.evict_oldest();
        }
        let (prior, variance) = (&self.prior, self.config.initial_variance);
        let model = self
            .workers
            .entry(worker)
            .or_insert_with(|| WorkerModel::from_prior(prior, variance));
        model.touched = self.clock;
        model
    }

    /// The prediction for a request with `features` on `worker`: its own
    /// model, or the pool prior for a worker without one. The delay its
    /// prefill adds to the others is priced at the prior's prefill rate: a
    /// worker's own fit, on its fewer observations, can put a loaded worker's
    /// prefill seconds into its wait terms (which rise with them), and a
    /// zero rate would make a cache hit there worth nothing to the others;
    /// it counts the requests stalled at the pool's slot capacity
    /// ([`LatencyModels::pool_slots`]) while the worker's own is not known.
    pub fn predict(&self, worker: &K, features: &Features) -> Prediction {
        match self.workers.get(worker) {
            Some(m) => m.predict_with(features, self.prior.prefill_rate(), self.pool_slots),
            None => self.predict_by_prior(features),
        }
    }

    /// The pool prior's prediction for `features` (a worker without a
    /// trusted model of its own), its delay on the others counted as
    /// [`LatencyModels::predict`] counts it.
    pub fn predict_by_prior(&self, features: &Features) -> Prediction {
        Prediction {
            observations: 0,
            recent_error: 0.0,
            ..self
                .prior
                .predict_with(features, self.prior.prefill_rate(), self.pool_slots)
        }
    }

    /// The pool's sequence-slot capacity, at which a worker whose own is not
    /// confirmed counts the requests its prefill stalls
    /// ([`WorkerModel::stalled`]): the largest the prior or any worker's
    /// model has confirmed, 0 while none has. The prior's own capacity is no
    /// stand-in: it needs a queue seen again and again beside the largest
    /// running count of any worker, and where the KV pool, not the slots,
    /// bounds the running count, each worker peaks at its own count and the
    /// prior confirms none (one pool of 256-slot workers confirmed 17 to 68
    /// each and the prior nothing), so a worker not yet confirmed would read
    /// as stalling nobody beside peers that price the stall.
    pub fn pool_slots(&self) -> f64 {
        self.pool_slots
    }

    /// Observations behind `worker`'s own model.
    pub fn observations(&self, worker: &K) -> u64 {
        self.workers
            .get(worker)
            .map_or(0, WorkerModel::observations)
    }

    /// Whether `worker`'s own model has seen enough to be trusted.
    pub fn is_warm(&self, worker: &K) -> bool {
        self.observations(worker) >= self.config.warm_observations
    }

    /// `worker`'s own model.
    pub fn worker(&self, worker: &K) -> Option<&WorkerModel> {
        self.workers.get(worker)
    }

    /// The pool-wide prior.
    pub fn prior(&self) -> &WorkerModel {
        &self.prior
    }

    /// The workers with a model of their own.
    pub fn keys(&self) -> Vec<K> {
        self.workers.keys().copied().collect()
    }

    /// Workers with a model of their own.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker has a model of its own.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Keeps only the workers `live` accepts (call when workers leave).
    pub fn retain(&mut self, mut live: impl FnMut(&K) -> bool) {
        self.workers.retain(|k, _| live(k));
        let workers = &self.workers;
        if self
            .floor
            .sources()
            .any(|s| matches!(s, Source::Worker(k) if !workers.contains_key(&k)))
        {
            self.rescan_floor();
        }
    }

    /// The least TTFT, in seconds, the pool prior or a warm worker's model
    /// predicts for a request with `uncached_tokens` to prefill: no prediction
    /// a pick reads is below it.
    pub fn ttft_floor(&self, uncached_tokens: u64) -> f64 {
        self.floor.seconds(uncached_tokens)
    }

    /// Follows the change of `worker`'s model and the prior's in the floor.
    fn refloor(&mut self, worker: K) {
        self.refloor_worker(worker);
        self.refloor_prior();
    }

    /// Follows the change of `worker`'s model (or its leaving) in the floor.
    fn refloor_worker(&mut self, worker: K) {
        let warm = self.config.warm_observations;
        let model = self
            .workers
            .get(&worker)
            .filter(|m| m.observations() >= warm);
        if self.floor.changed(Source::Worker(worker), model) {
            self.rescan_floor();
        }
    }

    /// Follows the change of the prior in the floor.
    fn refloor_prior(&mut self) {
        if self.floor.changed(Source::Prior, Some(&self.prior)) {
            self.rescan_floor();
        }
    }

    /// Finds the floor again over the prior and the warm workers' models.
    fn rescan_floor(&mut self) {
        let warm = self.config.warm_observations;
        let models = std::iter::once((Source::Prior, &self.prior)).chain(
            self.workers
                .iter()
                .filter(move |(_, m)| m.observations() >= warm)
                .map(|(k, m)| (Source::Worker(*k), m)),
        );
        self.floor.rescan(models);
    }

    /// `worker`'s model for sharing with other replicas.
    pub fn snapshot(&self, worker: &K) -> Option<WorkerSnapshot> {
        self.workers.get(worker).map(WorkerModel::to_snapshot)
    }

    /// The pool prior for sharing with other replicas.
    pub fn prior_snapshot(&self) -> WorkerSnapshot {
        self.prior.to_snapshot()
    }

    /// Adopts a peer's model of `worker` when it rests on more observations
    /// than the local one; a malformed snapshot is refused and changes nothing.
    pub fn restore(&mut self, worker: K, snapshot: &WorkerSnapshot) -> Result<(), Rejected> {
        let mut model = WorkerModel::from_snapshot(snapshot)?;
        if model.observations() <= self.observations(&worker) {
            return Ok(());
        }
        if !self.workers.contains_key(&worker) && self.workers.len() >= self.config.max_workers {
            self.evict_oldest();
        }
        self.clock += 1;
        model.touched = self.clock;
        model.keep_slots(self.workers.get(&worker));
        self.pool_slots = self.pool_slots.max(model.slots());
        self.workers.insert(worker, model);
        self.refloor_worker(worker);
        Ok(())
    }

    /// Adopts a peer's pool prior when it rests on more observations.
    pub fn restore_prior(&mut self, snapshot: &WorkerSnapshot) -> Result<(), Rejected> {
        let mut model = WorkerModel::from_snapshot(snapshot)?;
        if model.observations() > self.prior.observations() {
            model.keep_slots(Some(&self.prior));
            self.pool_slots = self.pool_slots.max(model.slots());
            self.prior = model;
            self.refloor_prior();
        }
        Ok(())
    }

    /// Drops the least recently updated worker's model. O(workers), and runs
    /// only when a worker without a model arrives at a full map: workers come
    /// from discovery, and gone ones leave through [`LatencyModels::retain`].
    fn evict_oldest(&mut self) {
        if let Some(oldest) = self
            .workers
            .iter()
            .min_by_key(|(_, m)| m.touched)
            .map(|(k, _)| *k)
        {
            self.workers.remove(&oldest);
            self.refloor_worker(oldest);
        }
    }
}
