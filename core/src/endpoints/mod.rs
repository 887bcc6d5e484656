//! The live table of workers: identity, role, engine, and per-rank load.
//!
//! Discovery (a static file or Kubernetes) publishes complete endpoint lists with
//! [`EndpointTable::replace`]; the scheduler reads lock-free [`Snapshot`]s. Load state
//! (kvpick's own in-flight counts and scraped engine metrics) lives in
//! [`EndpointState`] and survives a replace for endpoints whose identity did not change.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::{ArcSwap, ArcSwapOption};
use serde::Deserialize;
use tokio::sync::watch;

pub use crate::engine::Engine;
use crate::engine_latency::EngineLatency;
use crate::health::PassiveHealth;
use crate::keys::KeyHash;
pub use crate::keys::WorkerKey;
use pending::{PendingBlocks, PendingRanks};
use scrape_cell::{Scrape, ScrapeCell};

pub use lora::{adapter_id, LoraFit, LoraInfo, MAX_ADAPTERS};

#[cfg(test)]
mod idle_tests;
mod lora;
mod pending;
mod scrape_cell;

/// What a worker does in a (possibly disaggregated) pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill only (disaggregated serving).
    Prefill,
    /// Decode only (disaggregated serving).
    Decode,
    /// Aggregated: prefill and decode on the same worker.
    #[default]
    Both,
}

impl Role {
    /// Parses a `kvpick.io/role` value; unknown values are `None`.
    pub fn parse(s: &str) -> Option<Role> {
        match s.trim().to_ascii_lowercase().as_str() {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "both" | "" => Some(Role::Both),
            _ => None,
        }
    }

    /// Whether this worker can be the destination (decode side) of a request.
    pub fn serves_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// Most data-parallel ranks one endpoint may have (each gets its own counters).
pub const MAX_DP_SIZE: u32 = 1024;

/// A worker endpoint as discovery describes it: immutable identity and configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Where Envoy sends the request (`x-gateway-destination-endpoint`).
    pub address: SocketAddr,
    /// Decimal u64 sent as `x-worker-instance-id`.
    pub instance_id: u64,
    /// Number of data-parallel ranks (each its own KV cache); at least 1.
    pub dp_size: u32,
    /// Prefill, decode or both.
    pub role: Role,
    /// Engine type, for metric names.
    pub engine: Engine,
    /// `namespace/name` of the pod, or the address in standalone mode.
    pub name: String,
    /// Port of the engine's KV-event publisher, when known.
    pub kv_events_port: Option<u16>,
    /// Disaggregation bootstrap port (SGLang), when the worker has one.
    pub bootstrap_port: Option<u16>,
}

impl Endpoint {
    /// An aggregated vLLM endpoint with default settings; the instance id is the
    /// stable hash of the address.
    pub fn new(address: SocketAddr) -> Self {
        Endpoint {
            address,
            instance_id: crate::identity::instance_id_for(&address.to_string()),
            dp_size: 1,
            role: Role::Both,
            engine: Engine::Vllm,
            name: address.to_string(),
            kv_events_port: None,
            bootstrap_port: None,
        }
    }

    /// The `ip:port` string used in headers and metadata.
    pub fn address_string(&self) -> String {
        self.address.to_string()
    }
}

/// Load figures scraped from a worker's `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScrapedLoad {
    /// Requests waiting in the engine's queue.
    pub queue: f64,
    /// Requests running in the engine.
    pub running: f64,
    /// KV-cache usage in `[0, 1]`.
    pub kv_usage: f64,
    /// Engine KV block size in tokens, when exported.
    pub block_size: Option<u32>,
    /// Total KV blocks on the GPU, when exported.
    pub num_blocks: Option<u64>,
    /// When these figures were read.
    pub at: Instant,
}

