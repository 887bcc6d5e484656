//! ZMQ subscribers: one SUB socket per ready (worker, dp rank), feeding one ingest
//! thread through a queue bounded by bytes.
//!
//! - Subscriber tasks (tokio) only receive frames and check sequence numbers;
//!   decoding and index updates run on a dedicated `kv-ingest` OS thread, so a
//!   burst of events never takes runtime threads from request routing.
//! - The queue ([`super::queue`]) holds at most
//!   [`SubscriberConfig::max_queued_bytes`] of batches, one FIFO per worker
//!   rank served in turns. A batch that does not fit drops the batches of the
//!   rank holding the most (the flooder), which is reset before its next batch
//!   applies (its index part would be wrong otherwise); another rank's events
//!   keep flowing and wait behind at most one batch of each other rank.
//! - A sequence gap is repaired from the engine's replay socket (ZMQ ROUTER; we
//!   send `("", start_seq)` from a DEALER and read `("", seq, payload)` replies up
//!   to the `seq = -1` end marker) when a replay port is configured and the engine
//!   still buffers the missing batches; otherwise, and on a sequence that goes
//!   backwards (engine restart) or a new connection, the worker's part of the index
//!   is cleared.
//! - A worker is precise while its SUB socket is connected, approximate otherwise.
//!
//! Transport: [`super::zmtp`], our own ZMTP 3.0 client over TCP (SUB and DEALER),
//! so kvpick needs no C toolchain or libzmq at build time and stays a static
//! binary, and every message is held to [`SubscriberConfig::max_message_bytes`]
//! before it is read (the `zeromq` crate has no such limit: see that module).
//! A message past the limit, or a stream that is not ZMTP, ends the connection;
//! the subscriber reconnects with backoff and the worker's part of the index is
//! reset, as on any lost connection.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::metrics::KvEventMetrics;
use super::queue::{self, IngestQueue, Item, Receiver, ResetReason, BATCH_OVERHEAD};
use super::zmtp::{Connection, Limits, ZmtpError};
use super::{decode_seq, decoder, parse_topic, Ingest, KvEventSink, SeqCheck, SeqTracker};
use crate::endpoints::{EndpointTable, Engine, WorkerKey};
use crate::error_chain::ErrorChain;

/// Subscriber settings.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// Engine KV-event PUB port when the endpoint does not name one (rank r uses
    /// `port + r`, as vLLM offsets it per data-parallel rank).
    pub port: u16,
    /// Engine replay (ROUTER) port, rank-offset the same way; `None` disables replay.
    pub replay_port: Option<u16>,
    /// Model name that seeds block hashes when the topic does not name one; must
    /// equal the `model` of the requests routed to these workers.
    pub model: String,
    /// Bytes of batches queued between subscribers and the ingest thread, all
    /// ranks together (at least one largest message: `max_message_bytes` plus
    /// [`BATCH_OVERHEAD`]).
    pub max_queued_bytes: usize,
    /// Time allowed to connect (and to finish a replay).
    pub connect_timeout: Duration,
    /// First retry delay after a failed or lost connection (doubles up to 30 s).
    pub retry_delay: Duration,
    /// The model's image token id, for rewriting vLLM image blocks into pad values.
    pub image_token: Option<u32>,
    /// Largest KV-event message accepted (all frames together); a larger one
    /// ends the connection.
    pub max_message_bytes: usize,
}

/// Frames in one KV-event message: (topic, seq, payload), or the replay socket's
/// (delimiter, seq, payload); a little room for peers that add one.
const MAX_FRAMES: usize = 8;

