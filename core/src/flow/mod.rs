//! One request's life, from its headers to its end, with no protocol type in
//! sight: admission, tokenization, the pick, the answer's outcome, the
//! response, and the end.
//!
//! A protocol layer (the ext_proc stream) turns its messages into the events
//! of a [`RequestFlow`], and builds its answers from the [`Step`]s it returns:
//!
//! 1. [`RequestFlow::request_headers`]: the request's [`RequestHead`] and the
//!    instant it began.
//! 2. [`RequestFlow::request_body`] with the complete body: prepared
//!    ([`Pipeline::prepare`]), tokenized when it waits for tokens
//!    ([`Step::Tokenizing`]), admitted ([`Step::Queued`] while flow control
//!    holds it), then picked and turned into its [`Outcome`]
//!    ([`Step::Routed`]), or refused ([`Step::Refused`]). A request without a
//!    body is routed on its headers ([`RequestFlow::route_on_headers`]); a
//!    body that follows such a decision replaces it.
//! 3. The response: [`RequestFlow::served_by`] (the gateway served it from a
//!    fallback), [`RequestFlow::response_headers`] (passive health, the
//!    session token), [`RequestFlow::response_chunk`] (the prefill is over;
//!    the tail the engine's token usage is read from).
//! 4. [`RequestFlow::finish`] once the response is complete, or
//!    [`RequestFlow::cancel`] (also on drop) when the stream goes first.
//!
//! Every event takes the instant it happened at, so a simulated clock drives
//! the scheduler and the observers ([`FlowObserver`]) alike.
//!
//! Invariants: for the requests it routes, the flow alone calls the
//! scheduler's lifecycle methods (`prefill_done`, `record_response`,
//! `serve_on_fallback`, `finish`, `cancel`); each decision ends exactly once
//! (finished, cancelled, or withdrawn when replaced or not forwarded); only
//! the first response headers count.

mod observer;
#[cfg(test)]
mod tests;

pub use observer::{FlowEnd, FlowId, FlowObserver};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::admission::{Gate, Permit, Rejection, RequestClass, Ticket, Verdict};
use crate::endpoints::{EndpointTable, InFlightGuard, Snapshot};
use crate::pipeline::{self, Outcome, Pipeline, Prepared, RequestHead, TokenizeJob, Tokenized};
use crate::request::usage::ResponseTail;
use crate::request::RequestError;
use crate::scheduler::{CostTerms, Decision, PickError, PickRequest, Scheduler};

/// What the flows of one server share.
pub struct FlowContext {
    /// The live endpoint set.
    pub endpoints: Arc<EndpointTable>,
    /// The routing core.
    pub scheduler: Arc<Scheduler>,
    /// Parses, identifies images and tokenizes bodies; edits the forwarded one.
    pub pipeline: Pipeline,
    /// Admission and flow control.
    pub admission: Gate,
    /// Told about every routed request (none unless added).
    observers: Vec<Arc<dyn FlowObserver>>,
    /// The next flow's id.
    next_id: AtomicU64,
}

impl FlowContext {
    /// Flows over these parts, observed by nobody.
    pub fn new(
        endpoints: Arc<EndpointTable>,
        scheduler: Arc<Scheduler>,
        pipeline: Pipeline,
        admission: Gate,
    ) -> Self {
        FlowContext {
            endpoints,
            scheduler,
            pipeline,
            admission,
            observers: Vec::new(),
            next_id: AtomicU64::new(0),
        }
    }

    /// Also tells `observer` about every request a flow routes.
    pub fn observed_by(mut self, observer: Arc<dyn FlowObserver>) -> Self {
        self.observers.push(observer);
        self
    }

    fn tell(&self, event: impl Fn(&dyn FlowObserver)) {
        self.observers.iter().for_each(|o| event(o.as_ref()));
    }
}

/// What the protocol does next with the request.
#[derive(Debug)]
pub enum Step {
    /// The body waits for its tokens: run [`RequestFlow::take_tokenize_job`]'s
    /// job and hand its result to [`RequestFlow::tokenized`].
    Tokenizing,
    /// Flow control holds the request: wait on [`RequestFlow::take_ticket`]'s
    /// ticket and hand its verdict to [`RequestFlow::admitted`].
    Queued,
    /// Forward the request as routed.
    Routed(Routing),
    /// kvpick answers the request itself.
    Refused(Refusal),
}

/// A routed request's answer.
#[derive(Debug)]
pub struct Routing {
    /// The headers and body to forward it with.
    pub outcome: Outcome,
    /// It replaced a decision made on the headers alone (the request already
    /// counted as routed).
    pub replaced: bool,
    /// How long the pick took (wall clock, whatever clock the events use).
    pub decided_in: Duration,
    /// The chosen decode rank's cost term by term, when the flow records them
    /// ([`RequestFlow::record_terms`]).
    pub terms: Option<Box<CostTerms>>,
}