/// Live state of one endpoint: its identity plus load counters.
///
/// What every pick reads of every candidate (rank 0's load, the instance id
/// and role, the scrape's figures, health) lives inline, in one allocation, in
/// the first three cache lines, ahead of the rest of the identity.
#[derive(Debug)]
#[repr(C)]
pub struct EndpointState {
    ranks: RankLoads,
    /// `endpoint.instance_id`, copied beside the load.
    instance_id: u64,
    /// `endpoint.role`, copied beside the load.
    role: Role,
    /// The latest scrape, read lock-free by every pick.
    scrape: ScrapeCell,
    health: PassiveHealth,
    /// The table's count of ranks with prefill pending, which this endpoint's
    /// ranks move as their pending blocks come and go.
    pending_ranks: Arc<PendingRanks>,
    /// The latest scrape's LoRA adapter state (`None`: not exported).
    lora: ArcSwapOption<LoraInfo>,
    /// The engine's recent latency from its own histograms (`None`: not
    /// scraped, or not exported).
    engine_latency: ArcSwapOption<EngineLatency>,
    /// Identity and configuration.
    pub endpoint: Endpoint,
}

/// Per-rank load: rank 0 inline, further data-parallel ranks behind a pointer.
#[derive(Debug)]
struct RankLoads {
    first: RankLoad,
    rest: Box<[RankLoad]>,
}

impl RankLoads {
    fn new(ranks: usize) -> Self {
        RankLoads {
            first: RankLoad::default(),
            rest: (1..ranks).map(|_| RankLoad::default()).collect(),
        }
    }

    fn get(&self, rank: u32) -> Option<&RankLoad> {
        match rank {
            0 => Some(&self.first),
            r => self.rest.get(r as usize - 1),
        }
    }

    fn len(&self) -> usize {
        1 + self.rest.len()
    }

    fn iter(&self) -> impl Iterator<Item = &RankLoad> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }
}

/// The load kvpick itself put on one rank, read lock-free by every pick.
#[derive(Debug, Default)]
struct RankLoad {
    /// Requests routed there (by this replica or, with replica sync, its
    /// peers) that have not finished.
    in_flight: AtomicU32,
    /// Blocks those requests booked (prompt and expected output).
    blocks: AtomicU64,
    /// Of them, the prompt blocks they had left to prefill when routed, until
    /// their prefill is done.
    uncached: PendingBlocks,
    /// The prefix index's slot for this rank as last seen: a hint the index
    /// checks (see `Overlaps::get_hinted`), so any value is safe.
    index_slot: AtomicU32,
}

/// A rank's active load in blocks: what its unfinished requests booked, and
/// what of their prompts they had left to prefill when routed there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActiveLoad {
    /// Booked blocks (prompt and expected output).
    pub blocks: u64,
    /// Prompt blocks left to prefill (of requests whose prefill is not done).
    pub uncached: u64,
}

/// The scraped figures the scheduler's cost reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadFigures {
    /// Requests waiting in the engine's queue.
    pub queue: f64,
    /// Requests the engine is running.
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
}

impl From<&ScrapedLoad> for LoadFigures {
    fn from(l: &ScrapedLoad) -> Self {
        LoadFigures {
            queue: l.queue,
            running: l.running,
            kv_usage: l.kv_usage,
        }
    }
}

/// What the scheduler knows of a worker's scraped load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadView {
    /// A recent successful scrape.
    Fresh(LoadFigures),
    /// The scrape is stale or failing: the worker may be hung or dead. The last
    /// figures, if any, are a floor, never a better estimate.
    Suspect(Option<LoadFigures>),
    /// Never scraped yet (just discovered, or scraping is off).
    Unknown,
}

impl EndpointState {
    /// The state of `endpoint`, its pending ranks counted in `pending_ranks`.
    fn new(endpoint: Endpoint, pending_ranks: Arc<PendingRanks>) -> Self {
        let ranks = endpoint.dp_size.clamp(1, MAX_DP_SIZE) as usize;
        EndpointState {
            ranks: RankLoads::new(ranks),
            instance_id: endpoint.instance_id,
            role: endpoint.role,
            scrape: ScrapeCell::default(),
            health: PassiveHealth::default(),
            pending_ranks,
            lora: ArcSwapOption::empty(),
            engine_latency: ArcSwapOption::empty(),
            endpoint,
        }
    }

