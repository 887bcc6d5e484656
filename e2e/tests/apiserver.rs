//! The test API server through kube-rs: a kubeconfig, a real `kube::Client`,
//! list and `kube::runtime::watcher`.

use std::time::Duration;

use e2e::apiserver::{inference_pool, pod, write_kubeconfig, ApiServer, Kind};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};

async fn client_for(server: &ApiServer) -> kube::Client {
    let dir = std::env::temp_dir().join(format!(
        "kvpick-e2e-kube-{}-{}",
        std::process::id(),
        server.addr().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kubeconfig");
    write_kubeconfig(&path, &server.url(), "inference").unwrap();
    let kc = Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "inference");
    let _ = std::fs::remove_dir_all(&dir);
    kube::Client::try_from(config).unwrap()
}

fn worker_pod(name: &str, ip: &str, ready: bool) -> serde_json::Value {
    pod(
        "inference",
        name,
        ip,
        ready,
        &[("app", "vllm")],
        &[("kvpick.io/dp-size", "1")],
    )
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn lists_pods_and_pools_with_selectors() {
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_secs(1))
        .await
        .unwrap();
    let st = server.state();
    st.apply(Kind::Pod, worker_pod("w0", "10.0.0.1", true))
        .unwrap();
    st.apply(Kind::Pod, worker_pod("w1", "10.0.0.2", false))
        .unwrap();
    st.apply(
        Kind::Pod,
        pod(
            "inference",
            "other",
            "10.0.0.9",
            true,
            &[("app", "web")],
            &[],
        ),
    )
    .unwrap();
    st.apply(
        Kind::Pod,
        pod("elsewhere", "w9", "10.0.1.1", true, &[("app", "vllm")], &[]),
    )
    .unwrap();
    st.apply(
        Kind::InferencePool,
        inference_pool(
            "inference",
            "pool",
            &[("app", "vllm")],
            &[8000],
            "kvpick",
            9002,
        ),
    )
    .unwrap();
    let client = client_for(&server).await;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let list = pods
        .list(&ListParams::default().labels("app=vllm"))
        .await
        .unwrap();
    let names: Vec<String> = list
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert_eq!(names, vec!["w0", "w1"]);
    assert_eq!(
        list.metadata.resource_version.as_deref(),
        Some(&*st.resource_version().to_string())
    );
    let ready = pods
        .list(&ListParams::default().fields("metadata.name=w0"))
        .await
        .unwrap();
    assert_eq!(ready.items.len(), 1);
    assert!(is_ready(&ready.items[0]));
    assert_eq!(
        Api::<Pod>::all(client.clone())
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        4
    );

    let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "inferencepools");
    let pools: Api<DynamicObject> = Api::namespaced_with(client, "inference", &ar);
    let list = pools.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].data["spec"]["targetPorts"][0]["number"], 8000);
}

async fn next(
    events: &mut futures::stream::BoxStream<'_, Result<Event<Pod>, watcher::Error>>,
) -> Event<Pod> {
    tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .expect("watch event in time")
        .expect("stream open")
        .expect("no watch error")
}

#[tokio::test]
async fn watcher_follows_readiness_changes_and_deletes() {
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_millis(50))
        .await
        .unwrap();
    let st = server.state();
    st.apply(Kind::Pod, worker_pod("w0", "10.0.0.1", true))
        .unwrap();
    let pods: Api<Pod> = Api::default_namespaced(client_for(&server).await);
    let mut events = watcher::watcher(pods, watcher::Config::default().labels("app=vllm")).boxed();
    assert!(matches!(next(&mut events).await, Event::Init));
    assert!(matches!(next(&mut events).await, Event::InitApply(p) if is_ready(&p)));
    assert!(matches!(next(&mut events).await, Event::InitDone));
    assert!(st.set_pod_ready("inference", "w0", false));
    assert!(matches!(next(&mut events).await, Event::Apply(p) if !is_ready(&p)));
    st.apply(Kind::Pod, worker_pod("w1", "10.0.0.2", true))
        .unwrap();
    assert!(
        matches!(next(&mut events).await, Event::Apply(p) if p.metadata.name.as_deref() == Some("w1"))
    );
    assert!(st.delete(Kind::Pod, "inference", "w0"));
    assert!(
        matches!(next(&mut events).await, Event::Delete(p) if p.metadata.name.as_deref() == Some("w0"))
    );
}