impl SubscriberConfig {
    fn limits(&self) -> Limits {
        Limits {
            max_message_bytes: self.max_message_bytes,
            max_frames: MAX_FRAMES,
        }
    }
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            port: 5557,
            replay_port: None,
            model: String::new(),
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            connect_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_millis(200),
            image_token: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// Default [`SubscriberConfig::max_message_bytes`]: 8 MiB, far above a vLLM batch
/// (one engine step's events; a 128k-token prefill stores under 1 MB of them).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Default [`SubscriberConfig::max_queued_bytes`]: 256 MiB, 32 largest messages,
/// thousands of ordinary batches (a few KiB each) waiting for one ingest pass.
pub const DEFAULT_MAX_QUEUED_BYTES: usize = 256 << 20;

fn ingest_loop(rx: Receiver, mut ingest: Ingest<dyn KvEventSink>, metrics: Arc<KvEventMetrics>) {
    while let Some((worker, item)) = rx.next() {
        match item {
            Item::Batch {
                engine,
                topic,
                payload,
                received,
            } => {
                let batch = match decoder(engine).decode(&payload) {
                    Ok(b) => b,
                    Err(e) => {
                        metrics.decode_error();
                        debug!(%worker, error = %ErrorChain(&e), "undecodable KV event batch");
                        // The batch's effect is unknown: start over for this worker.
                        ingest.reset(worker);
                        metrics.reset(worker, ResetReason::Gap);
                        continue;
                    }
                };
                let topic = parse_topic(&topic);
                let stats = ingest.apply(
                    worker,
                    topic.as_ref().map(|t| t.model.as_str()),
                    &batch,
                    Instant::now(),
                );
                metrics.applied(worker, &stats, received);
            }
            Item::Live(live) => {
                ingest.set_live(worker, live);
                metrics.live(worker, live);
            }
            Item::Forget => {
                ingest.set_live(worker, false);
                metrics.forget(worker);
            }
            Item::Reset(reason) => {
                ingest.reset(worker);
                metrics.reset(worker, reason);
            }
            // Dropping it tells the flush this rank's earlier items are applied.
            Item::Flush(done) => drop(done),
        }
    }
}

/// One KV-event stream to follow: a worker rank and where its engine publishes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// The worker rank the events describe.
    pub worker: WorkerKey,
    /// The engine publishing them (which decoder reads them).
    pub engine: Engine,
    /// The engine's IP address.
    pub host: IpAddr,
    /// PUB port.
    pub port: u16,
    /// ROUTER (replay) port, if the engine has one.
    pub replay_port: Option<u16>,
}

/// The running KV-event machinery: the queue into the ingest thread and a way to
/// add subscribers. Every KV event is applied on that one thread, so the prefix
/// index has one precise writer ([`IngestThread`]).
#[derive(Clone)]
pub struct KvEvents {
    tx: IngestQueue,
    metrics: Arc<KvEventMetrics>,
    config: Arc<SubscriberConfig>,
}

impl KvEvents {
    /// Starts the ingest thread, which applies events to `sink`; the caller owns
    /// it and joins it when it shuts down ([`IngestThread::join`]).
    pub fn start(
        sink: Arc<dyn KvEventSink>,
        metrics: Arc<KvEventMetrics>,
        config: SubscriberConfig,
    ) -> (Self, IngestThread) {
        // One largest message always fits.
        let budget = config
            .max_queued_bytes
            .max(config.max_message_bytes + BATCH_OVERHEAD);
        let (tx, rx) = queue::queue(budget, metrics.queued_bytes());
        let ingest = Ingest::new(sink, config.model.clone()).with_image_token(config.image_token);
        let m = Arc::clone(&metrics);
        let thread = std::thread::Builder::new()
            .name("kv-ingest".into())
            .spawn(move || ingest_loop(rx, ingest, m))
            .expect("spawning the kv-ingest thread");
        let events = KvEvents {
            tx,
            metrics,
            config: Arc::new(config),
        };
        (events, IngestThread(thread))
    }

    /// Starts following one stream; the subscriber stops when the handle is dropped.
    pub fn subscribe(&self, target: Target) -> Subscription {
        let worker = target.worker;
        let task = tokio::spawn(run_subscriber(
            target,
            Arc::clone(&self.config),
            self.tx.clone(),
            Arc::clone(&self.metrics),
        ));
        Subscription {
            worker,
            task,
            tx: self.tx.clone(),
        }
    }

