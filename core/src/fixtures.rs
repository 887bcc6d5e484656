//! Builders for tests and benchmarks: endpoint tables, requests, scrapes.
//!
//! Compiled for the core's own tests and, behind the `fixtures` feature, for
//! the `kvpick` crate's and e2e's tests (their dev-dependencies enable it), so
//! each builder is written once. Addresses are `10.0.0.{i}:{port}`, `i` from 1.

use std::net::SocketAddr;
use std::time::Instant;

use crate::endpoints::{Endpoint, EndpointState, EndpointTable, Role, ScrapedLoad};
use crate::request::InferenceRequest;
use crate::scheduler::PickRequest;

/// `10.0.0.{i}:{port}`.
pub fn address(i: usize, port: u16) -> SocketAddr {
    format!("10.0.0.{i}:{port}")
        .parse()
        .expect("i is at most 255")
}

/// `n` endpoints (one rank, both roles) at `10.0.0.1..=n` on `port`.
pub fn endpoints(n: usize, port: u16) -> Vec<Endpoint> {
    (1..=n).map(|i| Endpoint::new(address(i, port))).collect()
}

/// A table holding `endpoints`.
pub fn table_of(endpoints: Vec<Endpoint>) -> EndpointTable {
    let t = EndpointTable::new();
    t.replace(endpoints);
    t
}

/// A table of `n` endpoints (see [`endpoints`]).
pub fn pool(n: usize, port: u16) -> EndpointTable {
    table_of(endpoints(n, port))
}

/// A table of `(address, dp size, role)` endpoints.
pub fn table(specs: &[(&str, u32, Role)]) -> EndpointTable {
    table_of(
        specs
            .iter()
            .map(|(a, dp, role)| Endpoint {
                dp_size: *dp,
                role: *role,
                ..Endpoint::new(a.parse().expect("an ip:port"))
            })
            .collect(),
    )
}

/// A parsed body.
pub fn parse(json: &str) -> InferenceRequest {
    crate::request::parse(json.as_bytes(), None).expect("a valid inference body")
}

/// A completions request of model `m` for `text`.
pub fn prompt(text: &str) -> InferenceRequest {
    parse(&serde_json::json!({"model": "m", "prompt": text}).to_string())
}

/// A chat body of `model` with one user message.
pub fn chat(model: &str, text: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

/// A pick request with `body` and nothing else.
pub fn with_body(body: &InferenceRequest) -> PickRequest<'_> {
    PickRequest {
        body: Some(body),
        ..PickRequest::default()
    }
}

/// Records a scrape of an idle engine taken `at` that reports its KV capacity:
/// `num_blocks` blocks of `block_size` tokens.
pub fn scrape_capacity(ep: &EndpointState, block_size: u32, num_blocks: Option<u64>, at: Instant) {
    ep.set_scraped(ScrapedLoad {
        queue: 0.0,
        running: 0.0,
        kv_usage: 0.0,
        block_size: Some(block_size),
        num_blocks,
        at,
    });
}

/// Records a scrape of `ep` taken `at`.
pub fn scrape(ep: &EndpointState, queue: f64, running: f64, kv_usage: f64, at: Instant) {
    ep.set_scraped(ScrapedLoad {
        queue,
        running,
        kv_usage,
        block_size: None,
        num_blocks: None,
        at,
    });
}
