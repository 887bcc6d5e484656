//! The per-stream ext_proc state machine.
//!
//! One [`StreamState`] follows one HTTP request through Envoy's ext_proc filter:
//! request headers, request body (full-duplex streamed, buffered/streamed, or none),
//! trailers, and the response path. [`StreamState::handle`] is synchronous and
//! returns the messages to send back, so the protocol can be tested without a server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use tracing::{debug, info, warn};

use super::budget::Reservation;
use super::conformance;
use super::messages::{self, find_header, set_header, EnvoyHeaders};
use super::Shared;
use crate::admission::{Permit, Rejection, RequestClass, Ticket, Verdict, DROPPED_REASON_HEADER};
use crate::endpoints::{InFlightGuard, Snapshot};
use crate::pipeline::{self, Prepared, RequestHead, TokenizeJob, Tokenized};
use crate::request::usage::ResponseTail;
use crate::scheduler::{Decision, PickError, PickRequest};
use crate::telemetry::RequestResult;
use crate::tracing_export::RequestSpan;

/// How Envoy sends the request body on this stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// Not announced and not yet inferred.
    Unknown,
    /// FULL_DUPLEX_STREAMED: chunks arrive without waiting; kvpick answers the
    /// headers after the last chunk and streams the body back.
    FullDuplex,
    /// BUFFERED, BUFFERED_PARTIAL or STREAMED: Envoy waits for the headers answer,
    /// then sends the body, one answer per body message.
    Buffered,
    /// NONE: the body is never sent to kvpick.
    None,
}

impl BodyMode {
    fn from_config(mode: i32) -> BodyMode {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(_) => BodyMode::Buffered,
            Err(_) => BodyMode::Unknown,
        }
    }
}

/// Where the stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for request headers.
    Start,
    /// Headers seen, body being received.
    RequestBody,
    /// Request forwarded; response path may follow.
    Routed,
    /// The stream is over (immediate response sent, or the response finished).
    Done,
}

/// State of one ext_proc stream.
pub struct StreamState {
    shared: Arc<Shared>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    phase: Phase,
    headers_answered: bool,
    /// What the request headers said (empty until they arrive).
    head: RequestHead,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The buffered body's share of the process-wide budget.
    reservation: Reservation,
    /// When the request headers arrived: the body deadline and the request's
    /// duration count from here.
    headers_at: Option<Instant>,
    routed: Option<Routed>,
    response_status: Option<u16>,
    /// Response headers arrived (only the first count).
    response_seen: bool,
    /// A complete body waiting for its tokens.
    tokenizing: Option<Box<RequestBody>>,
    /// A body waiting in a flow-control queue.
    admitting: Option<Box<Admitting>>,
    /// The request's admission class, once its body is parsed.
    class: Option<RequestClass>,
    /// The routed body being streamed back (full duplex).
    echo: Option<messages::Echo>,
    /// The response body's length and tail (for the engine's token usage).
    response_tail: ResponseTail,
    /// With the conformance hooks: the served endpoint the gateway reported.
    served: Option<String>,
    /// The request's OpenTelemetry span; `None` when tracing is off.
    trace: Option<Box<RequestSpan>>,
}

/// A request held by flow control: routed once its ticket is answered.
struct Admitting {
    body: RequestBody,
    ticket: Option<Ticket>,
}

/// A complete request body on its way to a decision.
struct RequestBody {
    prepared: Prepared,
    /// The body ended the request stream (no trailers follow).
    end_of_stream: bool,
}

struct Routed {
    decision: Decision,
    _in_flight: InFlightGuard,
}

impl StreamState {
    /// A fresh stream.
    pub fn new(shared: Arc<Shared>) -> Self {
        let reservation = shared.body_budget.reservation();
        StreamState {
            shared,
            request_mode: BodyMode::Unknown,
            response_mode: BodyMode::Unknown,
            phase: Phase::Start,
            headers_answered: false,
            head: RequestHead::default(),
            subset: None,
            body: Vec::new(),
            reservation,
            headers_at: None,
            routed: None,
            response_status: None,
            response_seen: false,
            tokenizing: None,
            admitting: None,
            class: None,
            echo: None,
            response_tail: ResponseTail::default(),
            served: None,
            trace: None,
        }
    }

