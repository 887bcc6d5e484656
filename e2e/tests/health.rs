//! Passive health end to end: a worker dies while the API server is down, so
//! discovery never removes it; kvpick sees the failures on the response path
//! (the gateway's local 503 on a refused connection, as Envoy's router sends
//! one through the ext_proc filter) and moves traffic off the dead worker.

mod pool_fixture;

use std::time::{Duration, Instant};

use e2e::mock_worker::WorkerConfig;
use pool_fixture::{chat, PoolStack};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_worker_loses_its_traffic_within_a_second_with_the_api_server_down() {
    let fast = WorkerConfig {
        ttft: Duration::from_millis(1),
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let mut stack = PoolStack::start(4, &fast).await;
    let client = stack.client.clone();
    let send = move |i: usize| {
        let client = client.clone();
        async move {
            let r = chat(&client, i).await;
            r.map(|r| r.status.as_u16()).unwrap_or(0)
        }
    };
    for i in 0..16 {
        assert_eq!(send(i).await, 200);
    }
    // The API server goes away (discovery keeps its last view), then a worker dies.
    drop(stack.api.take());
    tokio::time::sleep(Duration::from_millis(100)).await;
    stack.wait_for(4).await;
    let dead = 3;
    stack.workers[dead].kill();
    let killed = Instant::now();
    // Four clients send for 2.5 s; each reply is (time since the kill, status).
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..4 {
        let send = send.clone();
        clients.spawn(async move {
            let mut replies = Vec::new();
            let mut i = 1000 * (c + 1);
            while killed.elapsed() < Duration::from_millis(2500) {
                let at = killed.elapsed();
                replies.push((at, send(i).await));
                i += 1;
            }
            replies
        });
    }
    let mut replies = Vec::new();
    while let Some(r) = clients.join_next().await {
        replies.extend(r.unwrap());
    }
    let failed: Vec<Duration> = replies
        .iter()
        .filter(|(_, status)| *status != 200)
        .map(|(at, _)| *at)
        .collect();
    let late = failed.iter().filter(|at| **at >= Duration::from_secs(1));
    assert!(replies.len() > 100, "only {} requests ran", replies.len());
    // A handful: the failures that eject it, then one probe per ejection period.
    assert!(
        failed.len() <= 5,
        "{} of {} requests failed (at {failed:?})",
        failed.len(),
        replies.len()
    );
    // Ejected within the first second; after it only probation probes fail.
    assert!(late.count() <= 2, "failures after 1 s: {failed:?}");
    let served: u64 = stack.workers[..dead]
        .iter()
        .map(|w| w.counters().requests)
        .sum();
    assert!(served >= replies.len() as u64 - failed.len() as u64);
    let snapshot = stack.app.endpoints.snapshot();
    let dead_state = snapshot
        .by_instance(stack.workers[dead].instance_id())
        .expect("discovery still lists the dead worker");
    assert!(dead_state.health().failures() >= 1);
    eprintln!(
        "{} requests, failed at {failed:?}, ejections {}",
        replies.len(),
        stack.app.extproc_metrics.endpoint_ejections.get()
    );
}