    /// The count of pending ranks this endpoint's side moves.
    fn pending_count(&self) -> &AtomicI64 {
        self.pending_ranks.side(self.serves_decode())
    }

    /// The endpoint has left the table: its ranks no longer count as pending
    /// or idle there.
    fn detach(&self) {
        for r in self.ranks.iter() {
            r.uncached.detach(self.pending_count());
        }
    }

    /// The key of one of this endpoint's ranks.
    pub fn key(&self, dp_rank: u32) -> WorkerKey {
        WorkerKey {
            instance_id: self.instance_id,
            dp_rank,
        }
    }

    /// Whether the endpoint serves decode (read from the load's cache lines).
    pub fn serves_decode(&self) -> bool {
        self.role.serves_decode()
    }

    /// Number of ranks (dp size, at least 1).
    pub fn ranks(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Requests kvpick has routed to `rank` that have not finished.
    pub fn in_flight(&self, rank: u32) -> u32 {
        self.ranks
            .get(rank)
            .map_or(0, |r| r.in_flight.load(Ordering::Relaxed))
    }

    /// In-flight requests over all ranks.
    pub fn in_flight_total(&self) -> u32 {
        self.ranks
            .iter()
            .map(|r| r.in_flight.load(Ordering::Relaxed))
            .sum()
    }

    /// The load booked on `rank` by unfinished requests kvpick routed there.
    pub fn active_load(&self, rank: u32) -> ActiveLoad {
        self.ranks
            .get(rank)
            .map_or(ActiveLoad::default(), |r| ActiveLoad {
                blocks: r.blocks.load(Ordering::Relaxed),
                uncached: r.uncached.get(),
            })
    }

    /// Where the prefix index last had `rank` (a hint it checks; see
    /// [`Overlaps::get_hinted`](crate::kv::index::Overlaps::get_hinted)).
    pub fn index_slot(&self, rank: u32) -> Option<&AtomicU32> {
        self.ranks.get(rank).map(|r| &r.index_slot)
    }

    /// Books `load` on `rank` (a rank given blocks to prefill counts as
    /// pending: [`Snapshot::idle_ranks`]).
    pub fn book(&self, rank: u32, load: ActiveLoad) {
        if let Some(r) = self.ranks.get(rank) {
            r.blocks.fetch_add(load.blocks, Ordering::Relaxed);
            r.uncached.add(load.uncached, self.pending_count());
        }
    }

    /// Releases `load` booked on `rank` (each figure never below zero; a rank
    /// left with nothing to prefill counts as idle).
    pub fn release(&self, rank: u32, load: ActiveLoad) {
        if let Some(r) = self.ranks.get(rank) {
            let _ = r
                .blocks
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_sub(load.blocks))
                });
            r.uncached.sub(load.uncached, self.pending_count());
        }
    }

    /// Counts `n` requests another replica routed to `rank` (see [`crate::replica`]).
    pub fn add_peer_requests(&self, rank: u32, n: u32) {
        if let Some(r) = self.ranks.get(rank) {
            r.in_flight.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Stops counting `n` requests another replica routed to `rank` (never below zero).
    pub fn sub_peer_requests(&self, rank: u32, n: u32) {
        if let Some(r) = self.ranks.get(rank) {
            let _ = r
                .in_flight
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_sub(n))
                });
        }
    }

    /// Counts one more request on `rank` until the returned guard is dropped.
    pub fn begin_request(self: &Arc<Self>, rank: u32) -> InFlightGuard {
        if let Some(r) = self.ranks.get(rank) {
            r.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        InFlightGuard {
            state: Arc::clone(self),
            rank,
        }
    }

    /// Records freshly scraped load. Queue and running counts below zero (or
    /// NaN) are stored as zero: the pick's cost bounds rely on no figure being
    /// negative.
    pub fn set_scraped(&self, load: ScrapedLoad) {
        let load = ScrapedLoad {
            queue: load.queue.max(0.0),
            running: load.running.max(0.0),
            ..load
        };
        self.scrape.update(|_| Scrape {
            load: Some(load),
            failed_at: None,
        });
    }

    /// Records the LoRA adapter state a successful scrape read (`None`: the
    /// page has no adapter gauge).
    pub fn set_lora(&self, info: Option<LoraInfo>) {
        self.lora.store(info.map(Arc::new));
    }

    /// Records the engine's recent latency a successful scrape read.
    pub fn set_engine_latency(&self, latency: EngineLatency) {
        self.engine_latency.store(Some(Arc::new(latency)));
    }

    /// The engine's recent latency from its own histograms, when scraped.
    pub fn engine_latency(&self) -> Option<EngineLatency> {
        self.engine_latency.load().as_deref().copied()
    }

    /// How this worker fits a request for adapter `id` ([`adapter_id`]).
    #[inline]
    pub fn lora_fit(&self, id: u64) -> LoraFit {
        self.lora
            .load()
            .as_deref()
            .map_or(LoraFit::Neutral, |l| l.fit(id))
    }

    /// The latest LoRA adapter state, if the worker exports one.
    pub fn lora(&self) -> Option<Arc<LoraInfo>> {
        self.lora.load_full()
    }

    /// Records a failed scrape at `at`: the load turns suspect at once.
    pub fn set_scrape_failed(&self, at: Instant) {
        self.scrape.update(|s| Scrape {
            failed_at: Some(at),
            ..s
        });
    }

    /// The scraped load as the scheduler should see it at `now`.
    pub fn load_view(&self, now: Instant, max_age: std::time::Duration) -> LoadView {
        self.load_view_at(crate::time::Epoch::process().encode(now), max_age)
    }

    /// [`EndpointState::load_view`] at an instant coded by
    /// [`Epoch::process`](crate::time::Epoch::process): integer compares only.
    #[inline]
    pub fn load_view_at(&self, now: i64, max_age: std::time::Duration) -> LoadView {
        let (figures, at, failing) = self.scrape.read_figures();
        match figures {
            Some(l) if !failing && fresh(now, at, max_age) => LoadView::Fresh(l),
            None if !failing => LoadView::Unknown,
            last => LoadView::Suspect(last),
        }
    }

    /// The passive health record fed by the response path.
    pub fn health(&self) -> &PassiveHealth {
        &self.health
    }

    /// Scraped load if it is younger than `max_age` at `now`.
    pub fn scraped(&self, now: Instant, max_age: std::time::Duration) -> Option<ScrapedLoad> {
        let (scrape, at) = self.scrape.read();
        let now = crate::time::Epoch::process().encode(now);
        scrape.load.filter(|_| fresh(now, at, max_age))
    }
}