    /// The flow-control ticket a body is queued on, if any; answer with
    /// [`StreamState::admitted`] once it resolves. Dropping the ticket instead
    /// (the stream went away) takes the request out of its queue.
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.admitting.as_mut()?.ticket.take()
    }

    /// Routes the queued body once flow control lets it go, or answers 429.
    pub fn admitted(&mut self, verdict: Result<Permit, Rejection>) -> Vec<ProcessingResponse> {
        let Some(admitting) = self.admitting.take() else {
            return Vec::new();
        };
        if let Some(t) = &mut self.trace {
            t.admitted();
        }
        match verdict {
            Ok(permit) => {
                let snapshot = self.shared.endpoints.snapshot();
                let out = self.route(Some(admitting.body), &snapshot);
                drop(permit);
                out
            }
            Err(why) => vec![self.shed(why)],
        }
    }

    /// Passes a prepared body through admission, then routes it (or holds it, or sheds it).
    fn admit(&mut self, body: RequestBody) -> Vec<ProcessingResponse> {
        let class = self
            .shared
            .admission
            .classify(body.prepared.signals(&self.head));
        let bytes = body.prepared.body_len();
        if let (Some(m), true) = (&self.shared.admission_metrics, bytes > 0) {
            m.request_size(&class, bytes);
        }
        self.class = Some(class.clone());
        let snapshot = self.shared.endpoints.snapshot();
        match self.shared.admission.admit(class, &snapshot) {
            Verdict::Go(permit) => {
                let out = self.route(Some(body), &snapshot);
                drop(permit);
                out
            }
            Verdict::Wait(ticket) => {
                debug!("pool saturated: request queued by flow control");
                if let Some(t) = &mut self.trace {
                    t.queued();
                }
                self.admitting = Some(Box::new(Admitting {
                    body,
                    ticket: Some(ticket),
                }));
                Vec::new()
            }
            Verdict::Reject(why) => vec![self.shed(why)],
        }
    }

    /// 429 with a JSON body and the `x-llm-d-request-dropped-reason` header.
    fn shed(&mut self, why: Rejection) -> ProcessingResponse {
        info!(reason = why.reason(), "request shed by flow control");
        self.record_error("ResourceExhausted");
        if let Some(t) = &self.trace {
            t.shed(why.reason());
        }
        let message = format!("{why} ({})", why.reason());
        let mut out = self.reject(429, "rate_limit_exceeded", &message);
        if let Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ImmediateResponse(ir)) = &mut out.response {
            ir.headers
                .get_or_insert_with(Default::default)
                .set_headers
                .push(set_header(DROPPED_REASON_HEADER, why.reason()));
        }
        out
    }

    fn record_error(&self, code: &'static str) {
        if let (Some(class), Some(m)) = (&self.class, &self.shared.admission_metrics) {
            m.error(class, code);
        }
    }

    /// The tokenization a complete body is waiting for, if any; answer with
    /// [`StreamState::tokenized`].
    pub fn take_tokenize_job(&mut self) -> Option<TokenizeJob> {
        self.tokenizing.as_mut()?.prepared.take_tokenize_job()
    }

    /// Admits and routes the body that was waiting for its tokens
    /// ([`Prepared::tokenized`]).
    pub fn tokenized(&mut self, tokenized: Tokenized) -> Vec<ProcessingResponse> {
        let Some(mut waiting) = self.tokenizing.take() else {
            return Vec::new();
        };
        waiting.prepared.tokenized(tokenized);
        self.admit(*waiting)
    }

    /// When the request body must be complete, while it is still arriving.
    pub fn body_deadline(&self) -> Option<Instant> {
        if self.phase != Phase::RequestBody {
            return None;
        }
        Some(self.headers_at? + self.shared.config.body_deadline)
    }

    /// The body did not complete by [`StreamState::body_deadline`]: 408.
    pub fn body_deadline_expired(&mut self) -> Vec<ProcessingResponse> {
        if self.phase != Phase::RequestBody {
            return Vec::new();
        }
        let msg = format!(
            "request body not complete {} ms after its headers",
            self.shared.config.body_deadline.as_millis()
        );
        vec![self.reject(408, "timeout", &msg)]
    }

    /// True once nothing more will be answered on this stream.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// True while request headers are held and the body mode is still unknown:
    /// the caller should call [`StreamState::body_wait_expired`] if no body arrives
    /// within the configured wait.
    pub fn waiting_to_infer_mode(&self) -> bool {
        self.phase == Phase::RequestBody
            && self.request_mode == BodyMode::Unknown
            && !self.headers_answered
            && self.body.is_empty()
    }

    /// No body arrived in time after the headers, with no protocol_config: most
    /// likely a buffered/streamed-mode Envoy waiting for the headers answer, but
    /// possibly a full-duplex one whose client is slow. Either way Envoy may send
    /// the headers upstream on this answer, so it carries a destination picked
    /// without the body; a body that follows re-routes on its own answer.
    pub fn body_wait_expired(&mut self) -> Vec<ProcessingResponse> {
        if !self.waiting_to_infer_mode() {
            return Vec::new();
        }
        debug!("no body after headers: inferring BUFFERED request body mode");
        self.request_mode = BodyMode::Buffered;
        let out = self.route_without_body();
        if !self.is_done() {
            self.phase = Phase::RequestBody;
        }
        out
    }

    /// Whether handling `msg` ends a request body of at least `threshold` bytes
    /// (so it parses, hashes and picks for that body): the caller then runs
    /// [`StreamState::handle`] off the async threads.
    pub fn completes_body_of_at_least(&self, msg: &ProcessingRequest, threshold: usize) -> bool {
        if self.phase != Phase::RequestBody {
            return false;
        }
        match &msg.request {
            Some(Request::RequestBody(b)) => {
                b.end_of_stream && self.body.len() + b.body.len() >= threshold
            }
            Some(Request::RequestTrailers(_)) => self.body.len() >= threshold,
            _ => false,
        }
    }

    /// The next answer streaming the routed body back (full duplex), to send
    /// right after the answers of the call that routed it; `None` when done.
    pub fn next_echo(&mut self) -> Option<ProcessingResponse> {
        let next = self.echo.as_mut()?.next();
        if next.is_none() {
            self.echo = None;
        }
        next
    }

    /// Handles one message from Envoy and returns the answers, in order. A
    /// full-duplex body streamed back follows them through
    /// [`StreamState::next_echo`].
    pub fn handle(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode = BodyMode::from_config(pc.request_body_mode);
            self.response_mode = BodyMode::from_config(pc.response_body_mode);
        }
        if self.subset.is_none() {
            self.subset = messages::subset_hint(msg.metadata_context.as_ref());
        }
        if matches!(msg.request, Some(Request::ResponseHeaders(_))) {
            self.follow_served(msg.metadata_context.as_ref());
            if self.shared.config.conformance_test_hooks {
                self.served = Some(conformance::served(msg.metadata_context.as_ref()));
            }
        }
        if msg.observability_mode {
            // Envoy ignores answers in observability mode; still track the request.
            let _ = self.dispatch(msg.request);
            return Vec::new();
        }
        self.dispatch(msg.request)
    }

    fn dispatch(&mut self, request: Option<Request>) -> Vec<ProcessingResponse> {
        match request {
            Some(Request::RequestHeaders(h)) => self.on_request_headers(h),
            Some(Request::RequestBody(b)) => self.on_request_body(b),
            Some(Request::RequestTrailers(_)) => self.on_request_trailers(),
            Some(Request::ResponseHeaders(h)) => self.on_response_headers(h),
            Some(Request::ResponseBody(b)) => self.on_response_body(b),
            Some(Request::ResponseTrailers(_)) => {
                self.finish();
                vec![messages::trailers(true)]
            }
            None => Vec::new(),
        }
    }

    fn on_request_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        if self.phase != Phase::Start {
            warn!("request headers twice on one stream");
            return vec![self.reject(400, "invalid_request_error", "unexpected request headers")];
        }
        let cfg = &self.shared.config;
        let head = RequestHead::read(
            &EnvoyHeaders(h.headers.as_ref()),
            &cfg.session_header,
            &cfg.session_token_header,
        );
        if cfg.conformance_test_hooks {
            let snapshot = self.shared.endpoints.snapshot();
            if let Some(sel) = find_header(h.headers.as_ref(), conformance::SELECTION_HEADER)
                .and_then(|v| conformance::selected(&v, &snapshot))
            {
                self.subset = Some(conformance::within(sel, self.subset.as_deref()));
            }
        }
        self.headers_at = Some(Instant::now());
        if !head.spoofed.is_empty() {
            info!(headers = ?head.spoofed, "client sent routing headers; removing them");
            self.shared.metrics.spoofed_headers.inc();
        }
        debug!(path = %head.path, request_id = ?head.request_id, "request headers");
        self.trace = RequestSpan::start(h.headers.as_ref(), &head.path);
        self.head = head;
        if h.end_of_stream || self.request_mode == BodyMode::None {
            // Header-only request (GET /v1/models) or a body Envoy will never send.
            return self.route_without_body();
        }
        self.phase = Phase::RequestBody;
        if self.request_mode == BodyMode::Buffered {
            return vec![self.continue_headers()];
        }
        // Full duplex (announced or assumed until proven otherwise): hold the headers.
        Vec::new()
    }

    fn on_request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if self.phase != Phase::RequestBody {
            debug!(phase = ?self.phase, "request body outside the body phase; passing through");
            return self.pass_request_body(b);
        }
        if self.request_mode == BodyMode::Unknown {
            self.request_mode = if self.headers_answered {
                BodyMode::Buffered
            } else {
                BodyMode::FullDuplex
            };
        }
        if self.body.len() + b.body.len() > self.shared.config.max_body_bytes {
            let msg = format!(
                "request body exceeds the {} byte limit",
                self.shared.config.max_body_bytes
            );
            return vec![self.reject(413, "invalid_request_error", &msg)];
        }
        if !self.reservation.grow(b.body.len()) {
            let budget = &self.shared.body_budget;
            let msg = format!(
                "kvpick is buffering {} of its {} byte request-body budget; this body does not fit, retry later",
                budget.used(),
                budget.limit()
            );
            self.shared.metrics.body_budget_rejections.inc();
            return vec![self.reject(429, "rate_limit_exceeded", &msg)];
        }
        if self.body.is_empty() {
            // One allocation of the announced size instead of doubling growth.
            let announced = self.head.content_length;
            if let Some(n) = announced.filter(|n| *n <= self.shared.config.max_body_bytes) {
                self.body.reserve_exact(n);
            }
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return match self.request_mode {
                // Streamed mode expects one answer per chunk; pass it on unchanged.
                BodyMode::Buffered => {
                    vec![messages::body(messages::common(None, false), None, false)]
                }
                _ => Vec::new(),
            };
        }
        self.finish_request_body(true)
    }

    fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        if self.phase == Phase::RequestBody {
            // Trailers end the body: route now, then answer the trailers.
            let mut out = self.finish_request_body(false);
            if !self.is_done() {
                // After the streamed-back body, when there is one.
                match self.echo.as_mut() {
                    Some(echo) => echo.after.push_back(messages::trailers(false)),
                    None => out.push(messages::trailers(false)),
                }
            }
            return out;
        }
        vec![messages::trailers(false)]
    }

    fn finish_request_body(&mut self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let body = std::mem::take(&mut self.body);
        let prepared = match self.shared.pipeline.prepare(body, &self.head) {
            Ok(p) => p,
            Err(e) => {
                self.shared.metrics.record_result(RequestResult::BadRequest);
                return vec![self.reject(400, "invalid_request_error", &e.to_string())];
            }
        };
        let body = RequestBody {
            prepared,
            end_of_stream,
        };
        if body.prepared.waits_for_tokens() {
            self.tokenizing = Some(Box::new(body));
            return Vec::new();
        }
        self.admit(body)
    }

    /// Routes a request that has no body on its headers alone, in the current
    /// endpoint set.
    fn route_without_body(&mut self) -> Vec<ProcessingResponse> {
        let snapshot = self.shared.endpoints.snapshot();
        self.route(None, &snapshot)
    }

    /// Picks the target of the request (with its complete `body`, or on its
    /// headers alone) in `snapshot` and answers with the decision.
    fn route(&mut self, body: Option<RequestBody>, snapshot: &Snapshot) -> Vec<ProcessingResponse> {
        // The body leaves the stream's buffer with this answer.
        self.reservation.release();
        let started = Instant::now();
        let req = PickRequest {
            body: body.as_ref().map(|b| &b.prepared.request),
            subset: self.subset.as_deref(),
            session_id: self.head.session_id.as_deref(),
            session_token: self.head.session_token.as_deref(),
        };
        let picked = match &self.trace {
            None => self.shared.scheduler.pick(&req, snapshot),
            Some(t) => self
                .shared
                .scheduler
                .pick_with_terms(&req, snapshot)
                .map(|(d, terms)| {
                    t.routed(&d, &terms);
                    d
                }),
        };
        let decision = match picked {
            Ok(d) => d,
            Err(e) => {
                let result = match e {
                    PickError::SubsetEmpty => RequestResult::SubsetEmpty,
                    _ => RequestResult::NoEndpoint,
                };
                self.shared.metrics.record_result(result);
                self.record_error("ServiceUnavailable");
                warn!(error = %e, "no endpoint");
                return vec![self.reject(503, "service_unavailable", &e.to_string())];
            }
        };
        // A body that follows a decision made on its headers alone (see
        // `body_wait_expired`) replaces that decision; the request counts once.
        let rerouted = self
            .routed
            .take()
            .map(|r| self.shared.scheduler.cancel(&r.decision));
        if rerouted.is_none() {
            self.shared.metrics.record_decision(started.elapsed());
            self.shared.metrics.record_result(RequestResult::Routed);
        }
        debug!(
            endpoint = %decision.decode.endpoint().address,
            worker = decision.decode.endpoint().instance_id,
            dp_rank = decision.decode.rank,
            prefill = ?decision.prefill.as_ref().map(|p| p.endpoint().instance_id),
            "routed"
        );
        let end_of_stream = body.as_ref().is_some_and(|b| b.end_of_stream);
        let outcome = match pipeline::outcome(&decision, &self.head, body.map(|b| b.prepared)) {
            Ok(outcome) => outcome,
            Err(e) => {
                self.shared.metrics.record_result(RequestResult::BadRequest);
                return vec![self.reject(400, "invalid_request_error", &e.to_string())];
            }
        };
        let mut mutation = HeaderMutation {
            set_headers: outcome
                .set_headers
                .into_iter()
                .map(|(name, value)| set_header(name, value))
                .collect(),
            remove_headers: outcome.remove_headers,
        };
        if let Some(t) = &self.trace {
            // The worker's spans continue this request's trace from kvpick's span.
            let context = t.forward_headers().into_iter();
            mutation
                .set_headers
                .extend(context.map(|(name, value)| set_header(name, value)));
        }
        let metadata = Some(messages::destination_metadata(&outcome.destination));
        let guard = decision.begin();
        self.routed = Some(Routed {
            decision,
            _in_flight: guard,
        });
        self.phase = Phase::Routed;
        match outcome.body {
            Some(body) if self.headers_answered => {
                // Buffered: the decision rides on the body answer.
                let mut common = messages::common(Some(mutation), true);
                if body.changed {
                    common.body_mutation = Some(messages::replace_body(body.bytes));
                }
                vec![messages::body(common, metadata, false)]
            }
            Some(body) => {
                // Full duplex: headers answer first, then the body streamed back.
                self.headers_answered = true;
                self.echo = Some(messages::Echo::new(body.bytes, end_of_stream));
                vec![messages::request_headers(
                    messages::common(Some(mutation), true),
                    metadata,
                )]
            }
            None => {
                // Header-only: the decision rides on the headers answer.
                self.headers_answered = true;
                vec![messages::request_headers(
                    messages::common(Some(mutation), true),
                    metadata,
                )]
            }
        }
    }

    /// Answers held request headers with CONTINUE, removing spoofed routing headers.
    fn continue_headers(&mut self) -> ProcessingResponse {
        self.headers_answered = true;
        let remove = self.head.spoofed.clone();
        let mutation = (!remove.is_empty()).then(|| HeaderMutation {
            remove_headers: remove,
            ..Default::default()
        });
        messages::request_headers(messages::common(mutation, false), None)
    }

    fn pass_request_body(&self, b: HttpBody) -> Vec<ProcessingResponse> {
        match self.request_mode {
            BodyMode::FullDuplex => messages::streamed_body(&b.body, b.end_of_stream, false),
            BodyMode::None => Vec::new(),
            _ => vec![messages::body(messages::common(None, false), None, false)],
        }
    }

    /// The first response of a request routed with fallbacks: when the
    /// gateway reports (`envoy.lb` metadata) it served the request from a
    /// fallback, the booking and the in-flight count move there, so load,
    /// health and the session follow where the request runs.
    fn follow_served(&mut self, metadata: Option<&Metadata>) {
        if self.phase != Phase::Routed || self.response_seen {
            return;
        }
        let Some(r) = self
            .routed
            .as_mut()
            .filter(|r| !r.decision.fallbacks.is_empty())
        else {
            return;
        };
        let Some(served) = messages::served_endpoint(metadata)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        else {
            return;
        };
        if self
            .shared
            .scheduler
            .serve_on_fallback(&mut r.decision, served)
        {
            // The primary's guard drops as the served rank's begins.
            r._in_flight = r.decision.begin();
        }
    }

    fn on_response_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        // Only the first response headers of a request this stream routed and
        // sent on count (for health and sessions): a caller repeating them, or
        // sending them before its request went out, changes nothing.
        if self.phase != Phase::Routed || self.response_seen {
            debug!(phase = ?self.phase, "response headers that do not count");
            if h.end_of_stream {
                self.finish();
            }
            return vec![messages::response_headers(self.with_served(None))];
        }
        self.response_seen = true;
        self.response_status =
            find_header(h.headers.as_ref(), ":status").and_then(|s| s.parse().ok());
        if let (Some(status), Some(r)) = (self.response_status, &self.routed) {
            self.record_health(&r.decision, status);
        }
        if let (Some(status), Some(t)) = (self.response_status, &self.trace) {
            t.response(status);
        }
        // Only a successful response carries scheduler headers (a session token
        // must not pin a session to a worker that failed its turn).
        let ok = self
            .response_status
            .is_some_and(|s| (200..300).contains(&s));
        let mutation = self
            .routed
            .as_ref()
            .filter(|_| ok)
            .and_then(|r| self.shared.scheduler.response_headers(&r.decision))
            .map(|headers| HeaderMutation {
                set_headers: headers
                    .into_iter()
                    .map(|(k, v)| set_header(&k, v))
                    .collect(),
                ..Default::default()
            });
        if self.response_mode == BodyMode::None {
            self.prefill_done();
        }
        if h.end_of_stream {
            self.finish();
        }
        vec![messages::response_headers(self.with_served(mutation))]
    }

    /// `mutation` plus the conformance hooks' served-endpoint header, when on.
    fn with_served(&mut self, mutation: Option<HeaderMutation>) -> Option<HeaderMutation> {
        let Some(served) = self.served.take() else {
            return mutation;
        };
        let mut m = mutation.unwrap_or_default();
        m.set_headers
            .push(set_header(conformance::SERVED_HEADER, served));
        Some(m)
    }

    fn on_response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if self.response_mode == BodyMode::Unknown {
            // GIE configures both directions alike; follow the request side.
            self.response_mode = match self.request_mode {
                BodyMode::FullDuplex => BodyMode::FullDuplex,
                _ => BodyMode::Buffered,
            };
        }
        self.prefill_done();
        let out = match self.response_mode {
            BodyMode::FullDuplex => {
                self.response_tail.push(&b.body);
                messages::streamed_body(&b.body, b.end_of_stream, true)
            }
            BodyMode::None => Vec::new(),
            _ => {
                self.response_tail.push(&b.body);
                vec![messages::body(messages::common(None, false), None, true)]
            }
        };
        if b.end_of_stream {
            self.finish();
        }
        out
    }

    /// The routed request's prefill is over, so the scheduler stops counting
    /// its uncached blocks on its worker. Signalled at the first response body
    /// chunk (a streamed response's first token comes after the prefill); when
    /// Envoy sends no response body (mode NONE), at the response headers. In
    /// BUFFERED mode the first chunk is the whole body: late, never early
    /// (response headers of a streamed response can precede the first token).
    /// The scheduler releases once however often this is called.
    fn prefill_done(&self) {
        if let Some(r) = &self.routed {
            self.shared.scheduler.prefill_done(&r.decision);
        }
    }

    /// Passive health: the pod's (or Envoy's local) answer to a routed request.
    fn record_health(&self, decision: &Decision, status: u16) {
        if self
            .shared
            .scheduler
            .record_response(decision, status, Instant::now())
        {
            self.shared.metrics.endpoint_ejections.inc();
            warn!(
                endpoint = %decision.decode.endpoint().address,
                status,
                failures = decision.decode.state.health().failures(),
                "endpoint ejected after failing responses"
            );
        }
    }

    /// The request has finished (response complete): release in-flight and tell the
    /// scheduler how it went.
    fn finish(&mut self) {
        if let Some(r) = self.routed.take() {
            self.shared
                .scheduler
                .finish(&r.decision, self.response_status);
            if let (Some(class), Some(m)) = (&self.class, &self.shared.admission_metrics) {
                let tail = &self.response_tail;
                let took = self.headers_at.map_or(Duration::ZERO, |at| at.elapsed());
                m.finished(class, took, tail.total(), tail.usage());
            }
        }
        self.phase = Phase::Done;
    }

    fn reject(&mut self, status: u16, kind: &str, message: &str) -> ProcessingResponse {
        if let Some(t) = &self.trace {
            t.rejected(status, message);
        }
        self.phase = Phase::Done;
        self.body = Vec::new();
        self.reservation.release();
        messages::immediate_error(status, kind, message)
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // The stream ended early (client gone, Envoy reset): the request is over.
        if let Some(r) = self.routed.take() {
            self.shared.scheduler.finish(&r.decision, None);
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
