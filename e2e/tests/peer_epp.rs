//! The peer endpoint picker (the Gateway API Inference Extension's reference
//! EPP, installed by `e2e/peers/install-gie-epp.sh`) over mock vLLM workers it
//! discovers through the test API server, driven as Envoy drives it: every
//! request is routed to one of those workers. Skips with a message when the
//! binary is not installed, unless `KVPICK_REQUIRE_PEER_EPP=1`.

use std::net::SocketAddr;

use e2e::bench::overhead::{chat_body, connect, routed_request};
use e2e::bench::peer_epp::{installed, Fleet, PeerEpp, PINNED, REQUIRE_ENV};

#[tokio::test]
async fn the_peer_epp_routes_every_request_to_a_discovered_mock_worker() {
    let Some(exe) = installed() else {
        assert!(
            std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
            "{REQUIRE_ENV}=1 but {PINNED} is not installed"
        );
        eprintln!("skipped: {PINNED} is not installed (e2e/peers/install-gie-epp.sh)");
        return;
    };
    let fleet = Fleet::start(4, "llama").await.unwrap();
    let peer = PeerEpp::start(&exe, &fleet.addrs(), fleet.port())
        .await
        .unwrap();
    let ch = connect(peer.process.port).await.unwrap();
    let mut chosen = std::collections::HashSet::new();
    for variant in 0..16 {
        let (_, destination) = routed_request(&ch, &chat_body(8 * 1024, variant))
            .await
            .unwrap();
        let destination: SocketAddr = destination
            .expect("the peer names a destination")
            .parse()
            .unwrap();
        assert!(fleet.addrs().contains(&destination), "{destination}");
        chosen.insert(destination);
    }
    assert!(!chosen.is_empty());
    peer.process.stop().await.unwrap();
}