/// Whether a scrape taken at `at` is no older than `max_age` at `now` (both
/// coded by [`Epoch::process`](crate::time::Epoch::process)).
fn fresh(now: i64, at: i64, max_age: std::time::Duration) -> bool {
    now <= crate::time::Epoch::after(at, max_age)
}

/// Keeps one in-flight request counted on an endpoint rank; decrements on drop, so a
/// stream that ends early or panics still releases its slot.
#[derive(Debug)]
pub struct InFlightGuard {
    state: Arc<EndpointState>,
    rank: u32,
}

impl InFlightGuard {
    /// The endpoint this request was routed to.
    pub fn endpoint(&self) -> &Arc<EndpointState> {
        &self.state
    }

    /// The rank this request was routed to.
    pub fn rank(&self) -> u32 {
        self.rank
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Some(c) = self.state.ranks.get(self.rank).map(|r| &r.in_flight) {
            // Saturating: never wrap below zero.
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
        }
    }
}

/// An immutable view of the endpoint set at one moment.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// All ready endpoints, in a stable order (by address, each address once).
    pub endpoints: Vec<Arc<EndpointState>>,
    /// Instance id → position of the first endpoint with it, built once per
    /// set, so a worker key names its endpoint without a pass over the pool.
    instances: HashMap<u64, u32, KeyHash>,
    /// No two endpoints share an instance id.
    unique_instances: bool,
    /// Ranks of the prefill-only endpoints and of those serving decode.
    ranks: [u64; 2],
    /// The table's ranks with prefill pending.
    pending_ranks: Arc<PendingRanks>,
}

