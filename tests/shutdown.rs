//! Draining on shutdown: an open ext_proc stream completes, new connections are
//! refused, and the server returns once the stream is done; in process, and with
//! the built `kvpick` binary receiving SIGTERM.

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

type Answers = tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>;

/// Opens an ext_proc stream and has its request headers routed.
async fn open_routed_stream(
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
async fn finish_stream(tx: mpsc::Sender<ProcessingRequest>, mut answers: Answers) {
    tx.send(headers(&[(":status", "200")])).await.unwrap();
    assert!(
        answers.next().await.unwrap().is_ok(),
        "response headers answered"
    );
    drop(tx);
    assert!(answers.next().await.is_none());
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
    let (tx, answers) = open_routed_stream(&mut client).await;
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
    finish_stream(tx, answers).await;
    let done = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
}

/// A free local port (bound and released; the binary binds it again).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the child if the test fails before it exits.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_drains_on_sigterm_and_exits_zero_before_the_deadline() {
    let dir = std::env::temp_dir().join(format!("kvpick-sigterm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(&endpoints, "endpoints:\n  - address: 127.0.0.1:9\n").unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let drain = Duration::from_secs(20);
    let mut child = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"))
            .arg("--endpoints-file")
            .arg(&endpoints)
            .args([
                "--bind-address=127.0.0.1",
                "--secure-serving=false",
                "--kv-events=false",
                &format!("--grpc-port={grpc}"),
                &format!("--grpc-health-port={health}"),
                &format!("--metrics-port={metrics}"),
                &format!("--drain-timeout-ms={}", drain.as_millis()),
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = format!("http://127.0.0.1:{grpc}");
    let started = std::time::Instant::now();
    let mut client = loop {
        match ExternalProcessorClient::connect(addr.clone()).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "kvpick never listened: {e}"
                );
                assert!(child.0.try_wait().unwrap().is_none(), "kvpick exited early");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let (tx, answers) = open_routed_stream(&mut client).await;

    // Mid-stream: SIGTERM.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let signalled = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        TcpStream::connect(("127.0.0.1", grpc)).await.is_err(),
        "a new connection was accepted while draining"
    );
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "kvpick exited with a stream still open"
    );
    finish_stream(tx, answers).await;
    let exit = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            signalled.elapsed() < drain,
            "kvpick still running at the drain deadline"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
