//! The per-stream ext_proc state machine.
//!
//! One [`StreamState`] follows one HTTP request through Envoy's ext_proc filter:
//! request headers, request body (full-duplex streamed, buffered/streamed, or none),
//! trailers, and the response path. [`StreamState::handle`] is synchronous and
//! returns the messages to send back, so the protocol can be tested without a server.
//!
//! It translates: Envoy's messages become the events of the request's
//! [`RequestFlow`] (which admits, picks, follows the response and finishes), and
//! the flow's [`Step`]s become Envoy's answers. What stays here is the
//! protocol: body modes, buffering and its budget, deadlines, the answers'
//! shapes, metrics and the request's trace span.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use tracing::{debug, info, warn};

use super::body::{Overflow, RequestBuffer};
use super::conformance;
use super::messages::{self, find_header, set_header, EnvoyHeaders};
use super::mode::BodyMode;
use super::Shared;
use crate::admission::{Permit, Rejection, Ticket, DROPPED_REASON_HEADER};
use crate::flow::{Refusal, RequestFlow, Routing, Step};
use crate::pipeline::{RequestHead, TokenizeJob, Tokenized};
use crate::scheduler::PickError;
use crate::telemetry::RequestResult;
use crate::tracing_export::RequestSpan;

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
    /// The request itself: admission, the pick, the response, the end.
    flow: RequestFlow,
    /// The request body until it is complete.
    body: RequestBuffer,
    /// The complete body ended the request stream (no trailers follow).
    body_ended_stream: bool,
    /// The routed body being streamed back (full duplex).
    echo: Option<messages::Echo>,
    /// With the conformance hooks: the served endpoint the gateway reported.
    served: Option<String>,
    /// The request's OpenTelemetry span; `None` when tracing is off.
    trace: Option<Box<RequestSpan>>,
}

impl StreamState {
    /// A fresh stream.
    pub fn new(shared: Arc<Shared>) -> Self {
        let body = RequestBuffer::new(&shared.body_budget, shared.config.max_body_bytes);
        StreamState {
            flow: RequestFlow::new(Arc::clone(&shared.flow)),
            shared,
            request_mode: BodyMode::Unknown,
            response_mode: BodyMode::Unknown,
            phase: Phase::Start,
            headers_answered: false,
            body,
            body_ended_stream: false,
            echo: None,
            served: None,
            trace: None,
        }
    }

