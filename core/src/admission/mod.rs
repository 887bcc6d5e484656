//! Admission and flow control: priorities, fairness, saturation, 429.
//!
//! Modelled on the llm-d Router's flow control (v0.10, `pkg/epp/flowcontrol`) and
//! GIE's InferenceObjective priority. Every request with a body is classified
//! ([`priority`]): a priority and a flow. While the pool is not saturated
//! ([`saturation`]) and nothing waits, it goes on at once. Otherwise:
//!
//! - a sheddable request (priority < 0) is rejected at once with
//!   [`Rejection::Saturated`] (429);
//! - any other waits in its priority band's queue for its flow ([`queue`]), until
//!   the dispatcher lets it go (highest band first, flows in turn) or its TTL runs
//!   out ([`Rejection::TtlExpired`], 429); a band holds at most a number of
//!   requests and a byte budget ([`Rejection::QueueFull`], 429).
//!
//! A request waits on a [`Ticket`]; dropping the ticket (the stream was cancelled)
//! takes the request out of its queue at once. A dispatched request holds a
//! [`Permit`] until it is routed (and its in-flight count takes over), so requests
//! let go together are counted against saturation before they land. A pool with
//! no decode worker is never queued: the scheduler answers 503 for it, and 503
//! stays reserved for that.

pub mod priority;
pub mod queue;
pub mod saturation;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::endpoints::{EndpointTable, Snapshot};
pub use priority::{classify, Objectives, RequestClass, RequestSignals};
pub use queue::QueueLevel;
use queue::{Entry, Queues};
pub use saturation::{Saturation, SaturationConfig};

/// Response header carrying why a request was dropped (the llm-d Router's name).
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

/// Settings of admission (flags `--flow-control*`, `--default-priority`).
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Queue under saturation; off, every request goes on at once (classification
    /// and objective metrics still run).
    pub enabled: bool,
    /// Priority of a request that names no known objective and carries no hint.
    pub default_priority: i32,
    /// Longest a request waits in a queue (llm-d `defaultRequestTTL`, 60 s).
    pub ttl: Duration,
    /// Most requests one priority band holds (llm-d `maxRequests`, 5000).
    pub max_band_requests: usize,
    /// Most body bytes one priority band holds.
    pub max_band_bytes: usize,
    /// How often the dispatcher re-reads saturation while requests wait.
    pub dispatch_interval: Duration,
    /// The saturation detector.
    pub saturation: SaturationConfig,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: true,
            default_priority: 0,
            ttl: Duration::from_secs(60),
            max_band_requests: 5000,
            max_band_bytes: 256 << 20,
            dispatch_interval: Duration::from_millis(5),
            saturation: SaturationConfig::default(),
        }
    }
}

/// Why a request was not admitted. Each maps to a 429 with a reason header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// Sheddable and the pool is saturated.
    #[error("the pool is saturated and the request is sheddable")]
    Saturated,
    /// The priority band's queue is at its request or byte limit.
    #[error("the flow-control queue of this priority is full")]
    QueueFull,
    /// The request waited its whole TTL.
    #[error("the request waited its whole flow-control TTL")]
    TtlExpired,
    /// kvpick is shutting down.
    #[error("kvpick is shutting down")]
    ShuttingDown,
    /// Sheddable, and no worker is predicted to meet its TTFT objective
    /// (decided by the pick, after admission let it go).
    #[error(
        "no worker is predicted to meet the request's TTFT objective and the request is sheddable"
    )]
    SloUnreachable,
}

impl Rejection {
    /// The `x-llm-d-request-dropped-reason` value (llm-d's names).
    pub fn reason(self) -> &'static str {
        match self {
            Rejection::Saturated | Rejection::QueueFull => "rejected-saturated",
            Rejection::TtlExpired => "rejected-ttl-expired",
            Rejection::ShuttingDown => "rejected-shutting-down",
            Rejection::SloUnreachable => "rejected-slo-unreachable",
        }
    }
}

