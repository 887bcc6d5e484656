//! The ext_proc gRPC service (`envoy.service.ext_proc.v3.ExternalProcessor/Process`).
//!
//! Thin glue: each stream drives [`stream::StreamState`] inside its own response
//! stream (no task of its own), so a panic in one stream ends that stream with an
//! INTERNAL status and never touches others. The answers go from the work to the
//! response stream through an [`Outbox`] that wakes nobody: both run in one task.

pub mod body;
pub mod budget;
pub mod conformance;
pub mod messages;
pub mod metrics;
pub mod mode;
pub mod stream;

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{FutureExt, Stream, StreamExt};
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status, Streaming};
use tracing::{error, Instrument};

use crate::admission::metrics::AdmissionMetrics;
use crate::admission::Ticket;
use crate::flow::FlowContext;
use crate::telemetry::Metrics;
use metrics::ExtProcMetrics;
use stream::StreamState;

/// Settings of the ext_proc handler.
#[derive(Debug, Clone)]
pub struct ExtProcConfig {
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Without `protocol_config`, how long to hold request headers waiting for a
    /// body chunk before concluding Envoy runs in a buffered mode.
    pub body_wait: Duration,
    /// Bytes of request bodies all streams together may buffer (429 beyond).
    pub body_budget_bytes: usize,
    /// How long after the request headers the body must be complete (408 beyond).
    pub body_deadline: Duration,
    /// Request header carrying a session id for clients that cannot edit the body.
    pub session_header: String,
    /// Request header carrying a signed session token from an earlier response.
    pub session_token_header: String,
    /// GIE's conformance-test hooks ([`conformance`]); off outside tests.
    pub conformance_test_hooks: bool,
}

impl Default for ExtProcConfig {
    fn default() -> Self {
        ExtProcConfig {
            max_body_bytes: 32 << 20,
            body_wait: Duration::from_millis(200),
            body_budget_bytes: budget::default_budget_bytes(),
            body_deadline: Duration::from_secs(60),
            session_header: "x-session-id".into(),
            session_token_header: "x-kvpick-session".into(),
            conformance_test_hooks: false,
        }
    }
}

/// What every stream shares.
pub struct Shared {
    /// What every request's flow shares: the endpoint set, the scheduler, the
    /// pipeline, admission, and the flows' observers.
    pub flow: Arc<FlowContext>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// The ext_proc server's own metrics.
    pub extproc_metrics: Arc<metrics::ExtProcMetrics>,
    /// Handler settings.
    pub config: ExtProcConfig,
    /// Objective metrics the stream records (request errors and durations).
    pub admission_metrics: Option<Arc<AdmissionMetrics>>,
    /// The process-wide buffered-body budget.
    pub body_budget: budget::BodyBudget,
}

/// The ext_proc service.
#[derive(Clone)]
pub struct ExtProcService {
    shared: Arc<Shared>,
    /// Bounds the large bodies handled at once on the blocking pool to the
    /// cores there are (more threads would only contend for the index).
    heavy: Arc<Semaphore>,
}

impl ExtProcService {
    /// A service over shared state.
    pub fn new(shared: Shared) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        ExtProcService {
            shared: Arc::new(shared),
            heavy: Arc::new(Semaphore::new(cores)),
        }
    }

    /// The tonic server wrapper. Its gRPC message limit sits well above
    /// `max_body_bytes` (tonic's default is 4 MiB), so a BUFFERED-mode body
    /// over the cap reaches kvpick and gets kvpick's own 413.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let limit = grpc_message_limit(self.shared.config.max_body_bytes);
        ExternalProcessorServer::new(self).max_decoding_message_size(limit)
    }
}

/// The largest ext_proc message accepted: twice the body cap plus room for
/// headers and metadata, at least 4 MiB.
pub fn grpc_message_limit(max_body_bytes: usize) -> usize {
    max_body_bytes
        .saturating_mul(2)
        .saturating_add(1 << 20)
        .max(4 << 20)
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let outbox = Outbox::default();
        let shared = Arc::clone(&self.shared);
        let metrics = Arc::clone(&shared.extproc_metrics);
        let heavy = Arc::clone(&self.heavy);
        let work = run_stream(shared, heavy, inbound, outbox.clone());
        Ok(Response::new(Box::pin(Contained::new(
            metrics, outbox, work,
        ))))
    }
}

/// Answers an [`Outbox`] holds before the work waits for the response stream
/// to take some (a body streamed back is queued a chunk at a time, never whole).
const OUTBOX_ANSWERS: usize = 16;

