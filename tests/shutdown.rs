//! Draining on shutdown: an open ext_proc stream completes, new connections are
//! refused, and the server returns once the stream is done.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpHeaders, ProcessingRequest,
};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc_until, App};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

fn headers(pairs: &[(&str, &str)]) -> ProcessingRequest {
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

#[tokio::test]
async fn shutdown_refuses_new_connections_and_lets_the_open_stream_finish() {
    let app = App::new("t");
    app.endpoints
        .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve_ext_proc_until(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
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
    // Mid-stream (the response path is still to come): shut down.
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "a new connection was accepted while draining"
    );
    assert!(
        !server.is_finished(),
        "the server stopped before the stream ended"
    );
    tx.send(headers(&[(":status", "200")])).await.unwrap();
    assert!(
        answers.next().await.unwrap().is_ok(),
        "response headers answered"
    );
    drop(tx);
    assert!(answers.next().await.is_none());
    let done = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
}