impl Snapshot {
    /// The view of `endpoints`, sorted by address with each address once,
    /// whose pending ranks `pending_ranks` counts.
    fn new(endpoints: Vec<Arc<EndpointState>>, pending_ranks: Arc<PendingRanks>) -> Self {
        let mut instances = HashMap::with_capacity_and_hasher(endpoints.len(), KeyHash::default());
        let mut unique_instances = true;
        let mut ranks = [0; 2];
        for (i, e) in endpoints.iter().enumerate() {
            match instances.entry(e.instance_id) {
                Entry::Vacant(v) => {
                    v.insert(i as u32);
                }
                Entry::Occupied(_) => unique_instances = false,
            }
            ranks[usize::from(e.serves_decode())] += u64::from(e.ranks());
        }
        Snapshot {
            endpoints,
            instances,
            unique_instances,
            ranks,
            pending_ranks,
        }
    }

    /// How many ranks of the endpoints that serve decode (`serves_decode`),
    /// or of the prefill-only ones, have no prefill pending: kvpick has booked
    /// them no prompt block still to prefill. O(1): counted as load is booked
    /// and released, not read from the ranks. Health and subset hints play no
    /// part. Exact while this is the table's current set and no booking is
    /// under way; an older set reads the current set's pending ranks.
    pub fn idle_ranks(&self, serves_decode: bool) -> u64 {
        let ranks = self.ranks[usize::from(serves_decode)];
        ranks.saturating_sub(self.pending_ranks.get(serves_decode))
    }

    /// Finds a ready endpoint by instance id (the first, if several share it).
    pub fn by_instance(&self, instance_id: u64) -> Option<&Arc<EndpointState>> {
        let i = *self.instances.get(&instance_id)?;
        self.endpoints.get(i as usize)
    }

    /// Whether no two endpoints share an instance id (then
    /// [`Snapshot::by_instance`] finds the only one).
    pub fn unique_instances(&self) -> bool {
        self.unique_instances
    }

    /// Whether some endpoint serves prefill only: without one, no request
    /// has a prefill worker to pick.
    pub fn has_prefill_only(&self) -> bool {
        self.ranks[0] > 0
    }

    /// Finds a ready endpoint by address.
    pub fn by_address(&self, address: &SocketAddr) -> Option<&Arc<EndpointState>> {
        self.endpoints
            .binary_search_by(|e| e.endpoint.address.cmp(address))
            .ok()
            .map(|i| &self.endpoints[i])
    }
}

/// The live endpoint table shared by discovery (writer) and scheduling (readers).
#[derive(Debug)]
pub struct EndpointTable {
    current: ArcSwap<Snapshot>,
    synced: watch::Sender<bool>,
    /// Ranks of the current set with prefill pending.
    pending_ranks: Arc<PendingRanks>,
}

impl Default for EndpointTable {
    fn default() -> Self {
        let pending_ranks = Arc::new(PendingRanks::default());
        EndpointTable {
            current: ArcSwap::from_pointee(Snapshot::new(Vec::new(), Arc::clone(&pending_ranks))),
            synced: watch::channel(false).0,
            pending_ranks,
        }
    }
}