    /// The flow-control ticket a body is queued on, if any; answer with
    /// [`StreamState::admitted`] once it resolves. Dropping the ticket instead
    /// (the stream went away) takes the request out of its queue.
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.flow.take_ticket()
    }

    /// Routes the queued body once flow control lets it go, or answers 429.
    pub fn admitted(&mut self, verdict: Result<Permit, Rejection>) -> Vec<ProcessingResponse> {
        if let Some(t) = &mut self.trace {
            t.admitted();
        }
        let step = self.flow.admitted(verdict, Instant::now());
        step.map_or_else(Vec::new, |step| self.answer(step))
    }

    /// The tokenization a complete body is waiting for, if any; answer with
    /// [`StreamState::tokenized`].
    pub fn take_tokenize_job(&mut self) -> Option<TokenizeJob> {
        self.flow.take_tokenize_job()
    }

    /// Admits and routes the body that was waiting for its tokens.
    pub fn tokenized(&mut self, tokenized: Tokenized) -> Vec<ProcessingResponse> {
        let step = self.flow.tokenized(tokenized, Instant::now());
        step.map_or_else(Vec::new, |step| self.answer(step))
    }

    /// The answers to what the flow did with the request.
    fn answer(&mut self, step: Step) -> Vec<ProcessingResponse> {
        match step {
            Step::Tokenizing => Vec::new(),
            Step::Queued => {
                if let Some(t) = &mut self.trace {
                    t.queued();
                }
                Vec::new()
            }
            Step::Routed(routing) => self.forward(routing),
            Step::Refused(Refusal::BadRequest(e)) => {
                self.shared.metrics.record_result(RequestResult::BadRequest);
                vec![self.reject(400, "invalid_request_error", &e.to_string())]
            }
            Step::Refused(Refusal::NoEndpoint(e)) => {
                let result = match e {
                    PickError::SubsetEmpty => RequestResult::SubsetEmpty,
                    _ => RequestResult::NoEndpoint,
                };
                self.shared.metrics.record_result(result);
                self.record_error("ServiceUnavailable");
                warn!(error = %e, "no endpoint");
                vec![self.reject(503, "service_unavailable", &e.to_string())]
            }
            Step::Refused(Refusal::Shed(why)) => vec![self.shed(why)],
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
        messages::add_immediate_header(&mut out, DROPPED_REASON_HEADER, why.reason());
        out
    }

    fn record_error(&self, code: &'static str) {
        if let (Some(class), Some(m)) = (self.flow.class(), &self.shared.admission_metrics) {
            m.error(class, code);
        }
    }

    /// When the request body must be complete, while it is still arriving.
    pub fn body_deadline(&self) -> Option<Instant> {
        if self.phase != Phase::RequestBody {
            return None;
        }
        Some(self.flow.started_at()? + self.shared.config.body_deadline)
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
        let step = self.flow.route_on_headers(Instant::now());
        let out = self.answer(step);
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
        if self.flow.subset().is_none() {
            if let Some(hint) = messages::subset_hint(msg.metadata_context.as_ref()) {
                self.flow.set_subset(hint);
            }
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
            let snapshot = self.shared.flow.endpoints.snapshot();
            if let Some(sel) = find_header(h.headers.as_ref(), conformance::SELECTION_HEADER)
                .and_then(|v| conformance::selected(&v, &snapshot))
            {
                let within = conformance::within(sel, self.flow.subset());
                self.flow.set_subset(within);
            }
        }
        if !head.spoofed.is_empty() {
            info!(headers = ?head.spoofed, "client sent routing headers; removing them");
            self.shared.extproc_metrics.spoofed_headers.inc();
        }
        debug!(path = %head.path, request_id = ?head.request_id, "request headers");
        self.trace = RequestSpan::start(h.headers.as_ref(), &head.path);
        if self.trace.is_some() {
            self.flow.record_terms();
        }
        let now = Instant::now();
        self.flow.request_headers(head, now);
        if h.end_of_stream || self.request_mode == BodyMode::None {
            // Header-only request (GET /v1/models) or a body Envoy will never send.
            let step = self.flow.route_on_headers(now);
            return self.answer(step);
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
        self.request_mode = self.request_mode.on_request_body(self.headers_answered);
        if let Err(overflow) = self.body.push(&b.body, self.flow.head().content_length) {
            let msg = overflow.to_string();
            return vec![match overflow {
                Overflow::TooLarge { .. } => self.reject(413, "invalid_request_error", &msg),
                Overflow::OverBudget { .. } => {
                    self.shared.extproc_metrics.body_budget_rejections.inc();
                    self.reject(429, "rate_limit_exceeded", &msg)
                }
            }];
        }
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
        self.body_ended_stream = end_of_stream;
        let body = self.body.take();
        let step = self.flow.request_body(body, Instant::now());
        self.answer(step)
    }

    /// Answers with the flow's decision: the routing headers and the
    /// destination, on the body answer (buffered), on the headers answer before
    /// the body streamed back (full duplex), or on the headers answer alone.
    fn forward(&mut self, routing: Routing) -> Vec<ProcessingResponse> {
        // The body leaves the stream's buffer with this answer.
        self.body.release();
        if !routing.replaced {
            // A body replacing a decision made on its headers counts once.
            self.shared.metrics.record_decision(routing.decided_in);
            self.shared.metrics.record_result(RequestResult::Routed);
        }
        if let (Some(t), Some(terms), Some(d)) = (&self.trace, &routing.terms, self.flow.decision())
        {
            t.routed(d, terms);
        }
        let outcome = routing.outcome;
        let mut set_headers: Vec<_> = messages::set_headers(outcome.set_headers).collect();
        if let Some(t) = &self.trace {
            // The worker's spans continue this request's trace from kvpick's span.
            set_headers.extend(messages::set_headers(t.forward_headers()));
        }
        let mutation = HeaderMutation {
            set_headers,
            remove_headers: outcome.remove_headers,
        };
        let destination = &outcome.destination;
        self.phase = Phase::Routed;
        let answer = match outcome.body {
            // Buffered: the decision rides on the body answer.
            Some(body) if self.headers_answered => {
                messages::routed_body(mutation, destination, body.changed.then_some(body.bytes))
            }
            // Full duplex: headers answer first, then the body streamed back.
            Some(body) => {
                self.echo = Some(messages::Echo::new(body.bytes, self.body_ended_stream));
                messages::routed_headers(mutation, destination)
            }
            // Header-only: the decision rides on the headers answer.
            None => messages::routed_headers(mutation, destination),
        };
        self.headers_answered = true;
        vec![answer]
    }

    /// Answers held request headers with CONTINUE, removing spoofed routing headers.
    fn continue_headers(&mut self) -> ProcessingResponse {
        self.headers_answered = true;
        let remove = self.flow.head().spoofed.clone();
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

    /// The first response of a request routed with fallbacks: the gateway
    /// reports (`envoy.lb` metadata) which endpoint served it, and the flow
    /// follows it there.
    fn follow_served(&mut self, metadata: Option<&Metadata>) {
        if self.phase != Phase::Routed || !self.flow.follows_served() {
            return;
        }
        if let Some(served) = messages::served_endpoint(metadata)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            self.flow.served_by(served, Instant::now());
        }
    }

    fn on_response_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        // Only the first response headers of a request this stream routed and
        // sent on count (for health and sessions): a caller repeating them, or
        // sending them before its request went out, changes nothing.
        let status = find_header(h.headers.as_ref(), ":status").and_then(|s| s.parse().ok());
        let body_follows = self.response_mode != BodyMode::None;
        let start = match self.phase {
            Phase::Routed => self
                .flow
                .response_headers(status, body_follows, Instant::now()),
            _ => None,
        };
        let Some(start) = start else {
            debug!(phase = ?self.phase, "response headers that do not count");
            if h.end_of_stream {
                self.finish();
            }
            return vec![messages::response_headers(self.with_served(None))];
        };
        if start.ejected {
            self.shared.extproc_metrics.endpoint_ejections.inc();
        }
        if let (Some(status), Some(t)) = (status, &self.trace) {
            t.response(status);
        }
        let mutation = start.headers.map(|headers| HeaderMutation {
            set_headers: messages::set_headers(headers).collect(),
            ..Default::default()
        });
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
        self.response_mode = self.response_mode.on_response_body(self.request_mode);
        let seen: &[u8] = match self.response_mode {
            BodyMode::None => &[],
            _ => &b.body,
        };
        self.flow.response_chunk(seen, Instant::now());
        let out = match self.response_mode {
            BodyMode::FullDuplex => messages::streamed_body(&b.body, b.end_of_stream, true),
            BodyMode::None => Vec::new(),
            _ => vec![messages::body(messages::common(None, false), None, true)],
        };
        if b.end_of_stream {
            self.finish();
        }
        out
    }

    /// The request has finished (response complete): the flow settles it, and
    /// its objective metrics record how it went.
    fn finish(&mut self) {
        if let Some(done) = self.flow.finish(Instant::now()) {
            if let (Some(class), Some(m)) = (self.flow.class(), &self.shared.admission_metrics) {
                m.finished(class, done.took, done.tail.total(), done.tail.usage());
            }
        }
        self.phase = Phase::Done;
    }

    fn reject(&mut self, status: u16, kind: &str, message: &str) -> ProcessingResponse {
        if let Some(t) = &self.trace {
            t.rejected(status, message);
        }
        self.phase = Phase::Done;
        self.body.release();
        messages::immediate_error(status, kind, message)
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