/// The answers of one stream on their way from its work to its response stream
/// ([`Contained`]), which polls the work itself: so nothing is ever woken
/// through the outbox. The response stream polls the work whenever the outbox
/// is empty, and returns pending only after a poll that left it empty; work
/// that finds the outbox full waits for that next poll, which comes because
/// the outbox is not empty.
#[derive(Clone, Default)]
struct Outbox(Arc<Mutex<VecDeque<ProcessingResponse>>>);

impl Outbox {
    /// Queues `answer` once the outbox has room.
    async fn send(&self, answer: ProcessingResponse) {
        let mut answer = Some(answer);
        std::future::poll_fn(|_| {
            let mut queue = self.0.lock();
            if queue.len() >= OUTBOX_ANSWERS {
                // The response stream polls the work again once it took one.
                return Poll::Pending;
            }
            queue.extend(answer.take());
            Poll::Ready(())
        })
        .await
    }

    /// The oldest answer queued.
    fn pop(&self) -> Option<ProcessingResponse> {
        self.0.lock().pop_front()
    }
}

/// One stream's responses, and the work that produces them. The work runs when
/// the server polls the response stream (in the server's own task for that
/// stream), so it is owned: it ends when the stream does, and dropping the
/// stream (Envoy gone, shutdown) drops it. A panic in the work is caught,
/// logged and counted, and ends only this stream, with an INTERNAL status
/// after the answers already sent.
struct Contained {
    work: Option<Pin<Box<dyn Future<Output = std::thread::Result<()>> + Send>>>,
    answers: Outbox,
    failed: Option<Status>,
    metrics: Arc<ExtProcMetrics>,
}

impl Contained {
    fn new(
        metrics: Arc<ExtProcMetrics>,
        answers: Outbox,
        work: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        metrics.streams.inc();
        let work = AssertUnwindSafe(work.instrument(tracing::debug_span!("ext_proc")));
        Contained {
            work: Some(Box::pin(work.catch_unwind())),
            answers,
            failed: None,
            metrics,
        }
    }
}

impl Stream for Contained {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(answer) = self.answers.pop() {
            return Poll::Ready(Some(Ok(answer)));
        }
        if let Some(work) = self.work.as_mut() {
            if let Poll::Ready(done) = work.as_mut().poll(cx) {
                // The work is over: the answers end after what it queued.
                self.work = None;
                if let Err(panic) = done {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    error!(panic = %what, "ext_proc stream panicked");
                    self.metrics.stream_panics.inc();
                    self.failed = Some(Status::internal("kvpick: internal error on this stream"));
                }
            }
        }
        match self.answers.pop() {
            Some(answer) => Poll::Ready(Some(Ok(answer))),
            // The work waits on Envoy, a timer or a hand-off, which wake this task.
            None if self.work.is_some() => Poll::Pending,
            None => Poll::Ready(self.failed.take().map(Err)),
        }
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        self.metrics.streams.dec();
    }
}