impl EndpointTable {
    /// An empty table that has not synced yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current endpoint set.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Replaces the endpoint set with `endpoints` and marks the table synced.
    /// Endpoints whose identity is unchanged keep their load state; the
    /// others' states leave the table's pending count
    /// ([`Snapshot::idle_ranks`]). Returns the endpoints that left the set.
    pub fn replace(&self, mut endpoints: Vec<Endpoint>) -> Vec<Endpoint> {
        endpoints.sort_by_key(|e| e.address);
        endpoints.dedup_by(|a, b| a.address == b.address);
        let old = self.current.load_full();
        let mut previous: HashMap<SocketAddr, &Arc<EndpointState>> = old
            .endpoints
            .iter()
            .map(|s| (s.endpoint.address, s))
            .collect();
        let mut replaced = Vec::new();
        let next: Vec<Arc<EndpointState>> = endpoints
            .into_iter()
            .map(|ep| match previous.remove(&ep.address) {
                Some(state) if state.endpoint == ep => Arc::clone(state),
                other => {
                    replaced.extend(other);
                    Arc::new(EndpointState::new(ep, Arc::clone(&self.pending_ranks)))
                }
            })
            .collect();
        let removed = old
            .endpoints
            .iter()
            .filter(|s| {
                !next
                    .iter()
                    .any(|n| n.endpoint.instance_id == s.endpoint.instance_id)
            })
            .map(|s| s.endpoint.clone())
            .collect();
        self.current.store(Arc::new(Snapshot::new(
            next,
            Arc::clone(&self.pending_ranks),
        )));
        for state in replaced.into_iter().chain(previous.into_values()) {
            state.detach();
        }
        self.synced.send_replace(true);
        removed
    }

