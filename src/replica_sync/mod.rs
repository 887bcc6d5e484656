//! Replica sync over a Redis (or Valkey) stream: kvpick replicas behind one
//! gateway share the routing state their decisions create (see
//! [`crate::replica`] and `docs/replicas.md`).
//!
//! - The scheduler pushes [`Delta`]s into a bounded queue ([`QueueSink`]); a
//!   full queue drops the delta and counts it. The request path never waits.
//! - The publisher drains the queue into batches, one `XADD` each (the stream
//!   capped near [`SyncConfig::retain`] entries). A reporter queues this
//!   replica's own bookings ([`Delta::Loads`]) every [`SyncConfig::report_every`]:
//!   its heartbeat, and the correction for any delta lost.
//! - The subscriber reads the stream (`XREAD BLOCK`) and applies peers'
//!   batches (its own are skipped by replica id); peers silent for
//!   [`SyncConfig::lease`] lose their bookings.
//! - Warm start: before the replica reports Ready, the subscriber replays the
//!   retained stream (bookings only from entries younger than a lease), within
//!   [`SyncConfig::warm_start_timeout`]; past it the replica is Ready anyway,
//!   with a warning and `kvpick_replica_sync_warm_start_timeouts_total`.
//! - A server down or slow: commands time out, the replica keeps routing on
//!   its local state, counts the errors and reconnects with back-off; after a
//!   reconnect the subscriber resumes after the last entry it applied.
//! - Latency models (`--scoring predicted`): every
//!   [`SyncConfig::models_every`] a task publishes this replica's pool prior
//!   and up to [`MAX_SHARED_MODELS`] workers' models in an entry of their own,
//!   taking the workers in turn, so each model is republished within
//!   ⌈workers / [`MAX_SHARED_MODELS`]⌉ periods. A replica that starts replays
//!   them with the rest of the stream before it is Ready (it predicts warm);
//!   one whose server returned empty gets them again within those periods.
//!   Receivers adopt a model only when it rests on more observations than
//!   theirs, and only for workers they know.
//! - The scheduler is told whether state is shared
//!   ([`Scheduler::set_shared_state`]): not from the start until the
//!   subscriber's first successful read, nor from a failed read until a read
//!   succeeds again. Meanwhile replicas break near-ties alike
//!   (`docs/replicas.md`, "Without the server").

pub mod codec;
pub mod metrics;
pub mod resp;

pub use metrics::SyncMetrics;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::endpoints::EndpointTable;
use crate::error_chain::ErrorChain;
use crate::latency::{Learner, MAX_SHARED_MODELS};
use crate::replica::{Delta, PeerLoads, ReplicaId, ReplicaSink};
use crate::scheduler::Scheduler;
use resp::{Conn, RespError, Target, Value};

/// Replica sync settings.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// The server.
    pub target: Target,
    /// The stream key (one per pool).
    pub stream: String,
    /// Deltas queued at most before new ones are dropped.
    pub queue: usize,
    /// Most deltas in one published batch.
    pub batch: usize,
    /// How often this replica reports its own bookings (its heartbeat).
    pub report_every: Duration,
    /// Silence after which a peer's bookings are released.
    pub lease: Duration,
    /// Stream entries the server keeps (approximately): the warm-start tail.
    pub retain: usize,
    /// Longest a warm start holds readiness back.
    pub warm_start_timeout: Duration,
    /// Timeout of one command (beyond `XREAD`'s blocking time).
    pub command_timeout: Duration,
    /// Longest pause between reconnection attempts.
    pub max_backoff: Duration,
    /// How often this replica publishes its latency models (predicted
    /// scoring only).
    pub models_every: Duration,
}

impl SyncConfig {
    /// Defaults for `url` and the pool `pool`.
    pub fn new(url: &str, pool: &str) -> Result<SyncConfig, RespError> {
        Ok(SyncConfig {
            target: Target::parse(url)?,
            stream: format!("kvpick:{pool}:sync"),
            queue: 65_536,
            batch: 1_024,
            report_every: Duration::from_millis(500),
            lease: Duration::from_secs(5),
            retain: 10_000,
            warm_start_timeout: Duration::from_secs(10),
            command_timeout: Duration::from_secs(1),
            max_backoff: Duration::from_secs(1),
            models_every: Duration::from_secs(5),
        })
    }
}

/// The scheduler's sink: a bounded queue the publisher drains.
#[derive(Debug)]
pub struct QueueSink {
    tx: mpsc::Sender<Delta>,
    metrics: Arc<SyncMetrics>,
}

