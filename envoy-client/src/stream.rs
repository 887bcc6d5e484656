//! One ext_proc stream driven the way Envoy drives it.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Streaming;

use crate::answer::{Answer, BodyChange, Changes, Decision, Immediate, Phase, Routed};
use crate::message::{body_chunks, pieces, request_body, response_body, response_headers};
use crate::{BodyMode, ClientError};

/// Messages queued towards the processor before the transport takes them.
const QUEUE: usize = 64;

/// The processor's side of a stream: its answers, each awaited at most
/// Envoy's `message_timeout`.
pub struct Answers {
    incoming: Incoming,
    timeout: Duration,
}

/// The answer stream, or the call still waiting for the processor's response
/// headers (a gRPC server may hold them back until its first answer, which an
/// ext_proc server sends only after the body: Envoy sends the body meanwhile).
enum Incoming {
    Waiting(JoinHandle<Result<tonic::Response<Streaming<ProcessingResponse>>, tonic::Status>>),
    Open(Box<Streaming<ProcessingResponse>>),
}

impl Drop for Answers {
    fn drop(&mut self) {
        if let Incoming::Waiting(call) = &self.incoming {
            call.abort();
        }
    }
}

impl Answers {
    /// The next message of the stream, once the call has its response headers.
    async fn next(&mut self) -> Option<Result<ProcessingResponse, tonic::Status>> {
        if let Incoming::Waiting(call) = &mut self.incoming {
            match call.await {
                Ok(Ok(response)) => self.incoming = Incoming::Open(Box::new(response.into_inner())),
                Ok(Err(status)) => return Some(Err(status)),
                Err(_) => return None,
            }
        }
        match &mut self.incoming {
            Incoming::Open(rx) => rx.next().await,
            Incoming::Waiting(_) => None,
        }
    }

    /// The next message.
    pub async fn recv(&mut self) -> Result<ProcessingResponse, ClientError> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.next()).await {
            Err(_) => Err(ClientError::Timeout(timeout)),
            Ok(None) => Err(ClientError::Closed),
            Ok(Some(Err(status))) => Err(status.into()),
            Ok(Some(Ok(msg))) => Ok(msg),
        }
    }

    /// The next message, typed.
    pub async fn answer(&mut self) -> Result<Answer, ClientError> {
        Answer::of(self.recv().await?).ok_or(ClientError::Unexpected {
            expected: "non-empty",
            got: "an empty response".into(),
        })
    }

    /// Nothing arrives within `wait`.
    pub async fn silent_for(&mut self, wait: Duration) -> bool {
        tokio::time::timeout(wait, self.next()).await.is_err()
    }

    /// The next answer, for `phase` or immediate.
    pub async fn phase(&mut self, phase: Phase) -> Result<Result<Changes, Immediate>, ClientError> {
        self.answer().await?.expect(phase)
    }

    /// Full duplex: the body streamed back in `phase` answers up to its end;
    /// their other changes merged into `changes`, the chunk sizes in `sizes`.
    pub async fn streamed_body(
        &mut self,
        phase: Phase,
        changes: &mut Changes,
        sizes: &mut Vec<usize>,
    ) -> Result<Result<Vec<u8>, Immediate>, ClientError> {
        let mut out = Vec::new();
        loop {
            let mut c = match self.phase(phase).await? {
                Ok(c) => c,
                Err(i) => return Ok(Err(i)),
            };
            let BodyChange::Streamed {
                body,
                end_of_stream,
            } = std::mem::take(&mut c.body)
            else {
                return Err(ClientError::Unexpected {
                    expected: "streamed body",
                    got: format!("{:?}", c.body),
                });
            };
            changes.merge(c);
            sizes.push(body.len());
            out.extend_from_slice(&body);
            if end_of_stream {
                return Ok(Ok(out));
            }
        }
    }
}

/// How the request body reaches the processor in [`EnvoyStream::decide`].
#[derive(Debug, Clone, Copy)]
pub enum RequestBody<'a> {
    /// The request has no body (its headers ended the stream).
    None,
    /// The whole body, sent in chunks of at most `chunk` bytes.
    Whole {
        /// The body.
        bytes: &'a [u8],
        /// Largest chunk.
        chunk: usize,
    },
    /// Full duplex only: the caller streams it through [`EnvoyStream::sender`].
    Pumped,
}

/// What the response path did.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseOutcome {
    /// The response goes to the client with these changes and this body.
    Forwarded {
        /// Every response-path answer's changes, merged.
        changes: Changes,
        /// The body the client gets.
        body: Vec<u8>,
    },
    /// The processor answered the client itself.
    Immediate(Immediate),
}

