//! The routing decision: candidates → filters → scores → pick.
//!
//! Pure core: no gRPC, Kubernetes or network types. A request's flow
//! ([`crate::flow`]) hands in a parsed request and an endpoint [`Snapshot`];
//! this module returns a [`Decision`] naming the decode (destination) worker
//! rank and, in disaggregated pools, the prefill worker rank.
//!
//! Stages of one pick (each timed in [`SchedulerStats`]):
//! 1. session: a live binding (or a valid signed token) pins the request to its
//!    decode (worker, rank), and its prefill (worker, rank) in disaggregated
//!    pools, while they are ready; a gone decode worker re-homes the session
//!    (re-picked, forwarded as an `open`; see [`crate::sessions`]);
//! 2. hash: the prompt becomes chained prefix block hashes ([`crate::kv::hash`]);
//! 3. lookup: the prefix index says which workers hold how many leading blocks;
//! 4. score: a cost per candidate, the sum of the cost terms ([`terms`]; see
//!    [`TermWeights`] and `docs/scheduling.md`), then the picker's choice
//!    ([`pickers`]): argmin with a random tie-break (while no state is shared
//!    with peer replicas, the near-best candidate all replicas agree on, see
//!    `agreement.rs`), or softmax sampling with a temperature. The argmin
//!    reads the prompt's holders first and skips every
//!    candidate whose least possible cost (the sum of the terms' lower bounds)
//!    is no lower than the best found (see `pick.rs`), so in a large pool it
//!    seldom reads every endpoint.
//!
//! Candidates are the endpoints every [`filters`] filter admits. Filters, terms
//! and picker are plugins ([`Plugins`]): each file declares its plugin (name,
//! llm-d Router plugin types, weight flag; [`plugin`]) and the [`registry`]
//! lists the declarations, so the flags, an `EndpointPickerConfig` and the
//! default list all build the list from them; `explain` is the same pick with
//! a recording observer.
//!
//! The chosen ranks then get the request's blocks in the index (approximate mode)
//! and its size added to their active load until [`Scheduler::finish`] (the
//! part left to prefill until [`Scheduler::prefill_done`]).

mod agreement;
mod candidates;
mod cost;
mod decision;
mod explain;
pub mod filters;
pub mod live;
mod overlap;
mod pick;
pub mod pickers;
pub mod plugin;
mod plugins;
mod provisional;
pub mod registry;
mod replica;
#[cfg(test)]
mod replica_tests;
mod stats;
pub mod terms;
#[cfg(test)]
mod tests;
pub mod tiers;
mod weights;

pub use agreement::{AGREEMENT_BLOCKS, AGREEMENT_MARGIN};
pub use decision::{Decision, PickError, PickRequest, Slo, Target};
pub use explain::{CandidateScore, Explanation};
pub use plugins::{default_picker, Plugins};
pub use stats::{
    CostSums, HistogramSnapshot, LatencyHistogram, SchedulerStats, Stage, StageTimer,
    LATENCY_BUCKETS,
};
pub use terms::{CostTerms, PendingWait, Side, PENDING_PREFILL_WEIGHT};
pub use weights::{TermWeight, TermWeights};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::endpoints::{ActiveLoad, Snapshot, WorkerKey};
use crate::health::{HealthConfig, Outcome};
use crate::kv::hash::{self, DEFAULT_BYTE_BLOCK, DEFAULT_TOKEN_BLOCK};
use crate::kv::index::{IndexConfig, PrefixIndex};
use crate::latency::{LatencyConfig, Learner};
use crate::replica::ReplicaSink;
use crate::request::InferenceRequest;
use crate::sessions::{SessionConfig, SessionStore};

