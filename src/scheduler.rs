//! The routing decision: candidates → filters → scores → pick.
//!
//! Pure core: no gRPC, Kubernetes or network types. The ext_proc glue hands in a
//! parsed request and an endpoint [`Snapshot`]; this module returns a [`Decision`]
//! naming the decode (destination) worker rank and, in disaggregated pools, the
//! prefill worker rank.
//!
//! Stages of one pick (each timed in [`SchedulerStats`]):
//! 1. session: a live binding (or a valid signed token) pins the request to its
//!    (worker, rank) while that rank is ready; a gone worker is re-picked;
//! 2. hash: the prompt becomes chained prefix block hashes ([`crate::kv::hash`]);
//! 3. lookup: the prefix index says how many leading blocks each candidate holds;
//! 4. score: a cost per candidate (see [`Weights`] and `docs/scheduling.md`), argmin
//!    with a random tie-break, or softmax sampling with a temperature.
//!
//! The chosen ranks then get the request's blocks in the index (approximate mode)
//! and its size added to their active load until [`Scheduler::finish`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use rand::Rng;

use crate::endpoints::{EndpointState, InFlightGuard, Role, Snapshot, WorkerKey};
use crate::kv::hash::{self, DEFAULT_BYTE_BLOCK, DEFAULT_TOKEN_BLOCK};
use crate::kv::index::{IndexConfig, KeyHash, PrefixIndex};
use crate::request::{InferenceRequest, SessionAction, DEFAULT_SESSION_TIMEOUT_SECS};
use crate::sessions::SessionStore;

/// Why no endpoint could be picked (answered with 503).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// The endpoint set is empty (or nothing is ready).
    #[error("no ready endpoint in the pool")]
    NoEndpoints,
    /// A subset hint matched none of the ready endpoints.
    #[error("no ready endpoint matches the subset hint")]
    SubsetEmpty,
    /// Endpoints exist, but none can serve as decode destination.
    #[error("no ready decode-capable endpoint in the pool")]
    NoDecodeEndpoint,
}

/// What the scheduler needs to know about one request.
#[derive(Debug, Default, Clone, Copy)]
pub struct PickRequest<'a> {
    /// The parsed body; `None` for header-only requests (e.g. `GET /v1/models`).
    pub body: Option<&'a InferenceRequest>,
    /// Addresses (`ip:port`) the gateway restricts the choice to, if any.
    pub subset: Option<&'a [String]>,
    /// Session id from the session header, for clients that cannot edit the body.
    pub session_id: Option<&'a str>,
    /// Signed session token from an earlier response.
    pub session_token: Option<&'a str>,
}

/// One chosen (worker, rank).
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint.
    pub endpoint: Arc<EndpointState>,
    /// The data-parallel rank inside it.
    pub rank: u32,
}

impl Target {
    /// The (worker, rank) key.
    pub fn key(&self) -> WorkerKey {
        self.endpoint.key(self.rank)
    }
}

/// The session turn a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTurn {
    /// The client's session id.
    pub id: String,
    /// `open`, `close`, or `None` for a middle turn (or a header session).
    pub action: Option<SessionAction>,
    /// Inactivity timeout.
    pub timeout: Duration,
}

/// The routing decision for one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Where the request goes (decode side in disaggregated pools).
    pub decode: Target,
    /// The prefill worker in disaggregated pools.
    pub prefill: Option<Target>,
    /// Random 63-bit bootstrap room when the prefill worker has a bootstrap port.
    pub bootstrap_room: Option<u64>,
    /// The session turn, when the request belongs to a session.
    pub session: Option<SessionTurn>,
    /// Full prefix blocks of the prompt.
    pub prompt_blocks: usize,
    /// Leading prompt blocks the decode target already held.
    pub overlap_blocks: usize,
    /// Blocks this request adds to its targets' active load until it finishes.
    pub load_blocks: u64,
}

impl Decision {
    /// Starts counting the request as in flight on its decode rank.
    pub fn begin(&self) -> InFlightGuard {
        self.decode.endpoint.begin_request(self.decode.rank)
    }
}