/// One ext_proc stream as Envoy opens it. Dereferences to its [`Answers`].
pub struct EnvoyStream {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    answers: Answers,
}

impl Deref for EnvoyStream {
    type Target = Answers;
    fn deref(&self) -> &Answers {
        &self.answers
    }
}

impl DerefMut for EnvoyStream {
    fn deref_mut(&mut self) -> &mut Answers {
        &mut self.answers
    }
}

impl EnvoyStream {
    /// Opens a stream on `ch` whose first message is `headers` (see
    /// [`crate::message::RequestHeaders`]); answers are awaited at most `timeout`.
    /// As Envoy, it does not wait for the processor's response headers before
    /// sending more: the call runs on its own task until they come.
    pub async fn open(
        ch: &Channel,
        headers: ProcessingRequest,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let (tx, rx) = mpsc::channel(QUEUE);
        tx.send(headers).await.map_err(|_| ClientError::Closed)?;
        let mut client = ExternalProcessorClient::new(ch.clone());
        let call = tokio::spawn(async move { client.process(ReceiverStream::new(rx)).await });
        Ok(EnvoyStream {
            tx: Some(tx),
            answers: Answers {
                incoming: Incoming::Waiting(call),
                timeout,
            },
        })
    }

    /// A sender of further messages (`None` once closed), for pumping a body
    /// while the answers are read.
    pub fn sender(&self) -> Option<mpsc::Sender<ProcessingRequest>> {
        self.tx.clone()
    }

    /// Sends one message.
    pub async fn send(&self, msg: ProcessingRequest) -> Result<(), ClientError> {
        let tx = self.tx.as_ref().ok_or(ClientError::Closed)?;
        tx.send(msg).await.map_err(|_| ClientError::Closed)
    }

    /// Sends messages in order without waiting for answers.
    pub async fn send_all(
        &self,
        msgs: impl IntoIterator<Item = ProcessingRequest>,
    ) -> Result<(), ClientError> {
        for m in msgs {
            self.send(m).await?;
        }
        Ok(())
    }

    /// Ends Envoy's side of the stream (answers can still arrive).
    pub fn close(&mut self) {
        self.tx = None;
    }

    /// Ends the stream as Envoy does once the response is through: closes Envoy's
    /// side and reads the answers to their end (the gRPC status). Dropping a
    /// stream whose answers are still open makes HTTP/2 reset it, and the
    /// server's closing frames then land on a reset stream, which the client's
    /// HTTP/2 counts against its per-connection limit of locally reset streams
    /// (a GOAWAY `too_many_internal_resets` after 1,024). An answer arriving
    /// instead of the end is an error.
    pub async fn finish(mut self) -> Result<(), ClientError> {
        self.close();
        match self.answers.recv().await {
            Err(ClientError::Closed) => Ok(()),
            Err(e) => Err(e),
            Ok(msg) => Err(ClientError::Unexpected {
                expected: "the end of the stream",
                got: format!("{msg:?}"),
            }),
        }
    }

    /// The sending half (if open) and the answers, apart.
    pub fn into_parts(self) -> (Option<mpsc::Sender<ProcessingRequest>>, Answers) {
        (self.tx, self.answers)
    }

    /// Runs the request path after the headers went out: sends the body as
    /// `mode` does (full duplex: every chunk at once, then the held headers
    /// answer and the body streamed back; buffered: after the headers answer,
    /// the whole body and its answer; streamed: chunk by chunk, an answer
    /// each) and returns the decision.
    pub async fn decide(
        &mut self,
        mode: BodyMode,
        body: RequestBody<'_>,
    ) -> Result<Decision, ClientError> {
        if let (BodyMode::FullDuplex, RequestBody::Whole { bytes, chunk }) = (mode, body) {
            self.send_all(body_chunks(bytes, chunk, false)).await?;
        }
        let mut changes = match self.phase(Phase::RequestHeaders).await? {
            Ok(c) => c,
            Err(i) => return Ok(Decision::Immediate(i)),
        };
        let mut chunks = Vec::new();
        let body = match (mode, body) {
            (_, RequestBody::None) => None,
            (BodyMode::FullDuplex, _) => {
                match self
                    .streamed_body(Phase::RequestBody, &mut changes, &mut chunks)
                    .await?
                {
                    Ok(b) => Some(b),
                    Err(i) => return Ok(Decision::Immediate(i)),
                }
            }
            (BodyMode::Buffered, RequestBody::Whole { bytes, .. }) => {
                self.send(request_body(bytes, true)).await?;
                match self.phase(Phase::RequestBody).await? {
                    Ok(c) => {
                        let body = replaced(&c.body, None);
                        changes.merge(c);
                        body
                    }
                    Err(i) => return Ok(Decision::Immediate(i)),
                }
            }
            (BodyMode::Streamed, RequestBody::Whole { bytes, chunk }) => {
                let mut out = Vec::with_capacity(bytes.len());
                let mut changed = false;
                for (msg, piece) in body_chunks(bytes, chunk, false).zip(pieces(bytes, chunk)) {
                    self.send(msg).await?;
                    match self.phase(Phase::RequestBody).await? {
                        Ok(c) => {
                            let b = replaced(&c.body, None);
                            changed |= b.is_some();
                            out.extend_from_slice(b.as_deref().unwrap_or(piece));
                            changes.merge(c);
                        }
                        Err(i) => return Ok(Decision::Immediate(i)),
                    }
                }
                changed.then_some(out)
            }
            (_, RequestBody::Pumped) => {
                return Err(ClientError::Unexpected {
                    expected: "whole body (only full duplex pumps)",
                    got: format!("{mode:?}"),
                })
            }
        };
        changes.body = BodyChange::Unchanged;
        Ok(Decision::Routed(Routed {
            changes,
            body,
            chunks,
        }))
    }

