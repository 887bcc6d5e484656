//! The load generator's side of one ext_proc request: a channel to the server
//! and one Envoy-style chat request driven to its end (headers, the body in
//! full duplex, the response path), timed from the last body chunk to the
//! headers answer. Shared by the overhead, agreement and peer benches.

use std::time::{Duration, Instant};

use anyhow::bail;
use envoy_client::message::{body_chunks, RequestHeaders};
use envoy_client::{BodyMode, EnvoyStream, Phase, ResponseOutcome};
use tonic::transport::Channel;

use super::SplitMix64;

/// Body chunk size the load generator sends (Envoy forwards reads of about this size).
pub const CHUNK: usize = 16 * 1024;

/// An OpenAI chat body of about `bytes` bytes. Bodies with different `variant`
/// share their first half (a common system prompt) and differ after it.
pub fn chat_body(bytes: usize, variant: u64) -> Vec<u8> {
    let words = |seed: u64, n: usize| {
        let mut g = SplitMix64::new(seed);
        let mut s = String::with_capacity(n + 16);
        while s.len() < n {
            s.push_str(&format!("w{} ", g.below(50_000)));
        }
        s
    };
    let half = bytes.saturating_sub(120) / 2;
    let body = serde_json::json!({
        "model": "llama",
        "messages": [
            {"role": "system", "content": words(1, half)},
            {"role": "user", "content": words(1_000 + variant, half)},
        ],
        "stream": true
    });
    serde_json::to_vec(&body).expect("a JSON value serialises")
}

/// How long the load generator waits for each answer (a large body under load
/// takes seconds; this only keeps a stuck server from hanging the run).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs one Envoy-style chat request to completion; returns the decision latency.
pub async fn one_request(ch: &Channel, body: &[u8]) -> anyhow::Result<Duration> {
    one_request_to(ch, "/v1/chat/completions", body).await
}

/// [`one_request`] to `path`.
pub async fn one_request_to(ch: &Channel, path: &str, body: &[u8]) -> anyhow::Result<Duration> {
    Ok(routed_request_to(ch, path, body).await?.0)
}

/// [`one_request`], also returning the destination the server chose (its
/// `x-gateway-destination-endpoint`, header or dynamic metadata).
pub async fn routed_request(
    ch: &Channel,
    body: &[u8],
) -> anyhow::Result<(Duration, Option<String>)> {
    routed_request_to(ch, "/v1/chat/completions", body).await
}

/// [`routed_request`] to `path`.
pub async fn routed_request_to(
    ch: &Channel,
    path: &str,
    body: &[u8],
) -> anyhow::Result<(Duration, Option<String>)> {
    // Request headers as Envoy forwards them (with the client's `content-length`).
    let headers = RequestHeaders::post(path)
        .content_length(body.len())
        .mode(BodyMode::FullDuplex)
        .build();
    let mut s = EnvoyStream::open(ch, headers, ANSWER_TIMEOUT).await?;
    s.send_all(body_chunks(body, CHUNK, false)).await?;
    let sent = Instant::now();
    let mut changes = match s.phase(Phase::RequestHeaders).await? {
        Ok(c) => c,
        Err(i) => bail!("expected the headers answer first, got {i:?}"),
    };
    let latency = sent.elapsed();
    let destination = changes.destination().map(str::to_string);
    if let Err(i) = s
        .streamed_body(Phase::RequestBody, &mut changes, &mut Vec::new())
        .await?
    {
        bail!("expected the body streamed back, got {i:?}");
    }
    let sse = b"data: [DONE]\n\n";
    match s
        .respond(BodyMode::FullDuplex, "200", &[], Some(sse), CHUNK)
        .await?
    {
        ResponseOutcome::Forwarded { .. } => {}
        ResponseOutcome::Immediate(i) => bail!("the response path ended with {i:?}"),
    }
    s.finish().await?;
    Ok((latency, destination))
}

/// An HTTP/2 channel to the ext_proc server on 127.0.0.1:`port`, as the load
/// generator opens them (`TCP_NODELAY`).
pub async fn connect(port: u16) -> anyhow::Result<Channel> {
    let endpoint = Channel::from_shared(format!("http://127.0.0.1:{port}"))?;
    Ok(endpoint.tcp_nodelay(true).connect().await?)
}