/// Why a request was not routed.
#[derive(Debug)]
pub enum Refusal {
    /// The body is not a usable request, or its `nvext` cannot be rewritten (400).
    BadRequest(RequestError),
    /// No endpoint can take it (503).
    NoEndpoint(PickError),
    /// Flow control shed it (429).
    Shed(Rejection),
}

/// What the first response headers of a routed request bring.
#[derive(Debug)]
pub struct ResponseStart {
    /// Headers to add to the response: the signed session token, on a 2xx
    /// response of a session turn.
    pub headers: Option<Vec<(String, String)>>,
    /// This response ejected the decode endpoint (passive health).
    pub ejected: bool,
}

/// A routed request that finished.
#[derive(Debug)]
pub struct Finished {
    /// From its headers to the end of its response.
    pub took: Duration,
    /// Its response body's length and tail (the engine's token usage).
    pub tail: ResponseTail,
}

/// One request, from its headers to its end (see the module doc).
pub struct RequestFlow {
    ctx: Arc<FlowContext>,
    id: FlowId,
    /// What the request headers said (empty until they arrive).
    head: RequestHead,
    /// When the request headers arrived.
    started_at: Option<Instant>,
    /// Addresses the gateway restricts the pick to.
    subset: Option<Vec<String>>,
    /// Picks also return the chosen rank's cost terms.
    with_terms: bool,
    /// A complete body waiting for its tokens.
    tokenizing: Option<Box<Prepared>>,
    /// A body waiting in a flow-control queue.
    queued: Option<Box<Queued>>,
    /// The request's admission class, once its body is prepared.
    class: Option<RequestClass>,
    routed: Option<Routed>,
    /// The response's HTTP status, once its headers counted.
    status: Option<u16>,
    /// The first response headers counted.
    responded: bool,
    /// The first response body bytes were reported.
    first_chunk_seen: bool,
    /// The response body's length and tail.
    tail: ResponseTail,
}

/// A request held by flow control, routed once its ticket is answered.
struct Queued {
    prepared: Prepared,
    ticket: Option<Ticket>,
}

/// The decision a request was forwarded with, counted in flight on its rank.
struct Routed {
    decision: Decision,
    _in_flight: InFlightGuard,
}

impl RequestFlow {
    /// A request about to begin.
    pub fn new(ctx: Arc<FlowContext>) -> Self {
        let id = FlowId(ctx.next_id.fetch_add(1, Ordering::Relaxed));
        RequestFlow {
            ctx,
            id,
            head: RequestHead::default(),
            started_at: None,
            subset: None,
            with_terms: false,
            tokenizing: None,
            queued: None,
            class: None,
            routed: None,
            status: None,
            responded: false,
            first_chunk_seen: false,
            tail: ResponseTail::default(),
        }
    }

    /// The request's headers arrived at `now`.
    pub fn request_headers(&mut self, head: RequestHead, now: Instant) {
        self.head = head;
        self.started_at = Some(now);
    }

    /// What the request headers said.
    pub fn head(&self) -> &RequestHead {
        &self.head
    }

    /// When the request headers arrived.
    pub fn started_at(&self) -> Option<Instant> {
        self.started_at
    }

    /// The addresses the pick is restricted to, if any.
    pub fn subset(&self) -> Option<&[String]> {
        self.subset.as_deref()
    }

    /// Restricts the pick to `subset` (`ip:port` addresses).
    pub fn set_subset(&mut self, subset: Vec<String>) {
        self.subset = Some(subset);
    }

    /// Routed steps also carry the chosen rank's cost terms (a trace shows them).
    pub fn record_terms(&mut self) {
        self.with_terms = true;
    }

    /// The request's admission class, once its body was prepared.
    pub fn class(&self) -> Option<&RequestClass> {
        self.class.as_ref()
    }

    /// The decision the request was forwarded with, until it ends.
    pub fn decision(&self) -> Option<&Decision> {
        self.routed.as_ref().map(|r| &r.decision)
    }

    /// Whether the endpoint the gateway reports having served the request
    /// from matters ([`RequestFlow::served_by`]): routed with fallbacks, and
    /// no response yet.
    pub fn follows_served(&self) -> bool {
        !self.responded
            && self
                .routed
                .as_ref()
                .is_some_and(|r| !r.decision.fallbacks.is_empty())
    }

    /// Routes a request that has no body on its headers alone.
    pub fn route_on_headers(&mut self, now: Instant) -> Step {
        let snapshot = self.ctx.endpoints.snapshot();
        self.route(None, &snapshot, now)
    }

