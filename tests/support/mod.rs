//! Envoy-side ext_proc messages and streams, and the pieces for running the
//! built binary, shared by the integration tests (each test crate includes
//! this with `mod support;`).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// Headers with end of stream: response headers when the first pair is
/// `:status`, else request headers.
pub fn headers(pairs: &[(&str, &str)]) -> ProcessingRequest {
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream: true,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(if pairs[0].0 == ":status" {
            Request::ResponseHeaders(headers)
        } else {
            Request::RequestHeaders(headers)
        }),
        ..Default::default()
    }
}

/// The answers of one ext_proc stream.
pub type Answers = tonic::Streaming<ProcessingResponse>;

/// Opens an ext_proc stream and has its request headers routed.
pub async fn open_routed_stream(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
) -> (mpsc::Sender<ProcessingRequest>, Answers) {
    let (tx, rx) = mpsc::channel(4);
    let mut answers = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(headers(&[(":method", "GET"), (":path", "/v1/models")]))
        .await
        .unwrap();
    assert!(answers.next().await.unwrap().is_ok(), "routed");
    (tx, answers)
}

/// Sends the response headers, expects their answer, and closes the stream.
pub async fn finish_stream(tx: mpsc::Sender<ProcessingRequest>, mut answers: Answers) {
    tx.send(headers(&[(":status", "200")])).await.unwrap();
    assert!(
        answers.next().await.unwrap().is_ok(),
        "response headers answered"
    );
    drop(tx);
    assert!(answers.next().await.is_none());
}

/// A free local port (bound and released; the binary binds it again).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the child if the test fails before it exits.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