impl ReplicaSink for QueueSink {
    fn push(&self, delta: Delta) {
        if self.tx.try_send(delta).is_err() {
            self.metrics.dropped.inc();
        }
    }
}

/// Running replica sync: its tasks stop when this is dropped.
#[derive(Debug)]
pub struct ReplicaSync {
    /// This replica's id.
    pub id: ReplicaId,
    /// Turns true once the warm start is over (loaded or timed out).
    pub ready: watch::Receiver<bool>,
    /// Peers' bookings.
    pub peers: Arc<PeerLoads>,
    /// The metrics.
    pub metrics: Arc<SyncMetrics>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ReplicaSync {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl ReplicaSync {
    /// Starts sync for `scheduler` (its sink is set here) over `endpoints`.
    pub fn start(
        config: SyncConfig,
        scheduler: Arc<Scheduler>,
        endpoints: Arc<EndpointTable>,
        metrics: Arc<SyncMetrics>,
    ) -> ReplicaSync {
        let id = rand::random::<u64>();
        let (tx, rx) = mpsc::channel(config.queue);
        let sink = Arc::new(QueueSink {
            tx,
            metrics: Arc::clone(&metrics),
        });
        // Nothing is shared until the subscriber follows the stream.
        scheduler.set_shared_state(false);
        if !scheduler.set_replica_sink(sink.clone()) {
            tracing::warn!("replica sync: the scheduler already had a sink");
        }
        let peers = Arc::new(PeerLoads::new(config.lease, 1_024));
        let (ready_tx, ready) = watch::channel(false);
        let config = Arc::new(config);
        let models = scheduler.latency().map(|learner| {
            tokio::spawn(share_models(
                Arc::clone(&config),
                id,
                Arc::clone(learner),
                Arc::clone(&metrics),
            ))
        });
        let mut tasks = vec![
            tokio::spawn(publish(Arc::clone(&config), id, rx, Arc::clone(&metrics))),
            tokio::spawn(report(
                config.report_every,
                sink,
                Arc::clone(&peers),
                Arc::clone(&endpoints),
            )),
            tokio::spawn(subscribe(
                Arc::clone(&config),
                id,
                Applier {
                    scheduler,
                    endpoints,
                    peers: Arc::clone(&peers),
                    metrics: Arc::clone(&metrics),
                },
                ready_tx,
            )),
        ];
        tasks.extend(models);
        tracing::info!(
            replica = format_args!("{id:016x}"),
            server = %config.target.addr,
            stream = %config.stream,
            "replica sync on"
        );
        ReplicaSync {
            id,
            ready,
            peers,
            metrics,
            tasks,
        }
    }

    /// Waits until the warm start is over.
    pub async fn wait_ready(&self) {
        let mut r = self.ready.clone();
        let _ = r.wait_for(|v| *v).await;
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Connects, retrying with doubling back-off up to `max_backoff` (counted).
async fn connect(config: &SyncConfig, metrics: &SyncMetrics, first: &mut bool) -> Conn {
    let mut backoff = Duration::from_millis(50);
    loop {
        match Conn::open(&config.target, config.command_timeout).await {
            Ok(c) => {
                if !std::mem::take(first) {
                    metrics.reconnects.inc();
                    tracing::info!(server = %config.target.addr, "replica sync reconnected");
                }
                return c;
            }
            Err(e) => {
                metrics.errors.inc();
                tracing::debug!(error = %ErrorChain(&e), "replica sync cannot connect");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(config.max_backoff);
    }
}

/// Drains the queue into batches and appends each to the stream. A batch
/// whose `XADD` fails is dropped (counted); the next reports correct loads.
async fn publish(
    config: Arc<SyncConfig>,
    id: ReplicaId,
    mut rx: mpsc::Receiver<Delta>,
    metrics: Arc<SyncMetrics>,
) {
    let mut first = true;
    let mut conn: Option<Conn> = None;
    let retain = config.retain.to_string();
    let mut batch = Vec::with_capacity(config.batch);
    while let Some(d) = rx.recv().await {
        batch.push(d);
        while batch.len() < config.batch {
            match rx.try_recv() {
                Ok(d) => batch.push(d),
                Err(_) => break,
            }
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => conn.insert(connect(&config, &metrics, &mut first).await),
        };
        let bytes = codec::encode(id, now_us(), &batch);
        match append(c, &config, &retain, &bytes).await {
            Ok(_) => {
                metrics.published.inc_by(batch.len() as u64);
                metrics.published_bytes.inc_by(bytes.len() as u64);
            }
            Err(e) => {
                metrics.errors.inc();
                metrics.dropped.inc_by(batch.len() as u64);
                tracing::warn!(error = %ErrorChain(&e), "replica sync publish failed; routing on local state");
                conn = None;
            }
        }
        batch.clear();
    }
}

/// Appends one entry of `bytes` to the stream, capped near `retain` entries.
async fn append(
    c: &mut Conn,
    config: &SyncConfig,
    retain: &str,
    bytes: &[u8],
) -> Result<Value, RespError> {
    let args: [&[u8]; 8] = [
        b"XADD",
        config.stream.as_bytes(),
        b"MAXLEN",
        b"~",
        retain.as_bytes(),
        b"*",
        b"d",
        bytes,
    ];
    c.cmd(&args, Duration::ZERO).await
}

/// Publishes this replica's latency models every
/// [`SyncConfig::models_every`] (see the module doc); nothing before its
/// first observation. A failed append is counted and retried next period.
async fn share_models(
    config: Arc<SyncConfig>,
    id: ReplicaId,
    learner: Arc<Learner>,
    metrics: Arc<SyncMetrics>,
) {
    let mut first = true;
    let mut conn: Option<Conn> = None;
    let retain = config.retain.to_string();
    let mut after = None;
    let mut tick = tokio::time::interval(config.models_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some((prior, workers)) = learner.shared(after, MAX_SHARED_MODELS) else {
            continue;
        };
        let last = workers.last().map(|(k, _)| *k);
        let bytes = codec::encode(id, now_us(), &[Delta::Models { prior, workers }]);
        let c = match conn.as_mut() {
            Some(c) => c,
            None => conn.insert(connect(&config, &metrics, &mut first).await),
        };
        match append(c, &config, &retain, &bytes).await {
            Ok(_) => {
                after = last;
                metrics.published.inc();
                metrics.published_bytes.inc_by(bytes.len() as u64);
            }
            Err(e) => {
                metrics.errors.inc();
                tracing::warn!(error = %ErrorChain(&e), "replica sync could not publish the latency models");
                conn = None;
            }
        }
    }
}

/// Queues this replica's own bookings every `every`.
async fn report(
    every: Duration,
    sink: Arc<QueueSink>,
    peers: Arc<PeerLoads>,
    endpoints: Arc<EndpointTable>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if endpoints.is_synced() {
            sink.push(Delta::Loads(peers.own(&endpoints.snapshot())));
        }
    }
}

/// Applies peers' batches to this replica.
struct Applier {
    scheduler: Arc<Scheduler>,
    endpoints: Arc<EndpointTable>,
    peers: Arc<PeerLoads>,
    metrics: Arc<SyncMetrics>,
}

impl Applier {
    /// Applies one stream entry `(id, fields)` unless it is `own`'s. With
    /// `replay`, bookings only from entries younger than a lease.
    fn entry(&self, own: ReplicaId, entry: Value, replay: bool) -> Result<String, RespError> {
        let mut e = entry.into_array()?.into_iter();
        let id = e
            .next()
            .ok_or(RespError::Protocol("stream entry without id"))?
            .into_bytes()?;
        let id = String::from_utf8(id).map_err(|_| RespError::Protocol("stream id"))?;
        let fields = e
            .next()
            .ok_or(RespError::Protocol("stream entry without fields"))?
            .into_array()?;
        let Some(payload) = fields.into_iter().nth(1) else {
            self.metrics.decode_errors.inc();
            return Ok(id);
        };
        match codec::decode(&payload.into_bytes()?) {
            Ok(b) if b.from == own => {}
            Ok(b) => {
                let now_us = now_us();
                let age = Duration::from_micros(now_us.saturating_sub(b.sent_us));
                if !replay {
                    self.metrics.observe_propagation(age.as_secs_f64());
                }
                let bookings = !replay || age < self.peers.lease();
                let snapshot = self.endpoints.snapshot();
                let now = Instant::now();
                self.metrics.applied.inc_by(b.deltas.len() as u64);
                for d in b.deltas {
                    self.scheduler
                        .apply_peer(b.from, d, &self.peers, &snapshot, bookings, now);
                }
            }
            Err(e) => {
                self.metrics.decode_errors.inc();
                tracing::debug!(error = %ErrorChain(&e), "replica sync entry skipped");
            }
        }
        Ok(id)
    }

    fn expire(&self) {
        self.peers.expire(Instant::now());
        self.metrics.peers.set(self.peers.peers() as i64);
    }
}

/// Warm start, then follows the stream for good.
async fn subscribe(
    config: Arc<SyncConfig>,
    own: ReplicaId,
    applier: Applier,
    ready: watch::Sender<bool>,
) {
    let mut first = true;
    let started = Instant::now();
    let mut last = warm_start(&config, own, &applier, &mut first).await;
    match &last {
        Some(_) => tracing::info!(took = ?started.elapsed(), "replica sync warm start loaded"),
        None => {
            applier.metrics.warm_start_timeouts.inc();
            tracing::warn!(
                bound = ?config.warm_start_timeout,
                "replica sync warm start did not finish in time; Ready on local state"
            );
        }
    }
    ready.send_replace(true);
    let block = Duration::from_millis(250);
    let block_ms = block.as_millis().to_string();
    let mut conn: Option<Conn> = None;
    loop {
        applier.expire();
        let c = match conn.as_mut() {
            Some(c) => c,
            None => {
                applier.metrics.connected.set(0);
                let c = conn.insert(connect(&config, &applier.metrics, &mut first).await);
                applier.metrics.connected.set(1);
                c
            }
        };
        let from = last.clone().unwrap_or_else(|| "$".into());
        let args: [&[u8]; 7] = [
            b"XREAD",
            b"COUNT",
            b"1000",
            b"BLOCK",
            block_ms.as_bytes(),
            b"STREAMS",
            config.stream.as_bytes(),
        ];
        let mut args = args.to_vec();
        args.push(from.as_bytes());
        let entries = match c.cmd(&args, block).await.and_then(stream_entries) {
            Ok(e) => e,
            Err(e) => {
                applier.metrics.errors.inc();
                applier.scheduler.set_shared_state(false);
                tracing::warn!(error = %ErrorChain(&e), "replica sync read failed; routing on local state");
                conn = None;
                continue;
            }
        };
        applier.scheduler.set_shared_state(true);
        if last.is_none() && entries.is_empty() {
            // `$` stays `$` until a first entry: remember where reading began.
            last = Some(format!("{}-0", now_us() / 1_000));
        }
        for e in entries {
            match applier.entry(own, e, false) {
                Ok(id) => last = Some(id),
                Err(e) => {
                    applier.metrics.decode_errors.inc();
                    tracing::debug!(error = %ErrorChain(&e), "replica sync entry skipped");
                }
            }
        }
    }
}

/// The entries of an `XREAD` reply for one stream (none when it timed out).
fn stream_entries(reply: Value) -> Result<Vec<Value>, RespError> {
    let Some(stream) = reply.into_array()?.into_iter().next() else {
        return Ok(Vec::new());
    };
    let mut s = stream.into_array()?.into_iter();
    s.next(); // the key
    s.next().map_or(Ok(Vec::new()), Value::into_array)
}

/// Replays the retained stream once the endpoint table has synced; returns
/// the last entry's id (`0-0` for an empty stream), or `None` when the bound
/// passed first.
async fn warm_start(
    config: &SyncConfig,
    own: ReplicaId,
    applier: &Applier,
    first: &mut bool,
) -> Option<String> {
    let work = async {
        let mut synced = applier.endpoints.subscribe_synced();
        let _ = synced.wait_for(|s| *s).await;
        let mut conn = connect(config, &applier.metrics, first).await;
        applier.metrics.connected.set(1);
        let mut last = "0-0".to_string();
        loop {
            let start = format!("({last}");
            let args: [&[u8]; 6] = [
                b"XRANGE",
                config.stream.as_bytes(),
                start.as_bytes(),
                b"+",
                b"COUNT",
                b"1000",
            ];
            let entries = match conn
                .cmd(&args, Duration::ZERO)
                .await
                .and_then(Value::into_array)
            {
                Ok(e) => e,
                Err(e) => {
                    applier.metrics.errors.inc();
                    tracing::warn!(error = %ErrorChain(&e), "replica sync warm start read failed; retrying");
                    conn = connect(config, &applier.metrics, first).await;
                    continue;
                }
            };
            if entries.is_empty() {
                return last;
            }
            applier
                .metrics
                .warm_start_entries
                .inc_by(entries.len() as u64);
            for e in entries {
                match applier.entry(own, e, true) {
                    Ok(id) => last = id,
                    Err(_) => {
                        applier.metrics.decode_errors.inc();
                    }
                }
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(config.warm_start_timeout, work)
        .await
        .ok()
}