/// How a request left flow control (the llm-d `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Let through, at once or after waiting.
    Dispatched,
    /// Sheddable under saturation.
    RejectedSaturated,
    /// Its band was full.
    RejectedCapacity,
    /// Its TTL ran out while queued.
    EvictedTtl,
    /// Its stream went away while queued.
    EvictedCancelled,
    /// Shutdown while queued.
    EvictedOther,
}

impl Outcome {
    /// The label value (llm-d's `QueueOutcome` names).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "Dispatched",
            Outcome::RejectedSaturated => "RejectedSaturated",
            Outcome::RejectedCapacity => "RejectedCapacity",
            Outcome::EvictedTtl => "EvictedTTL",
            Outcome::EvictedCancelled => "EvictedContextCancelled",
            Outcome::EvictedOther => "EvictedOther",
        }
    }

    fn of(rejection: Rejection) -> Outcome {
        match rejection {
            Rejection::Saturated => Outcome::RejectedSaturated,
            Rejection::QueueFull => Outcome::RejectedCapacity,
            Rejection::TtlExpired => Outcome::EvictedTtl,
            Rejection::ShuttingDown => Outcome::EvictedOther,
            // The pool cannot serve it in time: saturated as predicted.
            Rejection::SloUnreachable => Outcome::RejectedSaturated,
        }
    }
}

/// Told about every request's passage through admission (telemetry implements it).
pub trait AdmissionObserver: Send + Sync {
    /// A request was classified.
    fn classified(&self, class: &RequestClass);
    /// A request left flow control after `waited`.
    fn left(&self, class: &RequestClass, outcome: Outcome, waited: Duration);
}

/// An observer that records nothing.
#[derive(Debug, Default)]
pub struct NoObserver;

impl AdmissionObserver for NoObserver {
    fn classified(&self, _: &RequestClass) {}
    fn left(&self, _: &RequestClass, _: Outcome, _: Duration) {}
}

/// What admission says about a request.
#[derive(Debug)]
pub enum Verdict {
    /// Route it now; drop the permit once routed.
    Go(Permit),
    /// Wait on the ticket.
    Wait(Ticket),
    /// Answer 429.
    Reject(Rejection),
}

type Waiter = oneshot::Sender<Result<Permit, Rejection>>;

struct Inner {
    config: AdmissionConfig,
    queues: Mutex<Queues<(Waiter, Instant)>>,
    /// Admitted and not yet routed.
    pending: AtomicUsize,
    next_id: AtomicU64,
    /// Last saturation value read (f64 bits).
    saturation: AtomicU64,
    wake: Notify,
    observer: Arc<dyn AdmissionObserver>,
}

/// The admission gate: objectives, the queues and the saturation detector.
#[derive(Clone)]
pub struct Gate {
    inner: Arc<Inner>,
    objectives: Arc<Objectives>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("config", &self.inner.config)
            .field("queued", &self.queued())
            .finish()
    }
}

impl Gate {
    /// A gate over `objectives`, reporting to `observer`.
    pub fn new(
        config: AdmissionConfig,
        objectives: Arc<Objectives>,
        observer: Arc<dyn AdmissionObserver>,
    ) -> Self {
        Gate {
            inner: Arc::new(Inner {
                config,
                queues: Mutex::new(Queues::default()),
                pending: AtomicUsize::new(0),
                next_id: AtomicU64::new(0),
                saturation: AtomicU64::new(0f64.to_bits()),
                wake: Notify::new(),
                observer,
            }),
            objectives,
        }
    }

    /// The settings.
    pub fn config(&self) -> &AdmissionConfig {
        &self.inner.config
    }

    /// The objectives table (the Kubernetes watch writes it).
    pub fn objectives(&self) -> &Arc<Objectives> {
        &self.objectives
    }