/// Weights of the cost terms (all in KV blocks of work; see `docs/scheduling.md`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Per block of the prompt the candidate must still prefill (after its overlap).
    pub prefill: f64,
    /// Per block of active load on the candidate (prompts of unfinished requests
    /// kvpick routed there, plus scraped running requests kvpick does not know).
    pub decode: f64,
    /// Per scraped queued request, counted at this request's size.
    pub queue: f64,
    /// Per unit of scraped KV-cache usage (0..1), counted at this request's size.
    pub kv_usage: f64,
    /// The prefill weight used when picking a prefill worker (disaggregated pools).
    pub prefill_overlap: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefill: 1.0,
            decode: 1.0,
            queue: 1.0,
            kv_usage: 1.0,
            prefill_overlap: 2.0,
        }
    }
}

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Text block size in bytes.
    pub byte_block: usize,
    /// Token block size for prompts given as token ids.
    pub token_block: usize,
    /// Cost weights.
    pub weights: Weights,
    /// 0 picks the cheapest candidate; above 0, softmax sampling over normalised costs.
    pub temperature: f64,
    /// Scraped load older than this is ignored.
    pub scrape_max_age: Duration,
    /// Prefix index settings.
    pub index: IndexConfig,
    /// Response header carrying the signed session token.
    pub session_token_header: String,
    /// HMAC key for session tokens (empty: a random per-process key).
    pub session_key: Vec<u8>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            byte_block: DEFAULT_BYTE_BLOCK,
            token_block: DEFAULT_TOKEN_BLOCK,
            weights: Weights::default(),
            temperature: 0.0,
            scrape_max_age: Duration::from_secs(5),
            index: IndexConfig::default(),
            session_token_header: "x-kvpick-session".into(),
            session_key: Vec::new(),
        }
    }
}

/// A timed stage of a pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Session binding and token check.
    Session,
    /// Prefix block hashing.
    Hash,
    /// Prefix index lookup.
    Lookup,
    /// Cost scoring and choice.
    Score,
}

impl Stage {
    /// All stages, in pick order.
    pub const ALL: [Stage; 4] = [Stage::Session, Stage::Hash, Stage::Lookup, Stage::Score];

    /// The `stage` label value.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Session => "session",
            Stage::Hash => "hash",
            Stage::Lookup => "lookup",
            Stage::Score => "score",
        }
    }
}

/// Upper bounds (seconds) of the stage latency histogram buckets.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
    0.002_5, 0.01, 0.05,
];

/// A lock-free latency histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Per-bucket counts; the last slot is +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// A histogram's state: sum in seconds, count, and cumulative bucket counts.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Sum of observations in seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
    /// (upper bound, count in this bucket alone) per bucket; the last bound is
    /// `f64::MAX` (+Inf), as the Prometheus text encoder expects.
    pub buckets: Vec<(f64, u64)>,
}

impl LatencyHistogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    /// The current state.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let buckets: Vec<(f64, u64)> = LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(&self.buckets)
            .map(|(b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        HistogramSnapshot {
            sum: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            count: buckets.iter().map(|(_, c)| c).sum(),
            buckets,
        }
    }
}

/// Plain counters the scheduler keeps; telemetry renders them.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Prompt prefix blocks looked up.
    pub blocks_queried: AtomicU64,
    /// Of those, blocks the chosen decode rank already held.
    pub blocks_matched: AtomicU64,
    /// Session requests whose bound worker was gone and were re-picked.
    pub session_repicks: AtomicU64,
    stages: [LatencyHistogram; 4],
}

impl SchedulerStats {
    /// The latency histogram of one stage.
    pub fn stage(&self, stage: Stage) -> &LatencyHistogram {
        &self.stages[stage as usize]
    }
}

/// One candidate (worker, rank).
struct Cand<'a> {
    ep: &'a Arc<EndpointState>,
    rank: u32,
    key: WorkerKey,
}

impl Cand<'_> {
    fn target(&self) -> Target {
        Target {
            endpoint: Arc::clone(self.ep),
            rank: self.rank,
        }
    }
}

fn ranks_of<'a>(eps: impl Iterator<Item = &'a Arc<EndpointState>>) -> Vec<Cand<'a>> {
    eps.flat_map(|ep| {
        (0..ep.ranks()).map(move |rank| Cand {
            ep,
            rank,
            key: ep.key(rank),
        })
    })
    .collect()
}

/// Picks endpoints for requests.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    index: Arc<PrefixIndex>,
    sessions: SessionStore,
    /// Active load per rank in blocks (prompts of unfinished requests).
    active: DashMap<WorkerKey, u64, KeyHash>,
    stats: SchedulerStats,
}

impl Default for Scheduler {
    fn default() -> Self {
        Self::new(SchedulerConfig::default())
    }
}