/// SGLang's default disaggregation bootstrap port.
pub const DEFAULT_SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Text block size in bytes.
    pub byte_block: usize,
    /// Token block size for prompts given as token ids.
    pub token_block: usize,
    /// Most leading blocks of a prompt hashed, looked up and recorded (the rest
    /// counts as uncached): a long prompt's tail never decides a prefix match
    /// worth its cost, and an approximate index would evict the prompt's own
    /// prefix to keep it.
    pub max_prefix_blocks: usize,
    /// Weight of a block pending on a candidate beyond a prompt's overlap
    /// ([`PENDING_PREFILL_WEIGHT`] by default).
    pub pending_prefill_weight: f64,
    /// The filters, terms and picker to run (by default every declared term
    /// at its default weight, the max-score picker at temperature 0).
    pub plugins: Plugins,
    /// Seeds the tie-break among equally cheap candidates, so a replay repeats
    /// itself (`None`: the thread's random generator).
    pub tie_break_seed: Option<u64>,
    /// Scraped load older than this is ignored.
    pub scrape_max_age: Duration,
    /// Prefix index settings.
    pub index: IndexConfig,
    /// How long a prompt routed to a precise worker counts as held there
    /// (provisional entries) while its KV events have not said so; requests
    /// routed there by the guess do not renew it.
    pub provisional_ttl: Duration,
    /// How long after a request's response began (or it ended without one)
    /// its precise worker has to report the guessed blocks in its KV events;
    /// the rest of the guess is dropped then.
    pub provisional_confirm: Duration,
    /// Response header carrying the signed session token.
    pub session_token_header: String,
    /// HMAC key for session tokens (empty: a random per-process key).
    pub session_key: Vec<u8>,
    /// Sizes images that reach the scheduler untokenized, for load and prefill
    /// cost (`None`: every image counts `multimodal::DEFAULT_IMAGE_TOKENS`).
    pub vision: Option<crate::multimodal::VisionModel>,
    /// Most sessions held; past it the least recently used is evicted.
    pub session_max_entries: usize,
    /// Longest a session token stays valid after the turn that issued it.
    pub session_token_max_lifetime: Duration,
    /// Expected output tokens of a request without `nvext.agent_hints.osl`; the
    /// expected decode blocks are added to the request's booked load.
    pub default_osl_tokens: u32,
    /// Most load one request may book on a worker (prompt plus expected output
    /// blocks), so a client cannot pin a worker with one huge hint or body.
    pub max_request_load_blocks: u64,
    /// Bootstrap port of `sglang` prefill workers without a
    /// `kvpick.io/bootstrap-port` annotation (SGLang's default is 8998).
    pub sglang_bootstrap_port: Option<u16>,
    /// Passive health: when failing responses eject an endpoint.
    pub health: HealthConfig,
    /// Endpoints a decision names, best first: the decode target, then up to
    /// this many less one fallbacks (distinct addresses) for the gateway's
    /// retries. A picker's `maxNumOfEndpoints` overrides it.
    pub max_endpoints: usize,
    /// What a candidate's cost is in.
    pub scoring: ScoringMode,
    /// What loading a prompt block from a worker's lower storage tier costs,
    /// as a fraction of prefilling it.
    pub tier_costs: tiers::TierCosts,
}

/// What a candidate's cost is in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ScoringMode {
    /// KV blocks of work, from the weighted terms.
    #[default]
    Heuristic,
    /// Predicted seconds, from latency models learned online
    /// ([`terms::predicted`]); the heuristic while they are cold.
    Predicted,
}

impl SchedulerConfig {
    /// How much of a body's prompt is worth keeping: prefix matching hashes no more.
    pub fn prompt_limits(&self) -> crate::request::PromptLimits {
        crate::request::PromptLimits {
            tokens: self
                .max_prefix_blocks
                .saturating_mul(self.token_block.max(1)),
            text_bytes: self
                .max_prefix_blocks
                .saturating_mul(self.byte_block.max(1)),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            byte_block: DEFAULT_BYTE_BLOCK,
            token_block: DEFAULT_TOKEN_BLOCK,
            max_prefix_blocks: DEFAULT_MAX_PREFIX_TOKENS / DEFAULT_TOKEN_BLOCK,
            pending_prefill_weight: PENDING_PREFILL_WEIGHT,
            plugins: Plugins::default(),
            tie_break_seed: None,
            scrape_max_age: Duration::from_secs(5),
            index: IndexConfig::default(),
            provisional_ttl: DEFAULT_PROVISIONAL_TTL,
            provisional_confirm: DEFAULT_PROVISIONAL_CONFIRM,
            session_token_header: "x-kvpick-session".into(),
            session_key: Vec::new(),
            vision: None,
            session_max_entries: SessionConfig::default().max_entries,
            session_token_max_lifetime: SessionConfig::default().token_max_lifetime,
            default_osl_tokens: 0,
            max_request_load_blocks: DEFAULT_MAX_REQUEST_LOAD_BLOCKS,
            sglang_bootstrap_port: Some(DEFAULT_SGLANG_BOOTSTRAP_PORT),
            health: HealthConfig::default(),
            max_endpoints: 1,
            scoring: ScoringMode::Heuristic,
            tier_costs: tiers::TierCosts::default(),
        }
    }
}