    /// Classifies a request (see [`priority::classify`]) and tells the observer.
    pub fn classify(&self, signals: RequestSignals<'_>) -> RequestClass {
        let class = classify(
            &self.objectives,
            self.inner.config.default_priority,
            signals,
        );
        self.inner.observer.classified(&class);
        class
    }

    /// Requests queued now.
    pub fn queued(&self) -> usize {
        self.inner.queues.lock().len()
    }

    /// What each (priority, flow) queue holds now.
    pub fn levels(&self) -> Vec<QueueLevel> {
        self.inner.queues.lock().levels()
    }

    /// The saturation last read (0 before any reading).
    pub fn last_saturation(&self) -> f64 {
        f64::from_bits(self.inner.saturation.load(Ordering::Relaxed))
    }

    /// Admits `class` against the pool in `snapshot`.
    pub fn admit(&self, class: RequestClass, snapshot: &Snapshot) -> Verdict {
        self.admit_at(class, snapshot, Instant::now())
    }

    /// [`Gate::admit`] at a given instant (the benchmark drives the clock).
    pub fn admit_at(&self, class: RequestClass, snapshot: &Snapshot, now: Instant) -> Verdict {
        let inner = &self.inner;
        if !inner.config.enabled {
            return self.go(class);
        }
        let Some(saturation) = self.measure(snapshot, now) else {
            // No decode worker: let the scheduler answer 503.
            return self.go(class);
        };
        let mut queues = inner.queues.lock();
        if queues.is_empty() && !saturation.is_saturated() {
            drop(queues);
            return self.go(class);
        }
        if saturation.is_saturated() && class.is_sheddable() {
            drop(queues);
            return self.reject(class, Rejection::Saturated);
        }
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let entry = Entry {
            id,
            bytes: class.bytes,
            deadline: now + inner.config.ttl,
            waiter: (tx, now),
        };
        let pushed = queues.push(
            class.priority,
            &class.flow,
            entry,
            inner.config.max_band_requests,
            inner.config.max_band_bytes,
        );
        if let Err((full, _)) = pushed {
            drop(queues);
            tracing::debug!(?full, priority = class.priority, "flow-control band full");
            return self.reject(class, Rejection::QueueFull);
        }
        self.dispatch_locked(&mut queues, snapshot, now);
        drop(queues);
        inner.wake.notify_one();
        Verdict::Wait(Ticket {
            gate: Arc::clone(inner),
            class: Some(class),
            id,
            enqueued: now,
            rx,
        })
    }

    /// Expires requests whose TTL ran out and lets queued requests go, highest
    /// priority first and flows in turn, while the pool is not saturated.
    pub fn dispatch_at(&self, snapshot: &Snapshot, now: Instant) {
        let mut queues = self.inner.queues.lock();
        self.dispatch_locked(&mut queues, snapshot, now);
    }

    /// Runs the dispatcher over `endpoints` until dropped: every dispatch interval
    /// while requests wait, and at once when one arrives or a permit is released.
    pub async fn run(self, endpoints: Arc<EndpointTable>) {
        let every = self.inner.config.dispatch_interval;
        loop {
            if self.queued() == 0 {
                self.inner.wake.notified().await;
            } else {
                tokio::select! {
                    _ = self.inner.wake.notified() => {}
                    _ = tokio::time::sleep(every) => {}
                }
            }
            self.dispatch_at(&endpoints.snapshot(), Instant::now());
        }
    }

    fn dispatch_locked(
        &self,
        queues: &mut Queues<(Waiter, Instant)>,
        snapshot: &Snapshot,
        now: Instant,
    ) {
        for e in queues.expire(now) {
            let _ = e.waiter.0.send(Err(Rejection::TtlExpired));
        }
        while !queues.is_empty() {
            // With no decode worker left, waiting cannot help: let them reach the 503.
            if self
                .measure(snapshot, now)
                .is_some_and(|s| s.is_saturated())
            {
                break;
            }
            let Some(e) = queues.pop() else { break };
            // A closed waiter (cancelled in between) drops the permit, releasing it.
            let _ = e.waiter.0.send(Ok(self.permit()));
        }
    }