    /// Runs the response path of an upstream response with `status`, `headers`
    /// and `body` (`None`: no body): sends it as `mode` does and returns what
    /// the client gets. Envoy's side of the stream is closed once it has sent
    /// its last message (full duplex) or has its last answer.
    pub async fn respond(
        &mut self,
        mode: BodyMode,
        status: &str,
        headers: &[(&str, &[u8])],
        body: Option<&[u8]>,
        chunk: usize,
    ) -> Result<ResponseOutcome, ClientError> {
        self.respond_with(mode, status, headers, body, chunk, None)
            .await
    }

    /// [`Self::respond`], the response headers carrying `metadata` in their
    /// `metadata_context` (as Envoy forwards `envoy.lb`'s served endpoint).
    pub async fn respond_with(
        &mut self,
        mode: BodyMode,
        status: &str,
        headers: &[(&str, &[u8])],
        body: Option<&[u8]>,
        chunk: usize,
        metadata: Option<Metadata>,
    ) -> Result<ResponseOutcome, ClientError> {
        let mut first = response_headers(status, headers, body.is_none());
        first.metadata_context = metadata;
        self.send(first).await?;
        let full_duplex = mode == BodyMode::FullDuplex;
        if let (true, Some(b)) = (full_duplex, body) {
            self.send_all(body_chunks(b, chunk, true)).await?;
        }
        if full_duplex || body.is_none() {
            self.close();
        }
        let mut changes = match self.phase(Phase::ResponseHeaders).await? {
            Ok(c) => c,
            Err(i) => return Ok(ResponseOutcome::Immediate(i)),
        };
        let Some(bytes) = body else {
            return Ok(ResponseOutcome::Forwarded {
                changes,
                body: Vec::new(),
            });
        };
        let out = match mode {
            BodyMode::FullDuplex => {
                match self
                    .streamed_body(Phase::ResponseBody, &mut changes, &mut Vec::new())
                    .await?
                {
                    Ok(b) => b,
                    Err(i) => return Ok(ResponseOutcome::Immediate(i)),
                }
            }
            BodyMode::Buffered => {
                self.send(response_body(bytes, true)).await?;
                match self.phase(Phase::ResponseBody).await? {
                    Ok(c) => {
                        let b = replaced(&c.body, Some(bytes)).unwrap_or_default();
                        changes.merge(c);
                        b
                    }
                    Err(i) => return Ok(ResponseOutcome::Immediate(i)),
                }
            }
            BodyMode::Streamed => {
                let mut out = Vec::with_capacity(bytes.len());
                for (msg, piece) in body_chunks(bytes, chunk, true).zip(pieces(bytes, chunk)) {
                    self.send(msg).await?;
                    match self.phase(Phase::ResponseBody).await? {
                        Ok(c) => {
                            out.extend_from_slice(
                                replaced(&c.body, Some(piece)).as_deref().unwrap_or(piece),
                            );
                            changes.merge(c);
                        }
                        Err(i) => return Ok(ResponseOutcome::Immediate(i)),
                    }
                }
                out
            }
        };
        self.close();
        changes.body = BodyChange::Unchanged;
        Ok(ResponseOutcome::Forwarded { changes, body: out })
    }
}

/// The body after a buffered answer's change: replaced or cleared, else
/// `unchanged` (`None` when the caller keeps its own).
fn replaced(change: &BodyChange, unchanged: Option<&[u8]>) -> Option<Vec<u8>> {
    match change {
        BodyChange::Replace(b) => Some(b.clone()),
        BodyChange::Clear => Some(Vec::new()),
        _ => unchanged.map(<[u8]>::to_vec),
    }
}
