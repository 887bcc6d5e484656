//! Passive health end to end: a worker dies while the API server is down, so
//! discovery never removes it; kvpick sees the failures on the response path
//! (the gateway's local 503 on a refused connection, as Envoy's router sends
//! one through the ext_proc filter) and moves traffic off the dead worker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::apiserver::{seed_pool, write_kubeconfig, ApiServer};
use e2e::gateway::{GatewayConfig, GatewayHandle};
use e2e::mock_worker::WorkerConfig;
use e2e::stack::start_workers_on_one_port;
use kvpick::discovery::kube::{PoolGroup, Source};
use kvpick::endpoints::EndpointTable;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::App;
use serde_json::json;
use tokio::net::TcpListener;

async fn wait_for(table: &Arc<EndpointTable>, n: usize) {
    for _ in 0..500 {
        if table.is_synced() && table.snapshot().endpoints.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("kvpick never saw {n} endpoints");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_worker_loses_its_traffic_within_a_second_with_the_api_server_down() {
    let fast = WorkerConfig {
        ttft: Duration::from_millis(1),
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let workers = start_workers_on_one_port(4, &fast).await.unwrap();
    let port = workers[0].addr().port();
    let listed: Vec<_> = workers
        .iter()
        .map(|w| (w.addr(), w.instance_id()))
        .collect();
    let api = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_millis(200))
        .await
        .unwrap();
    seed_pool(api.state(), "inference", "vllm", port, &listed).unwrap();
    let dir = std::env::temp_dir().join(format!("kvpick-e2e-health-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    write_kubeconfig(&kubeconfig, &api.url(), "inference").unwrap();
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(&kubeconfig).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let app = App::new("vllm");
    let table = Arc::clone(&app.endpoints);
    let discovery = tokio::spawn(async move {
        kvpick::discovery::kube::run(
            client,
            "inference",
            Source::Pool {
                name: "vllm".into(),
                group: PoolGroup::V1,
            },
            table,
        )
        .await
    });
    wait_for(&app.endpoints, 4).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ext_proc = listener.local_addr().unwrap();
    let grpc = tokio::spawn(kvpick::server::serve_ext_proc(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        None,
    ));
    let gateway = GatewayHandle::start(
        ([127, 0, 0, 1], 0).into(),
        GatewayConfig {
            ext_proc: format!("http://{ext_proc}"),
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap();
    let client = e2e::client::Client::new(gateway.addr());
    let send = move |i: usize| {
        let client = client.clone();
        async move {
            let body = json!({"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": format!("question {i}")}]});
            let r = client.post_json("/v1/chat/completions", &body, &[]).await;
            r.map(|r| r.status.as_u16()).unwrap_or(0)
        }
    };
    for i in 0..16 {
        assert_eq!(send(i).await, 200);
    }
    // The API server goes away (discovery keeps its last view), then a worker dies.
    drop(api);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let dead = 3;
    workers[dead].kill();
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
    let served: u64 = workers[..dead].iter().map(|w| w.counters().requests).sum();
    assert!(served >= replies.len() as u64 - failed.len() as u64);
    let snapshot = app.endpoints.snapshot();
    let dead_state = snapshot
        .by_instance(workers[dead].instance_id())
        .expect("discovery still lists the dead worker");
    assert!(dead_state.health().failures() >= 1);
    eprintln!(
        "{} requests, failed at {failed:?}, ejections {}",
        replies.len(),
        app.metrics.endpoint_ejections.get()
    );
    discovery.abort();
    grpc.abort();
}