/// Default cap on the prompt tokens prefix matching looks at: 131,072 (the llm-d
/// Router's `maxPrefixTokensToMatch` default, one context window of large models).
pub const DEFAULT_MAX_PREFIX_TOKENS: usize = 131_072;

/// Default [`SchedulerConfig::provisional_ttl`]: covers a burst sharing a
/// prefix while its first request waits for and runs its prefill, also in a
/// saturated fleet whose queues hold a request for tens of seconds. A guess
/// ends sooner at its blocks' KV events (stored or removed) and within
/// [`DEFAULT_PROVISIONAL_CONFIRM`] of its response's start, so the TTL only
/// bounds requests that neither start a response nor end. On the tuning trace
/// at 1,000 blocks 2× (TTFT p50 ~30 s) precise mode keeps 12.9% hits at 10 s
/// and 17.9% at 120 s (the same as at 1,000 s); BENCHMARKS.md §2.
pub const DEFAULT_PROVISIONAL_TTL: Duration = Duration::from_secs(120);

/// Default [`SchedulerConfig::provisional_confirm`]: an engine publishes a
/// block's `BlockStored` in the step that fills it, so by the time the first
/// response bytes are out its events are on the wire; two seconds leave room
/// for a busy event queue (whose latency stays under one second under a
/// flood, `docs/kvevents.md`).
pub const DEFAULT_PROVISIONAL_CONFIRM: Duration = Duration::from_secs(2);

/// Default [`SchedulerConfig::max_request_load_blocks`]: 16384 blocks, about
/// 256k tokens (16-token blocks) or 1 MiB of text (64-byte blocks).
pub const DEFAULT_MAX_REQUEST_LOAD_BLOCKS: u64 = 16_384;

/// Picks endpoints for requests.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    /// What the pick runs, swapped whole by [`Scheduler::set_plugins`].
    live: live::Live,
    index: Arc<PrefixIndex>,
    /// Prompts routed to precise workers, until their events or their bounds
    /// (see `provisional.rs`).
    provisional: provisional::Guesses,
    sessions: SessionStore,
    stats: SchedulerStats,
    /// Tie-breaks drawn so far (with [`SchedulerConfig::tie_break_seed`]).
    tie_breaks: AtomicU64,
    /// Where decisions' effects go for peer replicas (unset: a single replica).
    replica: OnceLock<Arc<dyn ReplicaSink>>,
    /// Whether routing state is shared with peers right now (see `agreement.rs`).
    shared_state: AtomicBool,
    /// The learned latency models (`--scoring predicted` only).
    latency: Option<Arc<Learner>>,
}

impl Default for Scheduler {
    fn default() -> Self {
        Self::new(SchedulerConfig::default())
    }
}

