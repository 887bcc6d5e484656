//! kvpick's Kubernetes discovery (kube-rs watchers, via a kubeconfig) against the
//! test API server, with the whole path: client → gateway → kvpick → 4 workers
//! on 127.0.0.1..4 sharing one port, as pods of one InferencePool.

mod pool_fixture;

use std::time::Duration;

use e2e::mock_worker::WorkerConfig;
use pool_fixture::{chat, PoolStack};

#[tokio::test]
async fn a_pod_turned_unready_stops_getting_traffic() {
    let fast = WorkerConfig {
        ttft: Duration::ZERO,
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        ..WorkerConfig::default()
    };
    let stack = PoolStack::start(4, &fast).await;
    let client = &stack.client;
    let send = |i: usize| async move {
        let r = chat(client, i).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    };
    for i in 0..8 {
        send(i).await;
    }
    let api = stack.api.as_ref().unwrap();
    assert!(api.state().set_pod_ready("inference", "vllm-3", false));
    stack.wait_for(3).await;
    let before = stack.workers[3].counters().requests;
    for i in 8..24 {
        send(i).await;
    }
    assert_eq!(
        stack.workers[3].counters().requests,
        before,
        "the unready pod got traffic"
    );
    assert!(api.state().set_pod_ready("inference", "vllm-3", true));
    stack.wait_for(4).await;
    for w in &stack.workers {
        for r in w.seen().requests {
            assert_eq!(
                r.worker_instance_id.as_deref(),
                Some(&*w.instance_id().to_string())
            );
            assert_eq!(r.destination.as_deref(), Some(&*w.addr().to_string()));
        }
    }
}
