//! What a pick returns: the decision, its targets, and why a pick can fail.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::endpoints::{ActiveLoad, Endpoint, EndpointState, InFlightGuard, WorkerKey};
use crate::latency::Features;
use crate::request::InferenceRequest;
use crate::sessions::SessionTurn;

/// Why no endpoint could be picked (answered with 503, but
/// [`PickError::SloUnreachable`] with 429).
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
    /// A sheddable request's TTFT objective is predicted to be missed on
    /// every worker whose model is warm (predicted scoring only).
    #[error("no worker is predicted to meet the request's TTFT objective")]
    SloUnreachable,
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
    /// Latency objectives the request carries (`x-slo-ttft-ms`, `x-slo-tpot-ms`).
    pub slo: Slo,
    /// Flow control may drop it (priority < 0): with a TTFT objective no warm
    /// worker is predicted to meet, the pick refuses it
    /// ([`PickError::SloUnreachable`]) rather than place it late.
    pub sheddable: bool,
}

/// A request's latency objectives; they count only where latency is predicted.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Slo {
    /// Time to first token, in seconds.
    pub ttft: Option<f64>,
    /// Time per output token, in seconds.
    pub tpot: Option<f64>,
}

/// One chosen (worker, rank).
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint's live state (load, health, scrape).
    pub state: Arc<EndpointState>,
    /// The data-parallel rank inside it.
    pub rank: u32,
}

impl Target {
    /// The endpoint as discovered (address, instance id, role, engine).
    pub fn endpoint(&self) -> &Endpoint {
        &self.state.endpoint
    }

    /// The (worker, rank) key.
    pub fn key(&self) -> WorkerKey {
        self.state.key(self.rank)
    }

    /// Blocks of load booked on this rank by unfinished requests.
    #[cfg(test)]
    pub(crate) fn booked_blocks(&self) -> u64 {
        self.state.active_load(self.rank).blocks
    }
}

/// The routing decision for one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Where the request goes (decode side in disaggregated pools).
    pub decode: Target,
    /// Next-best decode endpoints (distinct addresses, best first) for the
    /// gateway to retry on; empty unless more than one endpoint is asked for
    /// ([`SchedulerConfig::max_endpoints`](super::SchedulerConfig::max_endpoints)).
    /// Nothing is booked on them.
    pub fallbacks: Vec<Target>,
    /// The prefill worker in disaggregated pools.
    pub prefill: Option<Target>,
    /// The prefill worker's bootstrap port: its `kvpick.io/bootstrap-port`, else
    /// the SGLang default for `sglang` engine pods (`--sglang-bootstrap-port`).
    pub bootstrap_port: Option<u16>,
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
    /// Of `load_blocks`, those the decode target had left to prefill (not
    /// cached there when routed): its pending work until its prefill is done.
    pub uncached_blocks: u64,
    /// Expected output blocks (`agent_hints.osl` or the default) added to the
    /// decode rank's load on top of `load_blocks`.
    pub decode_blocks: u64,
    /// The decode target's figures at decision time, for the latency model to
    /// learn from: set for a streamed request picked in predicted mode.
    pub latency_features: Option<Features>,
    /// Set once the booked uncached blocks are released (at
    /// [`Scheduler::prefill_done`](super::Scheduler::prefill_done) or at the end).
    pub(super) prefilled: Prefilled,
    /// The prompt's block hashes when a target is precise (they are a guess
    /// there until its events confirm them; see `provisional.rs`).
    pub(super) guess: Option<Arc<[u64]>>,
}

/// Whether a decision's uncached blocks were released; a clone copies the state.
#[derive(Debug, Default)]
pub(super) struct Prefilled(AtomicBool);

impl Prefilled {
    /// Marks the prefill over; true the first time only.
    pub(super) fn mark(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }

    /// Whether the prefill was marked over.
    pub(super) fn is_marked(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl Clone for Prefilled {
    fn clone(&self) -> Self {
        Prefilled(AtomicBool::new(self.0.load(Ordering::Relaxed)))
    }
}

impl Decision {
    /// The load the request books on its decode rank until it finishes: its
    /// prompt and expected output, and the prompt blocks left to prefill there.
    pub fn decode_load(&self) -> ActiveLoad {
        ActiveLoad {
            blocks: self.load_blocks + self.decode_blocks,
            uncached: self.uncached_blocks,
        }
    }

    /// The load it books on its prefill rank: the whole prompt, all to prefill.
    pub fn prefill_load(&self) -> ActiveLoad {
        ActiveLoad {
            blocks: self.load_blocks,
            uncached: self.load_blocks,
        }
    }

    /// Starts counting the request as in flight on its decode rank.
    pub fn begin(&self) -> InFlightGuard {
        self.decode.state.begin_request(self.decode.rank)
    }
}
