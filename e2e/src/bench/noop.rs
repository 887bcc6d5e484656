//! A no-op ext_proc server: the baseline of the overhead benchmark.
//!
//! It speaks the same FULL_DUPLEX_STREAMED protocol on the same tonic stack as
//! kvpick (same message builders, same HTTP/2 stream limit, TCP_NODELAY) but does no parsing
//! and no scheduling: it collects the body, answers the held headers with a fixed
//! endpoint, streams the body back chunk by chunk, and passes the response path through.

use std::pin::Pin;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HeaderMutation, ProcessingRequest, ProcessingResponse,
};
use futures::{Stream, StreamExt};
use kvpick::extproc::messages;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};

/// The fixed endpoint the no-op server routes every request to.
pub const NOOP_ENDPOINT: &str = "10.0.0.1:8000";

/// The no-op ext_proc service.
#[derive(Debug, Clone, Copy, Default)]
pub struct Noop;

type Out = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Noop {
    type ProcessStream = Out;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut body = Vec::new();
            while let Some(Ok(msg)) = inbound.next().await {
                let out = match msg.request {
                    Some(processing_request::Request::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if !b.end_of_stream {
                            continue;
                        }
                        let mutation = HeaderMutation {
                            set_headers: vec![messages::set_header(
                                messages::DESTINATION_KEY,
                                NOOP_ENDPOINT,
                            )],
                            ..Default::default()
                        };
                        let headers = messages::request_headers(
                            messages::common(Some(mutation), true),
                            Some(messages::destination_metadata(NOOP_ENDPOINT)),
                        );
                        // The body goes back chunk by chunk, as kvpick sends it.
                        let echo = messages::Echo::new(std::mem::take(&mut body), true);
                        let mut sent = true;
                        for m in std::iter::once(headers).chain(echo) {
                            sent = sent && tx.send(Ok(m)).await.is_ok();
                        }
                        if !sent {
                            return;
                        }
                        Vec::new()
                    }
                    Some(processing_request::Request::ResponseHeaders(_)) => {
                        vec![messages::response_headers(None)]
                    }
                    Some(processing_request::Request::ResponseBody(b)) => {
                        let done = b.end_of_stream;
                        let out = messages::streamed_body(&b.body, b.end_of_stream, true);
                        if done {
                            for m in out {
                                let _ = tx.send(Ok(m)).await;
                            }
                            // As kvpick: let Envoy close its side first.
                            return kvpick::extproc::linger(&mut inbound).await;
                        }
                        out
                    }
                    _ => Vec::new(),
                };
                for m in out {
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the no-op ext_proc on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .max_concurrent_streams(Some(100_000))
        .add_service(ExternalProcessorServer::new(Noop))
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await
}
