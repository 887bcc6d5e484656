//! Draining on shutdown: an open ext_proc stream completes, new connections are
//! refused, and the server returns once the stream is done; in process, and with
//! the built `kvpick` binary receiving SIGTERM.

use std::time::Duration;

#[allow(dead_code)] // each test binary uses a part of it
mod support;

use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc_until, App};
use support::{finish_stream, free_port, open_routed_stream, Child};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tonic::transport::Channel;

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
    let ch = support::channel(addr.port()).await;
    let stream = open_routed_stream(&ch).await;
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
    finish_stream(stream).await;
    let done = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
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
    let ch = loop {
        match Channel::from_shared(addr.clone()).unwrap().connect().await {
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
    let stream = open_routed_stream(&ch).await;

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
    finish_stream(stream).await;
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