#[tokio::test]
async fn a_too_old_resource_version_gets_410_and_bookmarks_flow() {
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_millis(50))
        .await
        .unwrap();
    let st = server.state();
    st.apply(Kind::Pod, worker_pod("w0", "10.0.0.1", true))
        .unwrap();
    let client = client_for(&server).await;
    // Raw watch from a compacted version: one ERROR event with a 410 Status.
    let old = st.resource_version();
    st.apply(Kind::Pod, worker_pod("w1", "10.0.0.2", true))
        .unwrap();
    st.compact();
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let mut raw = pods
        .watch(&kube::api::WatchParams::default(), &old.to_string())
        .await
        .unwrap()
        .boxed();
    match raw.next().await {
        Some(Err(kube::Error::Api(status))) => assert_eq!(status.code, 410),
        Some(Ok(kube::api::WatchEvent::Error(e))) => assert_eq!(e.code, 410),
        other => panic!("expected 410, got {other:?}"),
    }
    // A bookmark-enabled raw watch from now sees BOOKMARK events.
    let mut raw = pods
        .watch(
            &kube::api::WatchParams {
                bookmarks: true,
                ..Default::default()
            },
            &st.resource_version().to_string(),
        )
        .await
        .unwrap()
        .boxed();
    let ev = tokio::time::timeout(Duration::from_secs(5), raw.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(ev, kube::api::WatchEvent::Bookmark(_)), "{ev:?}");
}

#[tokio::test]
async fn a_seeded_pool_lists_one_ready_pod_per_worker_on_distinct_loopback_ips() {
    let workers =
        e2e::stack::start_workers_on_one_port(3, &e2e::mock_worker::WorkerConfig::default())
            .await
            .unwrap();
    let port = workers[0].addr().port();
    let listed: Vec<_> = workers
        .iter()
        .map(|w| (w.addr(), w.instance_id()))
        .collect();
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_secs(1))
        .await
        .unwrap();
    e2e::apiserver::seed_pool(server.state(), "inference", "vllm", port, &listed).unwrap();
    let pods: Api<Pod> = Api::default_namespaced(client_for(&server).await);
    let list = pods
        .list(&ListParams::default().labels("app=vllm"))
        .await
        .unwrap();
    let ips: Vec<String> = list
        .items
        .iter()
        .filter(|p| is_ready(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    assert_eq!(ips, vec!["127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    for (w, p) in workers.iter().zip(&list.items) {
        assert_eq!(w.addr().port(), port);
        let id = &p.metadata.annotations.as_ref().unwrap()["kvpick.io/instance-id"];
        assert_eq!(id, &w.instance_id().to_string());
        let health = e2e::client::Client::new(w.addr())
            .get("/health")
            .await
            .unwrap();
        assert_eq!(health.status, 200);
    }
}

#[tokio::test]
async fn a_streaming_list_sends_the_state_then_the_initial_events_end_bookmark() {
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_secs(60))
        .await
        .unwrap();
    let st = server.state();
    for (name, ip) in [("w0", "10.0.0.1"), ("w1", "10.0.0.2")] {
        st.apply(Kind::Pod, worker_pod(name, ip, true)).unwrap();
    }
    let client = client_for(&server).await;
    let pods: Api<Pod> = Api::default_namespaced(client);
    // kube-rs's streaming list (`sendInitialEvents=true`), as client-go's informers list.
    let mut events = watcher::watcher(pods, watcher::Config::default().streaming_lists()).boxed();
    let mut initial = Vec::new();
    loop {
        match next(&mut events).await {
            Event::Init => {}
            Event::InitApply(p) => initial.push(p.metadata.name.unwrap()),
            Event::InitDone => break,
            other => panic!("expected the initial list, got {other:?}"),
        }
    }
    initial.sort();
    assert_eq!(initial, ["w0", "w1"]);
    st.apply(Kind::Pod, worker_pod("w2", "10.0.0.3", true))
        .unwrap();
    assert!(
        matches!(next(&mut events).await, Event::Apply(p) if p.metadata.name.as_deref() == Some("w2"))
    );
}

#[tokio::test]
async fn discovery_finds_pods_and_inference_pools() {
    let server = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_secs(60))
        .await
        .unwrap();
    let client = client_for(&server).await;
    let discovery = kube::Discovery::new(client).run().await.unwrap();
    let kinds: Vec<(String, String, bool)> = discovery
        .groups()
        .flat_map(|g| g.recommended_resources())
        .map(|(r, caps)| {
            (
                r.api_version.clone(),
                r.kind.clone(),
                caps.scope == kube::discovery::Scope::Namespaced,
            )
        })
        .collect();
    assert!(
        kinds.contains(&("v1".into(), "Pod".into(), true)),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&(
            "inference.networking.k8s.io/v1".into(),
            "InferencePool".into(),
            true
        )),
        "{kinds:?}"
    );
}