    fn measure(&self, snapshot: &Snapshot, now: Instant) -> Option<Saturation> {
        let pending = self.inner.pending.load(Ordering::Relaxed);
        let s = saturation::measure(&self.inner.config.saturation, snapshot, now, pending);
        let value = s.map_or(0.0, |s| s.value);
        self.inner
            .saturation
            .store(value.to_bits(), Ordering::Relaxed);
        s
    }

    fn permit(&self) -> Permit {
        self.inner.pending.fetch_add(1, Ordering::Relaxed);
        Permit {
            gate: Arc::clone(&self.inner),
        }
    }

    fn go(&self, class: RequestClass) -> Verdict {
        // Switched off, requests never pass through flow control (as in llm-d).
        if self.inner.config.enabled {
            self.inner
                .observer
                .left(&class, Outcome::Dispatched, Duration::ZERO);
        }
        Verdict::Go(self.permit())
    }

    fn reject(&self, class: RequestClass, why: Rejection) -> Verdict {
        self.inner
            .observer
            .left(&class, Outcome::of(why), Duration::ZERO);
        Verdict::Reject(why)
    }
}

/// A dispatched request not yet routed; counts against saturation until dropped.
pub struct Permit {
    gate: Arc<Inner>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Permit")
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let _ = self
            .gate
            .pending
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
        // The dispatcher has work only while a request waits (one queued later
        // is dispatched or woken for by `admit`), so a permit released with the
        // queues empty wakes nobody. Not locked here: a permit is dropped under
        // the queues' lock when its waiter has gone; then the wake is kept.
        if !self.gate.queues.try_lock().is_some_and(|q| q.is_empty()) {
            self.gate.wake.notify_one();
        }
    }
}

/// A queued request. [`Ticket::wait`] resolves when it is dispatched or rejected;
/// dropping it first takes the request out of its queue at once.
pub struct Ticket {
    gate: Arc<Inner>,
    /// `None` once resolved.
    class: Option<RequestClass>,
    id: u64,
    enqueued: Instant,
    rx: oneshot::Receiver<Result<Permit, Rejection>>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish()
    }
}

impl Ticket {
    /// Waits for the verdict. Cancel-safe: dropping the future keeps the ticket queued.
    pub async fn wait(&mut self) -> Result<Permit, Rejection> {
        let result = (&mut self.rx).await.unwrap_or(Err(Rejection::ShuttingDown));
        self.resolved(result)
    }

    /// The verdict if it is already in, without waiting.
    pub fn try_verdict(&mut self) -> Option<Result<Permit, Rejection>> {
        match self.rx.try_recv() {
            Ok(result) => Some(self.resolved(result)),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                Some(self.resolved(Err(Rejection::ShuttingDown)))
            }
        }
    }

    fn resolved(&mut self, result: Result<Permit, Rejection>) -> Result<Permit, Rejection> {
        if let Some(class) = self.class.take() {
            let outcome = match &result {
                Ok(_) => Outcome::Dispatched,
                Err(why) => Outcome::of(*why),
            };
            self.gate
                .observer
                .left(&class, outcome, self.enqueued.elapsed());
        }
        result
    }

    /// The class of the waiting request (`None` once resolved).
    pub fn class(&self) -> Option<&RequestClass> {
        self.class.as_ref()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(class) = self.class.take() else {
            return;
        };
        let removed = self
            .gate
            .queues
            .lock()
            .remove(class.priority, &class.flow, self.id);
        if removed.is_some() {
            self.gate
                .observer
                .left(&class, Outcome::EvictedCancelled, self.enqueued.elapsed());
        }
        // Otherwise the verdict was sent and not read: a permit inside the channel
        // is dropped with it, releasing its pending count.
    }
}

#[cfg(test)]
mod tests;
