//! kvpick's Kubernetes discovery (kube-rs watchers, via a kubeconfig) against the
//! test API server, with the whole path: client → gateway → kvpick → 4 workers
//! on 127.0.0.1..4 sharing one port, as pods of one InferencePool.
//!

use std::sync::Arc;
use std::time::Duration;

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
    panic!(
        "kvpick never saw {n} endpoints (has {})",
        table.snapshot().endpoints.len()
    );
}

#[tokio::test]
async fn a_pod_turned_unready_stops_getting_traffic() {
    let fast = WorkerConfig {
        ttft: Duration::ZERO,
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

    // kvpick's real kube-rs path: a kubeconfig file, kube::Config, watchers.
    let dir = std::env::temp_dir().join(format!("kvpick-e2e-disc-{}", std::process::id()));
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
    let service = app.ext_proc(ExtProcConfig::default());
    let grpc = tokio::spawn(kvpick::server::serve_ext_proc(listener, service, None));
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
    let send = |i: usize| {
        let client = client.clone();
        async move {
            let body = json!({"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": format!("question {i}")}]});
            let r = client
                .post_json("/v1/chat/completions", &body, &[])
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    for i in 0..8 {
        send(i).await;
    }
    assert!(api.state().set_pod_ready("inference", "vllm-3", false));
    wait_for(&app.endpoints, 3).await;
    let before = workers[3].counters().requests;
    for i in 8..24 {
        send(i).await;
    }
    assert_eq!(
        workers[3].counters().requests,
        before,
        "the unready pod got traffic"
    );
    assert!(api.state().set_pod_ready("inference", "vllm-3", true));
    wait_for(&app.endpoints, 4).await;
    for w in &workers {
        for r in w.seen().requests {
            assert_eq!(
                r.worker_instance_id.as_deref(),
                Some(&*w.instance_id().to_string())
            );
            assert_eq!(r.destination.as_deref(), Some(&*w.addr().to_string()));
        }
    }
    discovery.abort();
    grpc.abort();
}