impl Scheduler {
    /// A scheduler with `config`.
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            index: Arc::new(PrefixIndex::new(config.index)),
            sessions: SessionStore::new(config.session_key.clone()),
            active: DashMap::default(),
            stats: SchedulerStats::default(),
            config,
        }
    }

    /// The pool's prefix index (KV events feed it in precise mode).
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// The session table.
    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    /// Counters and stage latencies.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Active load of a rank in blocks.
    pub fn active_blocks(&self, key: WorkerKey) -> u64 {
        self.active.get(&key).map_or(0, |v| *v)
    }

    /// The chained prefix block hashes of a request body.
    pub fn block_hashes(&self, body: &InferenceRequest) -> Vec<u64> {
        hash::request_block_hashes(
            hash::model_seed(&body.model, None),
            &body.segments,
            self.config.byte_block,
            self.config.token_block,
        )
    }

    /// Chooses the decode target (and a prefill target in disaggregated pools).
    pub fn pick(&self, req: &PickRequest<'_>, snapshot: &Snapshot) -> Result<Decision, PickError> {
        self.pick_at(req, snapshot, Instant::now())
    }

    /// [`Scheduler::pick`] at a given instant (tests drive the clock).
    pub fn pick_at(
        &self,
        req: &PickRequest<'_>,
        snapshot: &Snapshot,
        now: Instant,
    ) -> Result<Decision, PickError> {
        if snapshot.endpoints.is_empty() {
            return Err(PickError::NoEndpoints);
        }
        let eligible: Vec<&Arc<EndpointState>> = match req.subset {
            Some(subset) => {
                let c: Vec<_> = snapshot
                    .endpoints
                    .iter()
                    .filter(|e| subset.iter().any(|s| *s == e.endpoint.address_string()))
                    .collect();
                if c.is_empty() {
                    return Err(PickError::SubsetEmpty);
                }
                c
            }
            None => snapshot.endpoints.iter().collect(),
        };
        let decode = ranks_of(
            eligible
                .iter()
                .copied()
                .filter(|e| e.endpoint.role.serves_decode()),
        );
        if decode.is_empty() {
            return Err(PickError::NoDecodeEndpoint);
        }
        let prefill = match req.body {
            Some(_) => ranks_of(
                eligible
                    .iter()
                    .copied()
                    .filter(|e| e.endpoint.role == Role::Prefill),
            ),
            None => Vec::new(),
        };

        let t = Instant::now();
        let session = session_turn(req);
        let pinned = session
            .as_ref()
            .and_then(|s| self.pinned(s, req.session_token, &decode, now));
        self.stats.stage(Stage::Session).observe(t.elapsed());

        let t = Instant::now();
        let (hashes, load_blocks) = match req.body {
            Some(b) => (
                self.block_hashes(b),
                hash::request_size_blocks(
                    &b.segments,
                    self.config.byte_block,
                    self.config.token_block,
                ),
            ),
            None => (Vec::new(), 1),
        };
        self.stats.stage(Stage::Hash).observe(t.elapsed());

        let t = Instant::now();
        let decode_keys: Vec<WorkerKey> = match pinned {
            Some(i) => vec![decode[i].key],
            None => decode.iter().map(|c| c.key).collect(),
        };
        let overlaps = self.lookup(&hashes, &decode_keys, now);
        let prefill_keys: Vec<WorkerKey> = prefill.iter().map(|c| c.key).collect();
        let prefill_overlaps = self.lookup(&hashes, &prefill_keys, now);
        self.stats.stage(Stage::Lookup).observe(t.elapsed());

        let t = Instant::now();
        let w = self.config.weights;
        let (di, overlap) = match pinned {
            Some(i) => (i, overlaps[0]),
            None => {
                let i = self.choose(
                    &decode,
                    &overlaps,
                    hashes.len(),
                    load_blocks,
                    w.prefill,
                    now,
                );
                (i, overlaps[i])
            }
        };
        let pi = (!prefill.is_empty()).then(|| {
            self.choose(
                &prefill,
                &prefill_overlaps,
                hashes.len(),
                load_blocks,
                w.prefill_overlap,
                now,
            )
        });
        self.stats.stage(Stage::Score).observe(t.elapsed());

        self.stats
            .blocks_queried
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        self.stats
            .blocks_matched
            .fetch_add(overlap as u64, Ordering::Relaxed);
        self.record(&decode[di], &hashes, load_blocks, now);
        if let Some(pi) = pi {
            self.record(&prefill[pi], &hashes, load_blocks, now);
        }
        let prefill = pi.map(|i| prefill[i].target());
        let bootstrap_room = prefill
            .as_ref()
            .and_then(|p| p.endpoint.endpoint.bootstrap_port)
            .map(|_| rand::rng().random::<u64>() >> 1);
        Ok(Decision {
            decode: decode[di].target(),
            prefill,
            bootstrap_room,
            session,
            prompt_blocks: hashes.len(),
            overlap_blocks: overlap,
            load_blocks,
        })
    }

    /// The candidate a session is pinned to, if its binding (or a valid token)
    /// names a ready candidate. A binding whose worker is gone is dropped and counted.
    fn pinned(
        &self,
        s: &SessionTurn,
        token: Option<&str>,
        decode: &[Cand<'_>],
        now: Instant,
    ) -> Option<usize> {
        if let Some(bound) = self.sessions.get(&s.id, now) {
            let found = decode.iter().position(|c| c.key == bound);
            match found {
                Some(_) => {
                    self.sessions.touch(&s.id, s.timeout, now);
                }
                None => {
                    self.sessions.unbind(&s.id);
                    self.stats.session_repicks.fetch_add(1, Ordering::Relaxed);
                }
            }
            return found;
        }
        let claims = self.sessions.verify(token?, &s.id, SystemTime::now())?;
        let found = decode.iter().position(|c| c.key == claims.worker);
        match found {
            // Another replica (or our earlier life) bound it: adopt the binding.
            Some(_) => self.sessions.bind(&s.id, claims.worker, s.timeout, now),
            None => {
                self.stats.session_repicks.fetch_add(1, Ordering::Relaxed);
            }
        }
        found
    }

    fn lookup(&self, hashes: &[u64], keys: &[WorkerKey], now: Instant) -> Vec<usize> {
        if hashes.is_empty() {
            vec![0; keys.len()]
        } else {
            self.index.lookup(hashes, keys, now)
        }
    }

    /// The cost of sending a request of `size` blocks, `new_blocks` of which the
    /// candidate must still prefill, to candidate `c`.
    fn cost(
        &self,
        c: &Cand<'_>,
        new_blocks: usize,
        size: u64,
        w_prefill: f64,
        now: Instant,
    ) -> f64 {
        let w = &self.config.weights;
        let size = size as f64;
        let active = self.active_blocks(c.key) as f64;
        let mut decode = active;
        let mut queue = 0.0;
        let mut kv = 0.0;
        if let Some(s) = c.ep.scraped(now, self.config.scrape_max_age) {
            let ranks = f64::from(c.ep.ranks());
            let in_flight = f64::from(c.ep.in_flight(c.rank));
            let per_request = if in_flight > 0.0 {
                active / in_flight
            } else {
                size
            };
            // Running requests kvpick did not route (other replicas, direct traffic).
            decode += (s.running / ranks - in_flight).max(0.0) * per_request;
            queue = s.queue / ranks * size;
            kv = s.kv_usage.clamp(0.0, 1.0) * size;
        }
        w_prefill * new_blocks as f64 + w.decode * decode + w.queue * queue + w.kv_usage * kv
    }

    /// Index of the chosen candidate: argmin of the cost with a uniform random
    /// tie-break, or softmax sampling when a temperature is set.
    fn choose(
        &self,
        cands: &[Cand<'_>],
        overlaps: &[usize],
        prompt_blocks: usize,
        size: u64,
        w_prefill: f64,
        now: Instant,
    ) -> usize {
        let costs: Vec<f64> = cands
            .iter()
            .zip(overlaps)
            .map(|(c, o)| self.cost(c, prompt_blocks.saturating_sub(*o), size, w_prefill, now))
            .collect();
        pick_index(&costs, self.config.temperature, &mut rand::rng())
    }

    /// Approximate mode: the target now holds the prompt's blocks; it carries the
    /// request's load until it finishes.
    fn record(&self, c: &Cand<'_>, hashes: &[u64], size: u64, now: Instant) {
        if !hashes.is_empty() {
            if let Some(s) = c.ep.scraped(now, self.config.scrape_max_age) {
                if let Some(n) = s.num_blocks {
                    // Engine blocks of `block_size` tokens → kvpick blocks (~4 bytes a token).
                    let tokens = n.saturating_mul(u64::from(s.block_size.unwrap_or(16)));
                    let per_block = (self.config.byte_block / 4).max(1) as u64;
                    self.index
                        .set_capacity(c.key, (tokens / per_block) as usize);
                }
            }
            self.index.insert(c.key, hashes, now);
        }
        *self.active.entry(c.key).or_insert(0) += size;
    }

    /// Headers to add to a successful (2xx) response of a routed request: the
    /// signed session token, for session turns other than `close`.
    pub fn response_headers(&self, decision: &Decision) -> Option<Vec<(String, String)>> {
        let s = decision.session.as_ref()?;
        if s.action == Some(SessionAction::Close) {
            return None;
        }
        let token =
            self.sessions
                .token(&s.id, decision.decode.key(), SystemTime::now() + s.timeout);
        Some(vec![(self.config.session_token_header.clone(), token)])
    }

    /// The request has finished; `status` is the response's HTTP status when one arrived.
    pub fn finish(&self, decision: &Decision, status: Option<u16>) {
        self.finish_at(decision, status, Instant::now());
    }

    /// [`Scheduler::finish`] at a given instant (tests drive the clock).
    pub fn finish_at(&self, decision: &Decision, status: Option<u16>, now: Instant) {
        self.release(decision.decode.key(), decision.load_blocks);
        if let Some(p) = &decision.prefill {
            self.release(p.key(), decision.load_blocks);
        }
        let Some(s) = &decision.session else {
            return;
        };
        if s.action == Some(SessionAction::Close) {
            self.sessions.unbind(&s.id);
        } else if status.is_some_and(|c| (200..300).contains(&c)) {
            // Binds on success (the opening turn, or a turn of a session this
            // replica did not know) and slides the TTL.
            self.sessions
                .bind(&s.id, decision.decode.key(), s.timeout, now);
        }
    }

    fn release(&self, key: WorkerKey, size: u64) {
        if let Some(mut v) = self.active.get_mut(&key) {
            *v = v.saturating_sub(size);
        }
    }

    /// Periodic upkeep: reaps expired sessions, purges expired index entries, and
    /// forgets the approximate index entries and idle load of ranks no longer in
    /// `snapshot` (precise workers are left to the KV-event subscriber).
    pub fn maintain(&self, snapshot: &Snapshot, now: Instant) -> usize {
        let reaped = self.sessions.reap(now);
        self.index.purge_expired(now);
        let live: HashSet<WorkerKey> = snapshot
            .endpoints
            .iter()
            .flat_map(|e| (0..e.ranks()).map(|r| e.key(r)))
            .collect();
        for w in self.index.workers() {
            if !live.contains(&w) && !self.index.is_precise(w) {
                self.index.clear_worker(w);
            }
        }
        self.active.retain(|k, v| *v > 0 || live.contains(k));
        reaped
    }
}

/// The session turn of a request: the body's `nvext.session_control`, else the
/// session header (a middle turn with the default timeout).
fn session_turn(req: &PickRequest<'_>) -> Option<SessionTurn> {
    if let Some(sc) = req.body.and_then(|b| b.session()) {
        return Some(SessionTurn {
            id: sc.session_id.clone(),
            action: sc.action,
            timeout: Duration::from_secs(sc.timeout_secs().max(1)),
        });
    }
    req.session_id.map(|id| SessionTurn {
        id: id.to_string(),
        action: None,
        timeout: Duration::from_secs(DEFAULT_SESSION_TIMEOUT_SECS),
    })
}

/// Argmin of `costs` with a uniform random tie-break; with `temperature > 0`,
/// samples index i with probability ∝ exp(−c′ᵢ / temperature), where c′ are the
/// costs scaled to [0, 1].
fn pick_index(costs: &[f64], temperature: f64, rng: &mut impl Rng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if temperature > 0.0 && costs.len() > 1 {
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let span = if max > min { max - min } else { 1.0 };
        let weights: Vec<f64> = costs
            .iter()
            .map(|c| (-(c - min) / span / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        return costs.len() - 1;
    }
    let mut best = 0;
    let mut ties = 0u32;
    for (i, c) in costs.iter().enumerate() {
        if *c <= min + 1e-9 {
            ties += 1;
            // Reservoir sampling over the cheapest candidates.
            if rng.random_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Endpoint, EndpointTable, ScrapedLoad};
    use std::collections::{HashMap, HashSet};

    fn table(specs: &[(&str, u32, Role)]) -> EndpointTable {
        let t = EndpointTable::new();
        t.replace(
            specs
                .iter()
                .map(|(a, dp, role)| {
                    let mut e = Endpoint::new(a.parse().unwrap());
                    e.dp_size = *dp;
                    e.role = *role;
                    e
                })
                .collect(),
        );
        t
    }

    fn both(n: usize) -> EndpointTable {
        let addrs: Vec<String> = (1..=n).map(|i| format!("10.0.0.{i}:80")).collect();
        let specs: Vec<(&str, u32, Role)> =
            addrs.iter().map(|a| (a.as_str(), 1, Role::Both)).collect();
        table(&specs)
    }

    fn body(json: &str) -> InferenceRequest {
        crate::request::parse(json.as_bytes(), None).unwrap()
    }

    fn prompt(text: &str) -> InferenceRequest {
        body(&serde_json::json!({"model": "m", "prompt": text}).to_string())
    }

    fn session(id: &str, action: Option<&str>, text: &str) -> InferenceRequest {
        let mut sc = serde_json::json!({"session_id": id, "timeout": 60});
        if let Some(a) = action {
            sc["action"] = a.into();
        }
        body(
            &serde_json::json!({"model": "m", "prompt": text, "nvext": {"session_control": sc}})
                .to_string(),
        )
    }

    fn with_body(b: &InferenceRequest) -> PickRequest<'_> {
        PickRequest {
            body: Some(b),
            ..Default::default()
        }
    }

    #[test]
    fn empty_pool_and_empty_subset_are_errors() {
        let s = Scheduler::default();
        let t = EndpointTable::new();
        assert_eq!(
            s.pick(&PickRequest::default(), &t.snapshot()).unwrap_err(),
            PickError::NoEndpoints
        );
        let t = table(&[("10.0.0.1:80", 1, Role::Both)]);
        let subset = vec!["10.9.9.9:80".to_string()];
        let req = PickRequest {
            subset: Some(&subset),
            ..Default::default()
        };
        assert_eq!(
            s.pick(&req, &t.snapshot()).unwrap_err(),
            PickError::SubsetEmpty
        );
    }

    #[test]
    fn spreads_over_ranks_by_load() {
        let s = Scheduler::default();
        let t = table(&[
            ("10.0.0.1:80", 2, Role::Both),
            ("10.0.0.2:80", 1, Role::Both),
        ]);
        let snap = t.snapshot();
        let mut seen = HashSet::new();
        let mut held = Vec::new();
        for _ in 0..3 {
            let d = s.pick(&PickRequest::default(), &snap).unwrap();
            seen.insert(d.decode.key());
            held.push(d);
        }
        assert_eq!(seen.len(), 3, "three idle ranks each get one request");
        for d in &held {
            s.finish(d, Some(200));
            assert_eq!(s.active_blocks(d.decode.key()), 0);
        }
    }

    #[test]
    fn repeated_prompt_returns_to_its_worker() {
        let s = Scheduler::default();
        let t = both(8);
        let snap = t.snapshot();
        let long = prompt(&"the same long system prompt ".repeat(200));
        let first = s.pick(&with_body(&long), &snap).unwrap();
        assert_eq!(first.overlap_blocks, 0);
        assert!(first.prompt_blocks > 50);
        s.finish(&first, Some(200));
        for _ in 0..5 {
            let again = s.pick(&with_body(&long), &snap).unwrap();
            assert_eq!(again.decode.key(), first.decode.key());
            assert_eq!(again.overlap_blocks, again.prompt_blocks);
            s.finish(&again, Some(200));
        }
        let st = s.stats();
        assert_eq!(
            st.blocks_matched.load(Ordering::Relaxed) * 6,
            st.blocks_queried.load(Ordering::Relaxed) * 5
        );
    }

    #[test]
    fn load_outweighs_overlap_when_the_holder_is_busy() {
        let s = Scheduler::default();
        let t = both(2);
        let snap = t.snapshot();
        let long = prompt(&"x".repeat(64 * 100));
        let first = s.pick(&with_body(&long), &snap).unwrap();
        // While the first copy is in flight, the holder costs 100 blocks of load and
        // the other 100 blocks of prefill: a tie. Two more in flight tip it.
        let second = s.pick(&with_body(&long), &snap).unwrap();
        let third = s.pick(&with_body(&long), &snap).unwrap();
        let keys: HashSet<_> = [&first, &second, &third]
            .iter()
            .map(|d| d.decode.key())
            .collect();
        assert_eq!(keys.len(), 2, "the busy holder does not get everything");
    }

    #[test]
    fn distinct_prompts_spread_out() {
        let s = Scheduler::default();
        let t = both(4);
        let snap = t.snapshot();
        let mut count: HashMap<WorkerKey, usize> = HashMap::new();
        let mut held = Vec::new();
        for i in 0..40 {
            let p = prompt(&format!("{i} distinct prompt {}", "y".repeat(500)));
            let d = s.pick(&with_body(&p), &snap).unwrap();
            *count.entry(d.decode.key()).or_default() += 1;
            held.push(d);
        }
        assert_eq!(count.len(), 4);
        assert!(count.values().all(|c| *c == 10), "{count:?}");
    }

    #[test]
    fn scraped_load_counts_only_while_fresh() {
        let cfg = SchedulerConfig {
            scrape_max_age: Duration::from_secs(5),
            ..Default::default()
        };
        let s = Scheduler::new(cfg);
        let t = both(2);
        let snap = t.snapshot();
        let now = Instant::now();
        let busy = &snap.endpoints[0];
        busy.set_scraped(ScrapedLoad {
            queue: 20.0,
            running: 30.0,
            kv_usage: 0.9,
            block_size: None,
            num_blocks: None,
            at: now,
        });
        for _ in 0..10 {
            let d = s.pick_at(&PickRequest::default(), &snap, now).unwrap();
            assert_eq!(d.decode.key(), snap.endpoints[1].key(0));
            s.finish_at(&d, Some(200), now);
        }
        // Once stale, the scrape is ignored: both idle ranks are picked again.
        let later = now + Duration::from_secs(6);
        let picked: HashSet<_> = (0..40)
            .map(|_| {
                let d = s.pick_at(&PickRequest::default(), &snap, later).unwrap();
                s.finish_at(&d, Some(200), later);
                d.decode.key()
            })
            .collect();
        assert_eq!(picked.len(), 2);
    }

    #[test]
    fn session_binds_on_success_slides_and_closes() {
        let s = Scheduler::default();
        let t = both(4);
        let snap = t.snapshot();
        let t0 = Instant::now();
        let open = session("s1", Some("open"), "hello");
        let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
        let home = d.decode.key();
        assert!(s.sessions().is_empty(), "not bound before the response");
        s.finish_at(&d, Some(200), t0);
        assert_eq!(s.sessions().get("s1", t0), Some(home));
        // Middle turns stay, even against a different (unrelated, cached) prompt.
        let mut at = t0;
        for i in 0..5 {
            at += Duration::from_secs(50); // under the 60 s timeout, past it in total
            let turn = session("s1", None, &format!("turn {i}"));
            let d = s.pick_at(&with_body(&turn), &snap, at).unwrap();
            assert_eq!(d.decode.key(), home);
            s.finish_at(&d, Some(200), at);
        }
        let close = session("s1", Some("close"), "bye");
        let d = s.pick_at(&with_body(&close), &snap, at).unwrap();
        assert_eq!(d.decode.key(), home);
        assert!(s.response_headers(&d).is_none(), "no token on close");
        assert_eq!(
            s.sessions().get("s1", at),
            Some(home),
            "bound until finished"
        );
        s.finish_at(&d, Some(200), at);
        assert!(s.sessions().get("s1", at).is_none());
    }

    #[test]
    fn failed_open_does_not_bind_and_ttl_expires() {
        let s = Scheduler::default();
        let t = both(2);
        let snap = t.snapshot();
        let t0 = Instant::now();
        let open = session("s2", Some("open"), "x");
        let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
        s.finish_at(&d, Some(503), t0);
        assert!(s.sessions().is_empty());
        let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
        s.finish_at(&d, None, t0);
        assert!(
            s.sessions().is_empty(),
            "a stream that ended early does not bind"
        );
        let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
        s.finish_at(&d, Some(200), t0);
        assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(59)), 0);
        assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(61)), 1);
        assert!(s.sessions().is_empty());
    }

    #[test]
    fn gone_worker_is_repicked_and_counted() {
        let s = Scheduler::default();
        let t = both(3);
        let t0 = Instant::now();
        let open = session("s3", Some("open"), "x");
        let d = s.pick_at(&with_body(&open), &t.snapshot(), t0).unwrap();
        s.finish_at(&d, Some(200), t0);
        let gone = d.decode.endpoint.endpoint.address;
        let rest: Vec<Endpoint> = t
            .snapshot()
            .endpoints
            .iter()
            .filter(|e| e.endpoint.address != gone)
            .map(|e| e.endpoint.clone())
            .collect();
        t.replace(rest);
        let turn = session("s3", None, "y");
        let d2 = s.pick_at(&with_body(&turn), &t.snapshot(), t0).unwrap();
        assert_ne!(d2.decode.endpoint.endpoint.address, gone);
        assert_eq!(s.stats().session_repicks.load(Ordering::Relaxed), 1);
        s.finish_at(&d2, Some(200), t0);
        assert_eq!(s.sessions().get("s3", t0), Some(d2.decode.key()));
    }

    #[test]
    fn signed_token_moves_sessions_between_replicas() {
        let key = b"shared secret".to_vec();
        let cfg = || SchedulerConfig {
            session_key: key.clone(),
            ..Default::default()
        };
        let (a, b) = (Scheduler::new(cfg()), Scheduler::new(cfg()));
        let stranger = Scheduler::default(); // other key
        let t = both(8);
        let snap = t.snapshot();
        let open = session("s4", Some("open"), "x");
        let d = a.pick(&with_body(&open), &snap).unwrap();
        a.finish(&d, Some(200));
        let headers = a.response_headers(&d).unwrap();
        assert_eq!(headers[0].0, "x-kvpick-session");
        let token = headers[0].1.clone();
        let turn = session("s4", None, "y");
        let req = PickRequest {
            body: Some(&turn),
            session_token: Some(&token),
            ..Default::default()
        };
        for _ in 0..5 {
            let d2 = b.pick(&req, &snap).unwrap();
            assert_eq!(d2.decode.key(), d.decode.key());
            b.finish(&d2, Some(200));
        }
        // A replica with another key, or a token for another session, ignores it.
        let other = session("s5", None, "y");
        let picks: HashSet<_> = (0..30)
            .map(|_| {
                let d3 = stranger.pick(&req, &snap).unwrap();
                stranger.finish(&d3, None);
                let mismatched = PickRequest {
                    body: Some(&other),
                    session_token: Some(&token),
                    ..Default::default()
                };
                let d4 = b.pick(&mismatched, &snap).unwrap();
                b.finish(&d4, None);
                (d3.decode.key(), d4.decode.key())
            })
            .collect();
        assert!(picks.iter().map(|p| p.0).collect::<HashSet<_>>().len() > 1);
        assert!(picks.iter().map(|p| p.1).collect::<HashSet<_>>().len() > 1);
    }

    #[test]
    fn header_session_id_sticks() {
        let s = Scheduler::default();
        let t = both(8);
        let snap = t.snapshot();
        let req = PickRequest {
            session_id: Some("hdr"),
            ..Default::default()
        };
        let d = s.pick(&req, &snap).unwrap();
        s.finish(&d, Some(200));
        for _ in 0..5 {
            let d2 = s.pick(&req, &snap).unwrap();
            assert_eq!(d2.decode.key(), d.decode.key());
            s.finish(&d2, Some(200));
        }
    }

    #[test]
    fn dp_ranks_are_separate_caches() {
        let s = Scheduler::default();
        let t = table(&[("10.0.0.1:80", 4, Role::Both)]);
        let snap = t.snapshot();
        let long = prompt(&"z".repeat(64 * 20));
        let d = s.pick(&with_body(&long), &snap).unwrap();
        s.finish(&d, Some(200));
        let d2 = s.pick(&with_body(&long), &snap).unwrap();
        assert_eq!(d2.decode.rank, d.decode.rank);
        let others: Vec<WorkerKey> = (0..4)
            .filter(|r| *r != d.decode.rank)
            .map(|r| snap.endpoints[0].key(r))
            .collect();
        let hashes = s.block_hashes(&long);
        assert!(s
            .index()
            .lookup(&hashes, &others, Instant::now())
            .iter()
            .all(|c| *c == 0));
    }

    #[test]
    fn disaggregated_pool_picks_prefill_by_overlap() {
        let s = Scheduler::default();
        let mut eps = Vec::new();
        for i in 1..=3 {
            let mut e = Endpoint::new(format!("10.0.0.{i}:80").parse().unwrap());
            e.role = Role::Prefill;
            e.bootstrap_port = Some(8998);
            eps.push(e);
        }
        let mut d = Endpoint::new("10.0.1.1:80".parse().unwrap());
        d.role = Role::Decode;
        eps.push(d);
        let t = EndpointTable::new();
        t.replace(eps);
        let snap = t.snapshot();
        let long = prompt(&"p".repeat(64 * 50));
        let first = s.pick(&with_body(&long), &snap).unwrap();
        let pf = first.prefill.as_ref().unwrap().key();
        assert_eq!(first.decode.endpoint.endpoint.role, Role::Decode);
        assert!(first.bootstrap_room.is_some_and(|r| r < 1 << 63));
        s.finish(&first, Some(200));
        for _ in 0..3 {
            let d = s.pick(&with_body(&long), &snap).unwrap();
            assert_eq!(d.prefill.as_ref().unwrap().key(), pf);
            s.finish(&d, Some(200));
        }
        let only_prefill = table(&[("10.0.0.1:80", 1, Role::Prefill)]);
        assert_eq!(
            s.pick(&PickRequest::default(), &only_prefill.snapshot())
                .unwrap_err(),
            PickError::NoDecodeEndpoint
        );
    }

    #[test]
    fn precise_workers_get_no_approximate_entries() {
        let s = Scheduler::default();
        let t = both(1);
        let snap = t.snapshot();
        let key = snap.endpoints[0].key(0);
        s.index().set_precise(key, true);
        let long = prompt(&"q".repeat(64 * 10));
        let d = s.pick(&with_body(&long), &snap).unwrap();
        s.finish(&d, Some(200));
        assert!(s.index().is_empty());
    }

    #[test]
    fn maintain_forgets_gone_workers() {
        let s = Scheduler::default();
        let t = both(2);
        let long = prompt(&"r".repeat(64 * 10));
        let d = s.pick(&with_body(&long), &t.snapshot()).unwrap();
        s.finish(&d, Some(200));
        assert_eq!(s.index().len(), 10);
        s.maintain(&t.snapshot(), Instant::now());
        assert_eq!(s.index().len(), 10);
        t.replace(Vec::new());
        s.maintain(&t.snapshot(), Instant::now());
        assert!(s.index().is_empty());
    }

    #[test]
    fn tie_break_is_uniform_and_temperature_samples() {
        let mut rng = rand::rng();
        let mut hits = [0usize; 3];
        for _ in 0..3000 {
            hits[pick_index(&[1.0, 1.0, 5.0], 0.0, &mut rng)] += 1;
        }
        assert_eq!(hits[2], 0);
        assert!(hits[0] > 1200 && hits[1] > 1200, "{hits:?}");
        let mut hits = [0usize; 2];
        for _ in 0..3000 {
            hits[pick_index(&[0.0, 1.0], 1.0, &mut rng)] += 1;
        }
        // p(1) = e^-1 / (1 + e^-1) ≈ 0.27.
        assert!(hits[1] > 600 && hits[1] < 1050, "{hits:?}");
    }

    #[test]
    fn stage_latencies_are_recorded() {
        let s = Scheduler::default();
        let t = both(2);
        let d = s.pick(&with_body(&prompt("hello")), &t.snapshot()).unwrap();
        s.finish(&d, Some(200));
        for stage in Stage::ALL {
            let h = s.stats().stage(stage).snapshot();
            assert_eq!(h.count, 1, "{}", stage.name());
            assert_eq!(h.buckets.len(), LATENCY_BUCKETS.len() + 1);
            assert_eq!(h.buckets.iter().map(|b| b.1).sum::<u64>(), 1);
        }
    }
}