impl Scheduler {
    /// A scheduler with `config`.
    pub fn new(config: SchedulerConfig) -> Self {
        let mut plugins = config.plugins.clone();
        let latency = match config.scoring {
            ScoringMode::Heuristic => None,
            ScoringMode::Predicted => {
                let learner = Arc::new(Learner::new(LatencyConfig::default()));
                plugins = plugins.predicted(Arc::clone(&learner));
                Some(learner)
            }
        };
        Scheduler {
            latency,
            index: Arc::new(PrefixIndex::new(config.index)),
            provisional: provisional::Guesses::new(
                config.index,
                config.provisional_ttl,
                config.provisional_confirm,
            ),
            sessions: SessionStore::with_config(SessionConfig {
                key: config.session_key.clone(),
                max_entries: config.session_max_entries,
                token_max_lifetime: config.session_token_max_lifetime,
            }),
            stats: SchedulerStats::default(),
            tie_breaks: AtomicU64::new(0),
            live: live::Live::new(plugins),
            replica: OnceLock::new(),
            shared_state: AtomicBool::new(true),
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

    /// The learned latency models, in predicted mode: the request flow
    /// feeds them ([`crate::flow::FlowContext::observed_by`]).
    pub fn latency(&self) -> Option<&Arc<Learner>> {
        self.latency.as_ref()
    }

    /// The filters, terms and picker picks run now, with their decision
    /// cost sums.
    pub fn plugins(&self) -> Arc<live::LivePlugins> {
        self.live.load()
    }

    /// Makes `plugins` what later picks run (a reloaded
    /// `EndpointPickerConfig`); picks under way finish on the old list.
    /// In predicted mode the new list predicts with the same learner.
    pub fn set_plugins(&self, plugins: Plugins) {
        self.live.swap(match &self.latency {
            Some(learner) => plugins.predicted(Arc::clone(learner)),
            None => plugins,
        });
    }

    /// Endpoints a decision under `plugins` names: the decode target and its
    /// fallbacks (the picker's count, else the config's; at least 1).
    pub fn max_endpoints(&self, plugins: &Plugins) -> usize {
        plugins
            .picker
            .max_endpoints()
            .unwrap_or(self.config.max_endpoints)
            .max(1)
    }

    /// The chained prefix block hashes of a request body (at most
    /// [`SchedulerConfig::max_prefix_blocks`]).
    pub fn block_hashes(&self, body: &InferenceRequest) -> Vec<u64> {
        self.prompt_blocks(body).hashes
    }

    /// [`Self::block_hashes`] with the prefill cost of each block (images count
    /// their tokens).
    pub fn prompt_blocks(&self, body: &InferenceRequest) -> hash::PromptBlocks {
        hash::PromptBlocks::of(
            hash::request_seed(&body.model, body.salt.as_deref()),
            &body.segments,
            (self.config.byte_block, self.config.token_block),
            self.config.max_prefix_blocks,
            self.config.vision.as_ref(),
        )
        .and_unhashed(body.unhashed_blocks(self.config.byte_block, self.config.token_block))
    }

    /// Headers to add to a successful (2xx) response of a routed request: the
    /// signed session token, for session turns other than `close`.
    pub fn response_headers(&self, decision: &Decision) -> Option<Vec<(String, String)>> {
        let turn = decision.session.as_ref()?;
        let prefill = decision.prefill.as_ref().map(Target::key);
        let token = self
            .sessions
            .turn_token(turn, decision.decode.key(), prefill)?;
        Some(vec![(self.config.session_token_header.clone(), token)])
    }

    /// The response of a routed request began with HTTP `status` (seen on the
    /// response path): feeds the decode endpoint's passive health. Returns true
    /// when this response ejected the endpoint.
    pub fn record_response(&self, decision: &Decision, status: u16, now: Instant) -> bool {
        decision
            .decode
            .state
            .health()
            .record(Outcome::of_status(status), now, &self.config.health)
    }

    /// The request has finished; `status` is the response's HTTP status when one arrived.
    pub fn finish(&self, decision: &Decision, status: Option<u16>) {
        self.finish_at(decision, status, Instant::now());
    }

    /// [`Scheduler::finish`] at a given instant (tests drive the clock).
    pub fn finish_at(&self, decision: &Decision, status: Option<u16>, now: Instant) {
        self.cancel_at(decision, now);
        if let Some(turn) = &decision.session {
            let prefill = decision.prefill.as_ref().map(Target::key);
            self.sessions
                .settle(turn, decision.decode.key(), prefill, status, now);
            self.share_settle(turn, decision.decode.key(), prefill, status);
        }
    }

    /// The request's prefill is over (its first token is out): the blocks it
    /// booked to prefill ([`ActiveLoad::uncached`]) stop counting on its ranks,
    /// the rest stays booked until it finishes. Only the first call releases.
    pub fn prefill_done(&self, decision: &Decision) {
        self.prefill_done_at(decision, Instant::now());
    }

    /// [`Scheduler::prefill_done`] at a given instant (tests drive the clock).
    /// The response began: the decision's guesses start waiting for their
    /// workers' events.
    pub fn prefill_done_at(&self, decision: &Decision, now: Instant) {
        if decision.prefilled.mark() {
            self.release(decision, |l| ActiveLoad { blocks: 0, ..l }, false);
            self.await_confirmation(decision, now);
        }
    }

    /// The gateway served the request from the fallback at `served` (its
    /// address as the response's `x-gateway-destination-endpoint-served`
    /// reports it) rather than from the decode target: the decision's booking
    /// moves there, so the load counts where the request runs. The fallback
    /// rank books the decision's load with the whole prompt left to prefill
    /// (its own overlap was not read); the first pick's prompt entries stay
    /// where they were recorded (approximate ones age out as any other;
    /// guessed ones on a precise worker wait for its events now, and end
    /// without them). True when the booking moved; false when `served` is the
    /// decode target or no fallback of the decision (nothing changes).
    pub fn serve_on_fallback(&self, decision: &mut Decision, served: SocketAddr) -> bool {
        self.serve_on_fallback_at(decision, served, Instant::now())
    }

    /// [`Scheduler::serve_on_fallback`] at a given instant.
    pub fn serve_on_fallback_at(
        &self,
        decision: &mut Decision,
        served: SocketAddr,
        now: Instant,
    ) -> bool {
        if decision.decode.endpoint().address == served {
            return false;
        }
        let Some(i) = decision
            .fallbacks
            .iter()
            .position(|f| f.endpoint().address == served)
        else {
            return false;
        };
        let primary = decision.decode.clone();
        // What the primary still carries: the uncached part unless the
        // response (whose headers report the served endpoint) released it.
        let carried = match decision.prefilled.is_marked() {
            true => ActiveLoad {
                uncached: 0,
                ..decision.decode_load()
            },
            false => decision.decode_load(),
        };
        primary.state.release(primary.rank, carried);
        self.share_release(primary.key(), carried, 1);
        if let Some(hashes) = &decision.guess {
            if self.index.is_precise(primary.key()) {
                self.provisional
                    .await_confirmation(primary.key(), Arc::clone(hashes), now);
            }
        }
        // The primary takes the fallback's place in the list.
        std::mem::swap(&mut decision.decode, &mut decision.fallbacks[i]);
        decision.overlap_blocks = 0;
        decision.uncached_blocks = decision.load_blocks;
        let booked = match decision.prefilled.is_marked() {
            true => ActiveLoad {
                uncached: 0,
                ..decision.decode_load()
            },
            false => decision.decode_load(),
        };
        let d = &decision.decode;
        d.state.book(d.rank, booked);
        self.share_book(d.key(), booked, 1);
        true
    }

    /// Withdraws a decision that was replaced before its request went out: its
    /// booked load is released (the uncached part unless [`Self::prefill_done`]
    /// already did); its session turn is neither settled nor bound.
    pub fn cancel(&self, decision: &Decision) {
        self.cancel_at(decision, Instant::now());
    }

    /// [`Scheduler::cancel`] at a given instant; a decision whose response
    /// never began starts its guesses' wait for events now.
    pub fn cancel_at(&self, decision: &Decision, now: Instant) {
        let pending = decision.prefilled.mark();
        if pending {
            self.await_confirmation(decision, now);
        }
        self.release(
            decision,
            |l| ActiveLoad {
                uncached: if pending { l.uncached } else { 0 },
                ..l
            },
            true,
        );
    }

    /// Releases `part` of the load the decision booked on each of its ranks
    /// (`last`: the request is over, it leaves the decode rank's in-flight count).
    fn release(&self, decision: &Decision, part: impl Fn(ActiveLoad) -> ActiveLoad, last: bool) {
        let d = &decision.decode;
        let decode = part(decision.decode_load());
        d.state.release(d.rank, decode);
        self.share_release(d.key(), decode, u32::from(last));
        if let Some(p) = &decision.prefill {
            let prefill = part(decision.prefill_load());
            p.state.release(p.rank, prefill);
            self.share_release(p.key(), prefill, 0);
        }
    }

    /// Periodic upkeep: reaps expired sessions, purges expired index entries, and
    /// forgets the approximate and provisional index entries and idle load of ranks no longer in
    /// `snapshot` (precise workers are left to the KV-event subscriber).
    pub fn maintain(&self, snapshot: &Snapshot, now: Instant) -> usize {
        let reaped = self.sessions.reap(now);
        self.index.purge_expired(now);
        self.provisional.expire(now);
        self.provisional.index.purge_expired(now);
        let live: HashSet<WorkerKey> = snapshot
            .endpoints
            .iter()
            .flat_map(|e| (0..e.ranks()).map(|r| e.key(r)))
            .collect();
        for w in self.index.workers() {
            if !live.contains(&crate::kv::tier::device(w)) && !self.index.is_precise(w) {
                self.index.clear_worker(w);
            }
        }
        for w in self.provisional.index.workers() {
            if !live.contains(&w) {
                self.provisional.clear_worker(w);
            }
        }
        if let Some(l) = &self.latency {
            l.retain(|w| live.contains(w));
        }
        reaped
    }
}