    /// Whether discovery has published at least one complete set.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// A receiver that sees `true` once the first complete set is published.
    pub fn subscribe_synced(&self) -> watch::Receiver<bool> {
        self.synced.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(addr: &str) -> Endpoint {
        Endpoint::new(addr.parse().unwrap())
    }

    #[test]
    fn replace_keeps_state_of_unchanged_endpoints() {
        let table = EndpointTable::new();
        assert!(!table.is_synced());
        table.replace(vec![ep("10.0.0.1:8000"), ep("10.0.0.2:8000")]);
        assert!(table.is_synced());
        let first = table.snapshot();
        let guard = first.endpoints[0].begin_request(0);
        let removed = table.replace(vec![ep("10.0.0.1:8000"), ep("10.0.0.3:8000")]);
        assert_eq!(removed.len(), 1);
        assert_eq!(removed[0].address.to_string(), "10.0.0.2:8000");
        let second = table.snapshot();
        assert_eq!(second.endpoints[0].in_flight(0), 1);
        drop(guard);
        assert_eq!(second.endpoints[0].in_flight(0), 0);
    }

    #[test]
    fn a_snapshot_finds_endpoints_by_instance_and_address_and_knows_shared_ids() {
        let table = EndpointTable::new();
        table.replace(vec![ep("10.0.0.2:8000"), ep("10.0.0.1:8000")]);
        let snap = table.snapshot();
        assert!(snap.unique_instances());
        for e in &snap.endpoints {
            let by_id = snap.by_instance(e.endpoint.instance_id).unwrap();
            assert!(Arc::ptr_eq(by_id, e));
            assert!(Arc::ptr_eq(
                snap.by_address(&e.endpoint.address).unwrap(),
                e
            ));
        }
        assert!(snap.by_instance(7).is_none());
        assert!(snap.by_address(&"10.0.0.3:8000".parse().unwrap()).is_none());
        let mut twin = ep("10.0.0.3:8000");
        twin.instance_id = snap.endpoints[0].endpoint.instance_id;
        table.replace(vec![ep("10.0.0.1:8000"), twin]);
        let snap = table.snapshot();
        assert!(!snap.unique_instances());
        let first = snap.by_instance(snap.endpoints[0].endpoint.instance_id);
        assert!(Arc::ptr_eq(first.unwrap(), &snap.endpoints[0]));
    }

    #[test]
    fn a_snapshot_knows_whether_some_endpoint_serves_prefill_only() {
        let table = EndpointTable::new();
        let mut decode = ep("10.0.0.2:8000");
        decode.role = Role::Decode;
        table.replace(vec![ep("10.0.0.1:8000"), decode]);
        assert!(!table.snapshot().has_prefill_only());
        let mut prefill = ep("10.0.0.3:8000");
        prefill.role = Role::Prefill;
        table.replace(vec![ep("10.0.0.1:8000"), prefill]);
        assert!(table.snapshot().has_prefill_only());
        assert!(!Snapshot::default().has_prefill_only());
    }

    #[test]
    fn scraped_counts_below_zero_are_stored_as_zero() {
        let state = EndpointState::new(ep("10.0.0.1:8000"), Default::default());
        let t0 = Instant::now();
        state.set_scraped(ScrapedLoad {
            queue: -3.0,
            running: f64::NAN,
            kv_usage: 0.5,
            block_size: None,
            num_blocks: None,
            at: t0,
        });
        let figures = LoadFigures {
            queue: 0.0,
            running: 0.0,
            kv_usage: 0.5,
        };
        let max_age = std::time::Duration::from_secs(5);
        assert_eq!(state.load_view(t0, max_age), LoadView::Fresh(figures));
    }

    #[test]
    fn in_flight_never_underflows_and_counts_per_rank() {
        let mut e = ep("10.0.0.1:8000");
        e.dp_size = 2;
        let state = Arc::new(EndpointState::new(e, Default::default()));
        let a = state.begin_request(1);
        let b = state.begin_request(1);
        assert_eq!((state.in_flight(0), state.in_flight(1)), (0, 2));
        assert_eq!(state.in_flight_total(), 2);
        drop(a);
        drop(b);
        assert_eq!(state.in_flight_total(), 0);
        // An out-of-range rank is ignored rather than panicking.
        drop(state.begin_request(7));
        assert_eq!(state.in_flight_total(), 0);
    }

    #[test]
    fn a_failing_or_stale_scrape_is_suspect_never_fresh() {
        let state = EndpointState::new(ep("10.0.0.1:8000"), Default::default());
        let t0 = Instant::now();
        let max_age = std::time::Duration::from_secs(5);
        assert_eq!(state.load_view(t0, max_age), LoadView::Unknown);
        let load = ScrapedLoad {
            queue: 1.0,
            running: 2.0,
            kv_usage: 0.5,
            block_size: None,
            num_blocks: None,
            at: t0,
        };
        state.set_scraped(load);
        let load = LoadFigures::from(&load);
        assert_eq!(state.load_view(t0, max_age), LoadView::Fresh(load));
        let later = t0 + std::time::Duration::from_secs(6);
        assert_eq!(
            state.load_view(later, max_age),
            LoadView::Suspect(Some(load))
        );
        state.set_scrape_failed(t0);
        assert_eq!(state.load_view(t0, max_age), LoadView::Suspect(Some(load)));
        state.set_scraped(ScrapedLoad {
            queue: 1.0,
            running: 2.0,
            kv_usage: 0.5,
            block_size: Some(16),
            num_blocks: Some(100),
            at: t0,
        });
        assert_eq!(state.load_view(t0, max_age), LoadView::Fresh(load));
        let never = EndpointState::new(ep("10.0.0.2:8000"), Default::default());
        never.set_scrape_failed(t0);
        assert_eq!(never.load_view(t0, max_age), LoadView::Suspect(None));
    }

    #[test]
    fn what_a_pick_reads_lies_in_the_first_144_bytes() {
        use std::mem::offset_of;
        // The pick reads the ranks, the copied identity, the scrape's first 48
        // bytes and health's first 12 (both `repr(C)`, hot fields first). Behind
        // the `Arc`'s 16-byte header, 144 bytes at any 16-byte alignment touch
        // three cache lines; the identity's 80 bytes would add up to two.
        let end = [
            offset_of!(EndpointState, instance_id) + 8,
            offset_of!(EndpointState, role) + 1,
            offset_of!(EndpointState, scrape) + 48,
            offset_of!(EndpointState, health) + 12,
        ]
        .into_iter()
        .max()
        .unwrap();
        assert!(end <= 144, "the pick's fields end at byte {end}");
        assert!(offset_of!(EndpointState, endpoint) >= end);
    }

    #[test]
    fn role_and_engine_parse() {
        assert_eq!(Role::parse("Prefill"), Some(Role::Prefill));
        assert_eq!(Role::parse(""), Some(Role::Both));
        assert_eq!(Role::parse("x"), None);
        assert_eq!(Engine::parse("sglang"), Some(Engine::Sglang));
        assert_eq!(Engine::parse("trt-llm"), Some(Engine::Trtllm));
    }
}