async fn run_stream(
    shared: Arc<Shared>,
    heavy: Arc<Semaphore>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: Outbox,
) {
    let body_wait = shared.config.body_wait;
    // Boxed: the stream's future stays small, so spawning and polling it moves
    // a pointer rather than the whole state.
    let mut state = Box::new(StreamState::new(shared));
    loop {
        // Wait for Envoy, but no longer than the mode-inference wait or the
        // body deadline, whichever comes first.
        let infer = state
            .waiting_to_infer_mode()
            .then(|| tokio::time::Instant::now() + body_wait);
        let deadline = state.body_deadline().map(tokio::time::Instant::from_std);
        let wake = match (infer, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let next = match wake {
            None => inbound.next().await,
            Some(at) => match tokio::time::timeout_at(at, inbound.next()).await {
                Ok(next) => next,
                Err(_) => {
                    let out = if deadline.is_some_and(|d| d <= at) {
                        state.body_deadline_expired()
                    } else {
                        state.body_wait_expired()
                    };
                    send_answers(&tx, &mut state, out).await;
                    if state.is_done() {
                        return linger(&mut inbound).await;
                    }
                    continue;
                }
            },
        };
        let msg = match next {
            Some(Ok(msg)) => msg,
            Some(Err(status)) => {
                tracing::debug!(%status, "ext_proc stream error from Envoy");
                return;
            }
            None => return,
        };
        let out = if state.completes_body_of_at_least(&msg, BLOCKING_BODY_BYTES) {
            match handle_blocking(&heavy, state, msg).await {
                Some((back, out)) => {
                    state = back;
                    out
                }
                None => return,
            }
        } else {
            state.handle(msg)
        };
        send_answers(&tx, &mut state, out).await;
        // A complete text body waits for its token ids (off the async threads).
        // The rare waits (tokenizing, image fetches, flow control) are boxed so
        // the stream's own future stays small for every request.
        if let Some(job) = state.take_tokenize_job() {
            let tokens = Box::pin(job.run()).await;
            let out = state.tokenized(tokens);
            send_answers(&tx, &mut state, out).await;
        }
        if let Some(ticket) = state.take_ticket() {
            if !Box::pin(wait_admission(ticket, &mut state, &mut inbound, &tx)).await {
                return;
            }
        }
        if state.is_done() {
            return linger(&mut inbound).await;
        }
    }
}

/// How long a finished stream waits for Envoy to close its side.
const LINGER: Duration = Duration::from_secs(1);

/// After the last answer, waits (at most [`LINGER`]) for Envoy to close its
/// side before the response stream ends. Ending first makes HTTP/2 reset the
/// request stream, and Envoy's closing frame then lands on a reset stream: the
/// server counts that as a client error and closes the whole connection
/// (GOAWAY `too_many_internal_resets`) after enough of them.
pub async fn linger(inbound: &mut Streaming<ProcessingRequest>) {
    let closed = async { while let Some(Ok(_)) = inbound.next().await {} };
    let _ = tokio::time::timeout(LINGER, closed).await;
}

/// Request bodies from this size on are parsed, hashed and routed on the
/// blocking pool, so they never hold an async worker (other streams, health
/// checks) for the milliseconds that takes. Below it that work (~0.45 ms at
/// 220 KiB) costs less than the hand-off's thread switches would add to it.
pub const BLOCKING_BODY_BYTES: usize = 256 << 10;

/// [`StreamState::handle`] on the blocking pool, once one of `heavy`'s permits
/// is free; the state comes back with the answers. A panic there resumes here
/// (the stream's containment catches it); `None` when the runtime is shutting
/// down.
async fn handle_blocking(
    heavy: &Semaphore,
    mut state: Box<StreamState>,
    msg: ProcessingRequest,
) -> Option<(Box<StreamState>, Vec<ProcessingResponse>)> {
    let _permit = heavy.acquire().await.ok()?;
    let handled = tokio::task::spawn_blocking(move || {
        let out = state.handle(msg);
        (state, out)
    })
    .await;
    match handled {
        Ok(done) => Some(done),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// Holds the stream's answer while its body waits in a flow-control queue. Envoy
/// messages arriving meanwhile are handled after the verdict; if the stream goes
/// away first, dropping the ticket takes the request out of its queue at once.
/// False when Envoy ended its side meanwhile.
async fn wait_admission(
    mut ticket: Ticket,
    state: &mut StreamState,
    inbound: &mut Streaming<ProcessingRequest>,
    tx: &Outbox,
) -> bool {
    let mut held = Vec::new();
    let verdict = loop {
        tokio::select! {
            verdict = ticket.wait() => break verdict,
            next = inbound.next() => match next {
                Some(Ok(msg)) => held.push(msg),
                _ => return false,
            },
        }
    };
    drop(ticket);
    let out = state.admitted(verdict);
    send_answers(tx, state, out).await;
    for msg in held {
        let out = state.handle(msg);
        send_answers(tx, state, out).await;
    }
    true
}

/// Sends `out`, then the body the stream streams back, chunk by chunk (so the
/// body is never copied whole into the outbox).
async fn send_answers(tx: &Outbox, state: &mut StreamState, out: Vec<ProcessingResponse>) {
    for msg in out {
        tx.send(msg).await;
    }
    while let Some(msg) = state.next_echo() {
        tx.send(msg).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_request, processing_response, HttpBody, HttpHeaders, ProtocolConfiguration,
    };

    fn full_duplex_headers() -> ProcessingRequest {
        let headers = [(":method", "POST"), (":path", "/v1/completions")]
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect();
        ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
                ..Default::default()
            })),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: BodySendMode::FullDuplexStreamed as i32,
                response_body_mode: BodySendMode::FullDuplexStreamed as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn chunk(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: bytes.to_vec(),
                end_of_stream,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn only_the_chunk_ending_a_large_body_goes_to_the_blocking_pool() {
        let app = crate::server::App::new("t");
        app.endpoints.replace(vec![crate::endpoints::Endpoint::new(
            "10.0.0.1:8000".parse().unwrap(),
        )]);
        let service = app.ext_proc(ExtProcConfig::default());
        let prompt = "x".repeat(BLOCKING_BODY_BYTES);
        let body = format!(r#"{{"model":"m","prompt":"{prompt}"}}"#).into_bytes();
        let (head, tail) = body.split_at(body.len() / 2);

        let mut state = Box::new(StreamState::new(Arc::clone(&service.shared)));
        let headers = full_duplex_headers();
        assert!(!state.completes_body_of_at_least(&headers, BLOCKING_BODY_BYTES));
        assert!(state.handle(headers).is_empty());
        let first = chunk(head, false);
        assert!(!state.completes_body_of_at_least(&first, BLOCKING_BODY_BYTES));
        assert!(state.handle(first).is_empty());
        let last = chunk(tail, true);
        assert!(state.completes_body_of_at_least(&last, BLOCKING_BODY_BYTES));
        let (state, out) = handle_blocking(&Semaphore::new(1), state, last)
            .await
            .unwrap();
        assert!(matches!(
            out[0].response,
            Some(processing_response::Response::RequestHeaders(_))
        ));
        assert!(!state.is_done());

        // A small body ends on the async thread.
        let mut small = StreamState::new(Arc::clone(&service.shared));
        small.handle(full_duplex_headers());
        let whole = chunk(br#"{"model":"m","prompt":"hi"}"#, true);
        assert!(!small.completes_body_of_at_least(&whole, BLOCKING_BODY_BYTES));

        // So does a 220 KiB one (the overhead bench's large chat body): handing
        // it off costs more than its parse, hash and pick.
        let mut mid = StreamState::new(Arc::clone(&service.shared));
        mid.handle(full_duplex_headers());
        let prompt = "x".repeat(220 << 10);
        let body = format!(r#"{{"model":"m","prompt":"{prompt}"}}"#).into_bytes();
        assert!(!mid.completes_body_of_at_least(&chunk(&body, true), BLOCKING_BODY_BYTES));
    }

    #[tokio::test]
    async fn a_panicking_stream_ends_with_internal_and_others_go_on() {
        let metrics = Arc::new(ExtProcMetrics::default());
        let tx = Outbox::default();
        let mut failing = Contained::new(Arc::clone(&metrics), tx.clone(), async move {
            tx.send(ProcessingResponse::default()).await;
            panic!("boom")
        });
        assert_eq!(metrics.streams.get(), 1);
        // What was answered before the panic goes out first, then INTERNAL.
        assert!(failing.next().await.unwrap().is_ok());
        let status = failing.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(failing.next().await.is_none());
        // Another stream still runs and answers normally.
        let tx2 = Outbox::default();
        let mut fine = Contained::new(Arc::clone(&metrics), tx2.clone(), async move {
            tx2.send(ProcessingResponse::default()).await;
        });
        assert!(fine.next().await.unwrap().is_ok());
        assert!(fine.next().await.is_none());
        assert_eq!(metrics.stream_panics.get(), 1);
        drop((failing, fine));
        assert_eq!(metrics.streams.get(), 0);
    }

    #[tokio::test]
    async fn dropping_the_response_stream_drops_its_work() {
        let metrics = Arc::new(ExtProcMetrics::default());
        let tx = Outbox::default();
        let (alive, mut gone) = tokio::sync::mpsc::channel::<()>(1);
        let mut stream = Contained::new(Arc::clone(&metrics), tx.clone(), async move {
            let _alive = alive;
            tx.send(ProcessingResponse::default()).await;
            std::future::pending::<()>().await
        });
        assert!(stream.next().await.unwrap().is_ok());
        drop(stream);
        assert!(gone.recv().await.is_none(), "the work outlived its stream");
        assert_eq!(metrics.streams.get(), 0);
    }

    /// `f`, or a panic if it stalls.
    async fn within<F: Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(5), f)
            .await
            .expect("stalled")
    }

    #[tokio::test]
    async fn a_full_outbox_holds_the_work_until_its_answers_are_taken() {
        let metrics = Arc::new(ExtProcMetrics::default());
        let outbox = Outbox::default();
        let tx = outbox.clone();
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let chunk = |i: u8| messages::streamed_body(&[i], false, false).remove(0);
        let mut stream = Contained::new(Arc::clone(&metrics), outbox.clone(), async move {
            for i in 0..40 {
                tx.send(chunk(i)).await;
            }
            // Then a wait only a waker outside the outbox ends.
            let _ = wait.await;
            tx.send(chunk(40)).await;
        });
        for i in 0..40 {
            let answer = within(stream.next()).await.unwrap().unwrap();
            assert_eq!(answer, chunk(i), "answers in order");
            assert!(outbox.0.lock().len() < OUTBOX_ANSWERS, "bounded");
        }
        let last = tokio::spawn(async move { stream.next().await.map(Result::unwrap) });
        tokio::task::yield_now().await;
        go.send(()).unwrap();
        assert_eq!(within(last).await.unwrap(), Some(chunk(40)));
    }
}