    /// Waits until everything sent to the ingest thread so far has been applied.
    pub async fn flush(&self) {
        self.tx.flush().await;
    }

    /// Bytes of batches queued for the ingest thread now, and the most ever.
    pub fn queued_bytes(&self) -> (usize, usize) {
        self.tx.bytes()
    }

    /// The streams to follow for the endpoints in `table` now: every rank of every
    /// endpoint whose engine publishes KV events ([`super::EventDecoder::publishes`]).
    pub fn targets(&self, table: &EndpointTable) -> Vec<Target> {
        let snapshot = table.snapshot();
        let mut out = Vec::new();
        for e in &snapshot.endpoints {
            if !decoder(e.endpoint.engine).publishes() {
                continue;
            }
            let port = e.endpoint.kv_events_port.unwrap_or(self.config.port);
            for rank in 0..e.ranks() {
                let offset = |p: u16| p.checked_add(u16::try_from(rank).ok()?);
                let Some(port) = offset(port) else { continue };
                out.push(Target {
                    worker: e.key(rank),
                    engine: e.endpoint.engine,
                    host: e.endpoint.address.ip(),
                    port,
                    replay_port: self.config.replay_port.and_then(offset),
                });
            }
        }
        out
    }

    /// Keeps one subscriber per target of `table`, checking for changes every
    /// `every`; subscribers come and go with the endpoint set. Runs forever.
    pub async fn follow(self, table: Arc<EndpointTable>, every: Duration) {
        let mut running: HashMap<Target, Subscription> = HashMap::new();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let wanted = self.targets(&table);
            let gone: Vec<Target> = running
                .keys()
                .filter(|t| !wanted.contains(t))
                .cloned()
                .collect();
            for t in gone {
                if let Some(sub) = running.remove(&t) {
                    sub.stop();
                }
            }
            for t in wanted {
                if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(t) {
                    let sub = self.subscribe(slot.key().clone());
                    slot.insert(sub);
                }
            }
        }
    }
}

/// The `kv-ingest` thread, which applies every KV event to the sink. It ends
/// once every sender of its queue is gone (the [`KvEvents`] handles, their
/// [`Subscription`]s and subscriber tasks), after applying what was queued.
#[must_use = "join the ingest thread where its owner shuts down"]
pub struct IngestThread(std::thread::JoinHandle<()>);

