//! The Envoy-like client against a processor that sends its gRPC response
//! headers only with its first answer, after the whole request body (as Go's
//! gRPC server does for an ext_proc server that buffers the body): the client
//! must send the body without waiting for those headers, as Envoy does.

use std::pin::Pin;
use std::time::Duration;

use envoy_client::message::{body_chunks, RequestHeaders};
use envoy_client::{BodyMode, EnvoyStream, Phase};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HeaderMutation, ProcessingRequest, ProcessingResponse,
};
use futures::{Stream, StreamExt};
use kvpick::extproc::messages;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

const ENDPOINT: &str = "127.0.0.1:9";

/// Reads the request up to the body's end before it returns its response
/// (so before gRPC sends response headers), then routes to [`ENDPOINT`].
struct AnswersAfterTheBody;

type Out = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for AnswersAfterTheBody {
    type ProcessStream = Out;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = request.into_inner();
        while let Some(msg) = inbound.next().await {
            if let Some(processing_request::Request::RequestBody(b)) = msg?.request {
                if b.end_of_stream {
                    break;
                }
            }
        }
        let mutation = HeaderMutation {
            set_headers: vec![messages::set_header(messages::DESTINATION_KEY, ENDPOINT)],
            ..Default::default()
        };
        let headers = messages::request_headers(messages::common(Some(mutation), true), None);
        Ok(Response::new(Box::pin(futures::stream::iter([Ok(
            headers,
        )]))))
    }
}

#[tokio::test]
async fn the_body_goes_out_before_the_processor_sends_response_headers() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(
        Server::builder()
            .add_service(ExternalProcessorServer::new(AnswersAfterTheBody))
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let ch = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let body = vec![b'x'; 100_000];
    let headers = RequestHeaders::post("/v1/completions")
        .content_length(body.len())
        .mode(BodyMode::FullDuplex)
        .build();
    let mut s = EnvoyStream::open(&ch, headers, Duration::from_secs(5))
        .await
        .unwrap();
    s.send_all(body_chunks(&body, 16 * 1024, false))
        .await
        .unwrap();
    let changes = s.phase(Phase::RequestHeaders).await.unwrap().unwrap();
    assert_eq!(changes.destination(), Some(ENDPOINT));
    server.abort();
}
