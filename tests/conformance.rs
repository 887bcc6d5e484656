//! GIE's conformance scenarios, driven at the ext_proc level the way Envoy
//! drives kvpick under them (`--conformance-test-hooks`), and GIE's fallback
//! endpoints (`--max-endpoints`):
//!
//! - GatewayFollowingEPPRouting(WithDataParallelism): the
//!   `test-epp-endpoint-selection` header confines every pick to the pods
//!   (any target port) and `ip:port`s it names;
//! - GatewayDestinationEndpointServed: the response carries the gateway's
//!   served endpoint in `x-conformance-test-served-endpoint`;
//! - fallbacks: `x-gateway-destination-endpoint` and the `envoy.lb` metadata
//!   list the same endpoints, best first, within the selection.
//!
//! EppUnAvailableFailOpen is the gateway's part: `e2e/tests/path.rs` drives it.

use std::collections::HashSet;

use envoy_client::message::{one_field, response_headers};
use envoy_client::{EnvoyStream, Phase};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::scheduler::SchedulerConfig;
use kvpick::server::App;
use tonic::transport::Channel;

#[allow(dead_code)] // each test binary uses a part of it
mod support;
use support::{changes, channel, routed_chat};

/// The selection header GIE's suite sends.
const SELECTION: &str = "test-epp-endpoint-selection";
/// The response header GIE's suite reads.
const SERVED: &str = "x-conformance-test-served-endpoint";

/// GIE's data-parallel test pool: 3 pods, each serving ports 3000, 3002, 3004.
fn dp_pool() -> Vec<Endpoint> {
    (1..=3)
        .flat_map(|pod| {
            [3000, 3002, 3004]
                .map(|port| Endpoint::new(format!("10.0.0.{pod}:{port}").parse().unwrap()))
        })
        .collect()
}

/// kvpick on loopback with `endpoints`, the hooks `on` or off, naming up to
/// `max_endpoints` endpoints a decision.
async fn start(endpoints: Vec<Endpoint>, on: bool, max_endpoints: usize) -> (App, Channel) {
    let app = App::with_scheduler(
        "conformance",
        SchedulerConfig {
            max_endpoints,
            ..Default::default()
        },
    );
    app.endpoints.replace(endpoints);
    let config = ExtProcConfig {
        conformance_test_hooks: on,
        ..Default::default()
    };
    let port = support::serve(&app, config).await;
    (app, channel(port).await)
}

fn prompt(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "conformance-fake-model",
        "messages": [{"role": "user", "content": format!("Answer with no disclaimers: question {i}")}],
    }))
    .unwrap()
}

/// Routes one request with the selection header `selection` (if any); returns
/// the open stream, the destination header and the `envoy.lb` metadata's.
async fn route(ch: &Channel, i: usize, selection: Option<&str>) -> (EnvoyStream, String, String) {
    let extra: Vec<(&str, &str)> = selection.map(|s| (SELECTION, s)).into_iter().collect();
    let (s, r) = routed_chat(ch, &prompt(i), &extra, None).await;
    let header = r.changes.get("x-gateway-destination-endpoint").unwrap();
    let metadata = r.changes.metadata_destination.clone().unwrap();
    (s, header.to_string(), metadata)
}

/// The `envoy.lb` metadata a gateway sends with the response headers, naming
/// the endpoint that served the request.
fn served_by(endpoint: &str) -> Metadata {
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        "envoy.lb".into(),
        one_field(
            "x-gateway-destination-endpoint-served",
            Kind::StringValue(endpoint.into()),
        ),
    );
    md
}

/// Answers the response headers (carrying `metadata`); returns the served
/// header kvpick set on the response.
async fn respond(mut s: EnvoyStream, metadata: Option<Metadata>) -> Option<String> {
    let mut msg = response_headers("200", &[], true);
    msg.metadata_context = metadata;
    s.send(msg).await.unwrap();
    let c = changes(&mut s, Phase::ResponseHeaders).await;
    c.get(SERVED).map(str::to_string)
}