impl IngestThread {
    /// Waits for the thread to end (a blocking wait, run off the runtime's
    /// worker threads); a panic on the thread is raised here.
    pub async fn join(self) {
        let thread = self.0;
        match tokio::task::spawn_blocking(move || thread.join()).await {
            Ok(Ok(())) => {}
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

/// A running subscriber. [`Subscription::stop`] (or dropping it) stops it and
/// queues the forget of its worker rank (it falls back to approximate mode).
pub struct Subscription {
    worker: WorkerKey,
    task: JoinHandle<()>,
    tx: IngestQueue,
}

impl Subscription {
    /// Stops the subscriber and queues the forget of its worker rank (what
    /// dropping it does, said where it is meant).
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
        self.tx.push_control(self.worker, Item::Forget);
    }
}

async fn run_subscriber(
    target: Target,
    config: Arc<SubscriberConfig>,
    tx: IngestQueue,
    metrics: Arc<KvEventMetrics>,
) {
    let mut delay = config.retry_delay;
    loop {
        match follow_stream(&target, &config, &tx, &metrics).await {
            Ok(()) => delay = config.retry_delay,
            Err(e) => {
                debug!(worker = %target.worker, port = target.port, error = %ErrorChain(&e), "KV event stream unavailable")
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Follows one connection until it is lost. `Ok` after a connection that worked.
async fn follow_stream(
    target: &Target,
    config: &SubscriberConfig,
    tx: &IngestQueue,
    metrics: &KvEventMetrics,
) -> Result<(), ZmtpError> {
    let worker = target.worker;
    let mut socket = Connection::connect(
        std::net::SocketAddr::new(target.host, target.port),
        "SUB",
        config.limits(),
        config.connect_timeout,
    )
    .await?;
    socket.subscribe_all().await?;
    if tx.is_closed() {
        return Ok(());
    }
    tx.push_control(worker, Item::Live(true));
    let mut seq = SeqTracker::new();
    loop {
        let mut frames = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                if !matches!(e, ZmtpError::Io(_)) {
                    metrics.decode_error();
                    warn!(%worker, error = %ErrorChain(&e), "KV event stream dropped");
                } else {
                    debug!(%worker, error = %ErrorChain(&e), "KV event stream ended");
                }
                break;
            }
        };
        let received = Instant::now();
        if frames.len() != 3 {
            metrics.decode_error();
            continue;
        }
        let payload = frames.pop().unwrap_or_default();
        let Ok(s) = decode_seq(&frames[1]) else {
            metrics.decode_error();
            continue;
        };
        let topic = frames.swap_remove(0);
        match seq.observe(s) {
            SeqCheck::First | SeqCheck::Next => {}
            SeqCheck::Restart => tx.push_control(worker, Item::Reset(ResetReason::Restart)),
            SeqCheck::Gap { from, to } => {
                let replayed = match target.replay_port {
                    Some(port) => replay(target.host, port, from, to, config)
                        .await
                        .unwrap_or_else(|e| {
                            debug!(%worker, error = %ErrorChain(&e), "KV event replay failed");
                            Vec::new()
                        }),
                    None => Vec::new(),
                };
                if replayed.len() as u64 == to - from {
                    metrics.replayed(worker, replayed.len() as u64);
                    for p in replayed {
                        forward(tx, metrics, target, topic.clone(), p, received);
                    }
                } else {
                    warn!(%worker, missed = to - from, "KV event gap: resetting worker");
                    tx.push_control(worker, Item::Reset(ResetReason::Gap));
                }
            }
        }
        forward(tx, metrics, target, topic, payload, received);
        if tx.is_closed() {
            return Ok(());
        }
    }
    tx.push_control(worker, Item::Live(false));
    Ok(())
}

/// Queues one batch without waiting, counting what a full queue dropped.
fn forward(
    tx: &IngestQueue,
    metrics: &KvEventMetrics,
    target: &Target,
    topic: Bytes,
    payload: Bytes,
    received: Instant,
) {
    let batch = Item::Batch {
        engine: target.engine,
        topic,
        payload,
        received,
    };
    for d in tx.push_batch(target.worker, batch) {
        metrics.dropped(d.worker, d.batches);
    }
}

/// vLLM's end-of-replay marker: sequence number -1.
const END_SEQ: u64 = u64::MAX;

/// Asks the engine's replay socket for batches `from..to`; returns their payloads
/// in order if every one of them came back, fewer otherwise.
async fn replay(
    host: IpAddr,
    port: u16,
    from: u64,
    to: u64,
    config: &SubscriberConfig,
) -> Result<Vec<Bytes>, ZmtpError> {
    let timeout = config.connect_timeout;
    let mut dealer = Connection::connect(
        std::net::SocketAddr::new(host, port),
        "DEALER",
        config.limits(),
        timeout,
    )
    .await?;
    dealer.send(&[&[], &from.to_be_bytes()[..]]).await?;
    let mut out = Vec::new();
    let mut expect = from;
    let collect = async {
        loop {
            let frames = dealer.recv().await?;
            // ("", seq, payload); tolerate a missing empty delimiter.
            let (seq, payload) = match frames.as_slice() {
                [empty, seq, payload] if empty.is_empty() => (seq, payload),
                [seq, payload] => (seq, payload),
                _ => continue,
            };
            let Ok(seq) = decode_seq(seq) else { continue };
            if seq == END_SEQ {
                return Ok::<(), ZmtpError>(());
            }
            if seq == expect && seq < to {
                out.push(payload.clone());
                expect += 1;
            }
        }
    };
    match tokio::time::timeout(timeout, collect).await {
        Ok(r) => r?,
        Err(_) => return Ok(Vec::new()),
    }
    Ok(out)
}
