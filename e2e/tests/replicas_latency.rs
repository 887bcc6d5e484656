//! Replicas share the learned latency models through a real `redis-server`:
//! replica A, in `--scoring predicted` mode, learns two workers of different
//! speeds from streamed traffic; replica B, started afterwards, is warm from
//! its first pick, its `explain` predicting every candidate from that
//! worker's own model, without having served a request.
//!
//! Skipped (with a message) when `redis-server` is not installed, unless
//! `KVPICK_REQUIRE_SYNC_SERVER=1` (CI), which makes that a failure.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use e2e::gateway::{GatewayConfig, GatewayHandle};
use e2e::mock_worker::{WorkerConfig, WorkerHandle};
use e2e::replicas::RedisServer;
use e2e::stack::{write_endpoints, Kvpick, Tuning};
use kvpick::latency::Features;
use kvpick::request::parse;
use kvpick::scheduler::{PickRequest, ScoringMode};
use serde_json::json;

fn body(i: usize) -> serde_json::Value {
    json!({
        "model": "m",
        "stream": true,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": format!("request {i}: {}", "words ".repeat(40))}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_later_predicts_with_the_models_its_peer_learned() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvpick-replicas-latency-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let local: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mut workers = Vec::new();
    for speed in [4.0, 1.0] {
        let config = WorkerConfig {
            ttft: Duration::from_millis(10),
            prefill_per_token: Duration::from_micros(10),
            itl: Duration::from_millis(1),
            speed,
            ..WorkerConfig::default()
        };
        workers.push(WorkerHandle::start(local, config).await.unwrap());
    }
    let endpoints_file = dir.join("endpoints.yaml");
    let listed: Vec<_> = workers
        .iter()
        .map(|w| (w.addr(), w.instance_id()))
        .collect();
    write_endpoints(&endpoints_file, &listed).unwrap();
    let poll = Duration::from_millis(20);
    let predicted = Tuning {
        scoring: ScoringMode::Predicted,
        ..Tuning::default()
    };

    let a = Kvpick::start_replica_with(endpoints_file.clone(), poll, &redis.url(), predicted)
        .await
        .unwrap();
    a.wait_for_endpoints(2).await.unwrap();
    let gateway = GatewayHandle::start(
        local,
        GatewayConfig {
            ext_proc: format!("http://{}", a.addr()),
            message_timeout: Duration::from_secs(2),
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap();
    let client = e2e::client::Client::new(gateway.addr());
    let learned = a.scheduler().latency().unwrap().clone();
    let mut i = 0;
    while !(learned.is_warm() && learned.workers() == 2 && i >= 64) {
        let r = client
            .post_json("/v1/chat/completions", &body(i), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        i += 1;
        assert!(i < 1000, "replica A did not learn both workers");
    }
    // A publishes its models every 200 ms.
    tokio::time::sleep(Duration::from_millis(600)).await;

    let b = Kvpick::start_replica_with(endpoints_file.clone(), poll, &redis.url(), predicted)
        .await
        .unwrap();
    b.wait_for_endpoints(2).await.unwrap();
    let inherited = b.scheduler().latency().unwrap();
    assert!(inherited.is_warm(), "B's pool prior came from A");
    assert_eq!(inherited.workers(), 2, "both workers' models came from A");
    let served: u64 = workers.iter().map(|w| w.counters().requests).sum();
    assert_eq!(served as usize, i, "every request went through A");
    let prompt = parse(body(9999).to_string().as_bytes(), None).unwrap();
    let explained = b
        .scheduler()
        .explain(
            &PickRequest {
                body: Some(&prompt),
                ..Default::default()
            },
            &b.endpoints().snapshot(),
            Instant::now(),
        )
        .unwrap();
    assert_eq!(explained.candidates.len(), 2);
    for c in &explained.candidates {
        let p = c.prediction.expect("B predicts every candidate");
        let at_a = learned.predict(&c.key, &Features::default()).unwrap();
        assert!(p.observations > 0, "{}: {p:?}", c.address);
        assert_eq!(
            p.observations, at_a.observations,
            "{}: B knows what A learned of the worker",
            c.address
        );
    }
    assert_eq!(inherited.fallbacks(), 0, "B never fell back");
    let _ = std::fs::remove_dir_all(&dir);
}