/// GatewayFollowingEPPRoutingWithDataParallelism: 30 requests held in flight
/// per case (so load spreads them over ranks) go only where the header says:
/// a bare IP allows every port of that pod, `ip:port` that port alone.
#[tokio::test]
async fn the_selection_header_confines_picks_to_the_named_pods_and_ports() {
    let (_app, ch) = start(dp_pool(), true, 1).await;
    let cases: [(&str, &[&str]); 4] = [
        (
            "10.0.0.2",
            &["10.0.0.2:3000", "10.0.0.2:3002", "10.0.0.2:3004"],
        ),
        (
            "10.0.0.1,10.0.0.3:3002",
            &[
                "10.0.0.1:3000",
                "10.0.0.1:3002",
                "10.0.0.1:3004",
                "10.0.0.3:3002",
            ],
        ),
        (
            "10.0.0.1,10.0.0.2:3000,10.0.0.2:3004,10.0.0.3",
            &[
                "10.0.0.1:3000",
                "10.0.0.1:3002",
                "10.0.0.1:3004",
                "10.0.0.2:3000",
                "10.0.0.2:3004",
                "10.0.0.3:3000",
                "10.0.0.3:3002",
                "10.0.0.3:3004",
            ],
        ),
        // Naming no pod of the pool restricts nothing (the reference picker's
        // fallback to the whole pool).
        ("10.9.9.9", &[]),
    ];
    for (n, (selection, allowed)) in cases.into_iter().enumerate() {
        let mut held = Vec::new();
        let mut seen = HashSet::new();
        for i in 0..30 {
            let (s, header, metadata) = route(&ch, n * 100 + i, Some(selection)).await;
            assert_eq!(header, metadata);
            assert!(
                allowed.is_empty() || allowed.contains(&header.as_str()),
                "{selection}: routed to {header}"
            );
            seen.insert(header);
            held.push(s);
        }
        // In flight, the requests spread over every allowed endpoint.
        let want = if allowed.is_empty() { 9 } else { allowed.len() };
        assert_eq!(seen.len(), want, "{selection}: {seen:?}");
    }
    // Without the hooks the header is the client's and steers nothing.
    let (_app, ch) = start(dp_pool(), false, 1).await;
    let mut held = Vec::new();
    let mut seen = HashSet::new();
    for i in 0..30 {
        let (s, header, _) = route(&ch, i, Some("10.0.0.2:3000")).await;
        seen.insert(header);
        held.push(s);
    }
    assert_eq!(seen.len(), 9, "{seen:?}");
}

/// GatewayDestinationEndpointServed: each pod selected in turn, the response
/// reports what the gateway says served it (`ip:3000` in GIE's suite), and
/// says so when the gateway sent no such metadata; nothing without the hooks.
#[tokio::test]
async fn the_served_endpoint_is_echoed_from_the_gateways_metadata() {
    let pool = || {
        (1..=3)
            .map(|pod| Endpoint::new(format!("10.0.0.{pod}:3000").parse().unwrap()))
            .collect::<Vec<_>>()
    };
    let (_app, ch) = start(pool(), true, 1).await;
    for pod in 1..=3 {
        let ip = format!("10.0.0.{pod}");
        let (s, header, _) = route(&ch, pod, Some(&ip)).await;
        assert_eq!(header, format!("{ip}:3000"));
        let served = respond(s, Some(served_by(&header))).await;
        assert_eq!(served.as_deref(), Some(header.as_str()));
    }
    let (s, _, _) = route(&ch, 9, None).await;
    assert_eq!(
        respond(s, None).await.as_deref(),
        Some("fail: missing envoy lb metadata")
    );
    let (_app, ch) = start(pool(), false, 1).await;
    let (s, header, _) = route(&ch, 1, None).await;
    assert_eq!(respond(s, Some(served_by(&header))).await, None);
}

/// Fallbacks: with 3 endpoints asked for, the header and the metadata list the
/// same 3 distinct pods (a data-parallel pod once), the worker headers naming
/// the first; a selection of 2 pods lists only those 2; the served header
/// reports the fallback when the gateway's retry landed there.
#[tokio::test]
async fn fallbacks_are_listed_in_the_header_and_metadata_within_the_selection() {
    let mut pool: Vec<Endpoint> = (1..=4)
        .map(|pod| Endpoint::new(format!("10.0.0.{pod}:8000").parse().unwrap()))
        .collect();
    pool[0].dp_size = 4;
    let (app, ch) = start(pool, true, 3).await;
    for i in 0..8 {
        let (s, header, metadata) = route(&ch, i, None).await;
        assert_eq!(header, metadata);
        let list: Vec<&str> = header.split(',').collect();
        let distinct: HashSet<&str> = list.iter().copied().collect();
        assert_eq!((list.len(), distinct.len()), (3, 3), "{header}");
        respond(s, None).await;
    }
    // The worker id names the first of the list.
    let (s, r) = routed_chat(&ch, &prompt(50), &[], None).await;
    let first = r.changes.get("x-gateway-destination-endpoint").unwrap();
    let first = first.split(',').next().unwrap();
    let id = app
        .endpoints
        .snapshot()
        .endpoints
        .iter()
        .find(|e| e.endpoint.address_string() == first)
        .map(|e| e.endpoint.instance_id.to_string());
    assert_eq!(r.changes.get("x-worker-instance-id"), id.as_deref());
    respond(s, None).await;
    for i in 0..8 {
        let (s, header, _) = route(&ch, 100 + i, Some("10.0.0.2,10.0.0.4")).await;
        let mut list: Vec<&str> = header.split(',').collect();
        list.sort();
        assert_eq!(list, ["10.0.0.2:8000", "10.0.0.4:8000"]);
        // The gateway's retry served the second.
        let second = header.split(',').nth(1).unwrap().to_string();
        assert_eq!(respond(s, Some(served_by(&second))).await, Some(second));
    }
}
