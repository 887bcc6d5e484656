//! What the integration tests share (each test crate includes this with
//! `mod support;`): a kvpick ext_proc server on loopback, the Envoy side of its
//! streams ([`envoy_client`]) failing the test on errors, and the pieces for
//! running the built binary.

use std::time::Duration;

use envoy_client::message::RequestHeaders;
use envoy_client::{
    Answer, BodyMode, Changes, Decision, EnvoyStream, Immediate, Phase, RequestBody,
    ResponseOutcome, Routed,
};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// How long a test waits for each answer (Envoy's `message_timeout`).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `app`'s ext_proc service on a loopback port (until the test ends)
/// and returns the port.
pub async fn serve(app: &App, config: ExtProcConfig) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(listener, app.ext_proc(config), None));
    port
}

/// A plaintext gRPC channel to `port`.
pub async fn channel(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Opens a stream with JSON POST request headers for `path` (not ending it).
pub async fn post(
    ch: &Channel,
    path: &str,
    extra: &[(&str, &str)],
    mode: Option<BodyMode>,
    metadata: Option<Metadata>,
) -> EnvoyStream {
    let mut h = RequestHeaders::post(path).headers(extra);
    if let Some(m) = mode {
        h = h.mode(m);
    }
    if let Some(md) = metadata {
        h = h.metadata(md);
    }
    EnvoyStream::open(ch, h.build(), ANSWER_TIMEOUT)
        .await
        .unwrap()
}

/// Sends a chat request in full-duplex mode (the body in 16 KiB chunks without
/// waiting, as Envoy streams it); returns the stream and its routing, which it
/// must be.
pub async fn routed_chat(
    ch: &Channel,
    body: &[u8],
    extra: &[(&str, &str)],
    metadata: Option<Metadata>,
) -> (EnvoyStream, Routed) {
    let mut s = post(
        ch,
        "/v1/chat/completions",
        extra,
        Some(BodyMode::FullDuplex),
        metadata,
    )
    .await;
    let whole = RequestBody::Whole {
        bytes: body,
        chunk: 16 * 1024,
    };
    match s.decide(BodyMode::FullDuplex, whole).await.unwrap() {
        Decision::Routed(r) => (s, r),
        Decision::Immediate(i) => panic!("expected a routed request, got {i:?}"),
    }
}

/// The next answer's changes, which must be for `phase`.
pub async fn changes(s: &mut EnvoyStream, phase: Phase) -> Changes {
    match s.phase(phase).await.unwrap() {
        Ok(c) => c,
        Err(i) => panic!("expected a {} answer, got {i:?}", phase.name()),
    }
}

/// The next answer, which must be an immediate response, and its JSON body.
pub async fn immediate(s: &mut EnvoyStream) -> (Immediate, serde_json::Value) {
    match s.answer().await.unwrap() {
        Answer::Immediate(i) => {
            let json = serde_json::from_slice(&i.body).expect("error body is JSON");
            (i, json)
        }
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

/// Opens an ext_proc stream and has its request headers (a `GET`, no body) routed.
pub async fn open_routed_stream(ch: &Channel) -> EnvoyStream {
    let get = RequestHeaders::get("/v1/models").build();
    let mut s = EnvoyStream::open(ch, get, ANSWER_TIMEOUT).await.unwrap();
    changes(&mut s, Phase::RequestHeaders).await;
    s
}

/// Sends the response headers (no body), expects their answer, and checks that
/// the stream then ends cleanly.
pub async fn finish_stream(mut s: EnvoyStream) {
    let outcome = s
        .respond(BodyMode::FullDuplex, "200", &[], None, 0)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ResponseOutcome::Forwarded { .. }),
        "response headers answered: {outcome:?}"
    );
    s.finish().await.unwrap();
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