    /// The complete request body arrived at `now`: prepares, admits and
    /// routes it, or holds it for its tokens or in a flow-control queue.
    pub fn request_body(&mut self, body: Vec<u8>, now: Instant) -> Step {
        let prepared = match self.ctx.pipeline.prepare(body, &self.head) {
            Ok(p) => p,
            Err(e) => return Step::Refused(Refusal::BadRequest(e)),
        };
        if prepared.waits_for_tokens() {
            self.tokenizing = Some(Box::new(prepared));
            return Step::Tokenizing;
        }
        self.admit(prepared, now)
    }

    /// The tokenization the body waits for, once.
    pub fn take_tokenize_job(&mut self) -> Option<TokenizeJob> {
        self.tokenizing.as_mut()?.take_tokenize_job()
    }

    /// The body's tokens arrived at `now`: admits and routes it. `None` when
    /// no body was waiting for them.
    pub fn tokenized(&mut self, tokenized: Tokenized, now: Instant) -> Option<Step> {
        let mut prepared = self.tokenizing.take()?;
        prepared.tokenized(tokenized);
        Some(self.admit(*prepared, now))
    }

    /// The flow-control ticket the body waits on, once. Dropping it instead
    /// (the stream went away) takes the request out of its queue.
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.queued.as_mut()?.ticket.take()
    }

    /// Flow control answered at `now`: routes the queued body, or sheds it.
    /// `None` when no body was queued.
    pub fn admitted(&mut self, verdict: Result<Permit, Rejection>, now: Instant) -> Option<Step> {
        let queued = self.queued.take()?;
        Some(match verdict {
            Ok(permit) => {
                let snapshot = self.ctx.endpoints.snapshot();
                let step = self.route(Some(queued.prepared), &snapshot, now);
                drop(permit);
                step
            }
            Err(why) => Step::Refused(Refusal::Shed(why)),
        })
    }

    /// Classifies a prepared body and passes it through admission.
    fn admit(&mut self, prepared: Prepared, now: Instant) -> Step {
        let class = self.ctx.admission.classify(prepared.signals(&self.head));
        self.class = Some(class.clone());
        let snapshot = self.ctx.endpoints.snapshot();
        match self.ctx.admission.admit_at(class, &snapshot, now) {
            Verdict::Go(permit) => {
                let step = self.route(Some(prepared), &snapshot, now);
                drop(permit);
                step
            }
            Verdict::Wait(ticket) => {
                debug!("pool saturated: request queued by flow control");
                let ticket = Some(ticket);
                self.queued = Some(Box::new(Queued { prepared, ticket }));
                Step::Queued
            }
            Verdict::Reject(why) => Step::Refused(Refusal::Shed(why)),
        }
    }

    /// Picks the target of the request (with its `prepared` body, or on its
    /// headers alone) in `snapshot` and builds the answer's outcome.
    fn route(&mut self, prepared: Option<Prepared>, snapshot: &Snapshot, now: Instant) -> Step {
        let started = Instant::now();
        let req = PickRequest {
            body: prepared.as_ref().map(|p| &p.request),
            subset: self.subset.as_deref(),
            session_id: self.head.session_id.as_deref(),
            session_token: self.head.session_token.as_deref(),
            slo: self.head.slo(),
            sheddable: self.class.as_ref().is_some_and(RequestClass::is_sheddable),
        };
        let scheduler = &self.ctx.scheduler;
        let picked = match self.with_terms {
            false => scheduler.pick_at(&req, snapshot, now).map(|d| (d, None)),
            true => scheduler
                .pick_with_terms(&req, snapshot, now)
                .map(|(d, terms)| (d, Some(Box::new(terms)))),
        };
        let (decision, terms) = match picked {
            Ok(picked) => picked,
            Err(PickError::SloUnreachable) => {
                return Step::Refused(Refusal::Shed(Rejection::SloUnreachable))
            }
            Err(e) => return Step::Refused(Refusal::NoEndpoint(e)),
        };
        let decided_in = started.elapsed();
        // A body that follows a decision made on its headers alone replaces it.
        let replaced = self.routed.take();
        if let Some(old) = &replaced {
            scheduler.cancel_at(&old.decision, now);
        }
        let outcome = match pipeline::outcome(&decision, &self.head, prepared) {
            Ok(outcome) => outcome,
            Err(e) => {
                // Never forwarded: the decision is withdrawn.
                scheduler.cancel_at(&decision, now);
                return Step::Refused(Refusal::BadRequest(e));
            }
        };
        debug!(
            endpoint = %decision.decode.endpoint().address,
            worker = decision.decode.endpoint().instance_id,
            dp_rank = decision.decode.rank,
            prefill = ?decision.prefill.as_ref().map(|p| p.endpoint().instance_id),
            "routed"
        );
        let in_flight = decision.begin();
        self.ctx.tell(|o| o.routed(self.id, &decision, now));
        self.routed = Some(Routed {
            decision,
            _in_flight: in_flight,
        });
        Step::Routed(Routing {
            outcome,
            replaced: replaced.is_some(),
            decided_in,
            terms,
        })
    }

    /// The gateway reports (at the first response, `now`) it served the
    /// request from `served`: when that is one of the decision's fallbacks,
    /// the booking and the in-flight count move there, so load, health and
    /// the session follow where the request runs.
    pub fn served_by(&mut self, served: SocketAddr, now: Instant) {
        if !self.follows_served() {
            return;
        }
        let Some(r) = self.routed.as_mut() else {
            return;
        };
        if self
            .ctx
            .scheduler
            .serve_on_fallback_at(&mut r.decision, served, now)
        {
            // The primary's guard drops as the served rank's begins.
            r._in_flight = r.decision.begin();
        }
    }

    /// The response headers arrived at `now` with HTTP `status`; no body
    /// follows them unless `body_follows`. Only the first headers of a
    /// routed request count: `None` for any other.
    ///
    /// Passive health records the status; a 2xx response of a session turn
    /// carries the signed session token. Without a body to come, the prefill
    /// is over now ([`RequestFlow::response_chunk`]).
    pub fn response_headers(
        &mut self,
        status: Option<u16>,
        body_follows: bool,
        now: Instant,
    ) -> Option<ResponseStart> {
        let r = self.routed.as_ref().filter(|_| !self.responded)?;
        self.responded = true;
        self.status = status;
        let id = self.id;
        self.ctx.tell(|o| o.responded(id, &r.decision, now, status));
        let scheduler = &self.ctx.scheduler;
        let decision = &r.decision;
        let ejected = status.is_some_and(|s| scheduler.record_response(decision, s, now));
        if ejected {
            warn!(
                endpoint = %decision.decode.endpoint().address,
                status,
                failures = decision.decode.state.health().failures(),
                "endpoint ejected after failing responses"
            );
        }
        // A session token must not pin a session to a worker that failed its turn.
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        let headers = ok.then(|| scheduler.response_headers(decision)).flatten();
        if !body_follows {
            scheduler.prefill_done_at(decision, now);
        }
        Some(ResponseStart { headers, ejected })
    }

    /// A response body chunk arrived at `now`. The routed request's prefill
    /// is over at the first (a streamed response's first token comes after
    /// it; a buffered response's only chunk is late, never early), so the
    /// scheduler stops counting its uncached blocks; it releases once
    /// however often this is called. Chunks without bytes are not observed.
    pub fn response_chunk(&mut self, bytes: &[u8], now: Instant) {
        self.tail.push(bytes);
        let Some(r) = &self.routed else {
            return;
        };
        self.ctx.scheduler.prefill_done_at(&r.decision, now);
        if bytes.is_empty() {
            return;
        }
        let (id, n) = (self.id, bytes.len());
        match std::mem::replace(&mut self.first_chunk_seen, true) {
            false => self.ctx.tell(|o| o.first_chunk(id, &r.decision, now, n)),
            true => self.ctx.tell(|o| o.chunk(id, &r.decision, now, n)),
        }
    }

    /// The response completed at `now`: the scheduler settles the request
    /// with its status. `None` when it was not routed or already ended.
    pub fn finish(&mut self, now: Instant) -> Option<Finished> {
        let r = self.routed.take()?;
        let status = self.status;
        self.ctx.scheduler.finish_at(&r.decision, status, now);
        let end = FlowEnd::Finished { status };
        self.ctx.tell(|o| o.ended(self.id, &r.decision, now, end));
        let took = self
            .started_at
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        let tail = std::mem::take(&mut self.tail);
        Some(Finished { took, tail })
    }

    /// The stream ended at `now` before the response did (client gone, Envoy
    /// reset): the scheduler settles the request without a status, and
    /// observers see it cancelled. Nothing happens for a request that was not
    /// routed or already ended.
    pub fn cancel(&mut self, now: Instant) {
        if let Some(r) = self.routed.take() {
            self.ctx.scheduler.finish_at(&r.decision, None, now);
            let end = FlowEnd::Cancelled;
            self.ctx.tell(|o| o.ended(self.id, &r.decision, now, end));
        }
    }
}

impl Drop for RequestFlow {
    fn drop(&mut self) {
        self.cancel(Instant::now());
    }
}
