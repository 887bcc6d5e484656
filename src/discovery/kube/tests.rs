//! Discovery against a mocked API server (tower-test), in kube-rs's recommended style:
//! the fake answers list and watch requests, and the tests push watch events.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::StreamBody;
use hyper::body::Frame;
use kube::client::Body;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::*;
use crate::discovery::pods::tests::pod;
use crate::scheduler::{PickRequest, Scheduler};

type Chunk = Result<Frame<Bytes>, Infallible>;
type MockBody = StreamBody<UnboundedReceiverStream<Chunk>>;
type Handle = tower_test::mock::Handle<Request<Body>, Response<MockBody>>;

/// The fake API server's objects and open watches.
#[derive(Default)]
struct FakeApi {
    pods: Mutex<Vec<Pod>>,
    pool: Mutex<Option<Value>>,
    pod_watch: Mutex<Option<mpsc::UnboundedSender<Chunk>>>,
    pool_watch: Mutex<Option<mpsc::UnboundedSender<Chunk>>>,
    /// Answer every request with 503 (API server lost).
    down: AtomicBool,
    /// Hold pod list requests until cleared.
    hold_pod_lists: AtomicBool,
    pod_lists: AtomicU64,
    version: AtomicU64,
}

fn body_of(chunks: Vec<Bytes>) -> (MockBody, mpsc::UnboundedSender<Chunk>) {
    let (tx, rx) = mpsc::unbounded_channel();
    for c in chunks {
        let _ = tx.send(Ok(Frame::data(c)));
    }
    (StreamBody::new(UnboundedReceiverStream::new(rx)), tx)
}

fn pool_json(labels: &[(&str, &str)], ports: &[i32]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "ns"},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}}
        }
    })
}

impl FakeApi {
    fn next_version(&self) -> String {
        (self.version.fetch_add(1, Ordering::SeqCst) + 1).to_string()
    }

    fn with_version(&self, mut v: Value) -> Value {
        v["metadata"]["resourceVersion"] = json!(self.next_version());
        v
    }

    /// Serves requests from `handle` until the test ends.
    async fn serve(self: Arc<Self>, mut handle: Handle) {
        while let Some((req, send)) = handle.next_request().await {
            let api = Arc::clone(&self);
            tokio::spawn(async move {
                let path = req.uri().path().to_string();
                let query = req.uri().query().unwrap_or_default().to_string();
                let watch = query.contains("watch=true");
                let is_pods = path == "/api/v1/namespaces/ns/pods";
                let is_pools =
                    path == "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools";
                assert!(is_pods || is_pools, "unexpected request {path}?{query}");
                if api.down.load(Ordering::SeqCst) {
                    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "message": "unavailable", "reason": "ServiceUnavailable", "code": 503});
                    let (body, _) = body_of(vec![Bytes::from(status.to_string())]);
                    let resp = Response::builder()
                        .status(StatusCode::SERVICE_UNAVAILABLE)
                        .body(body)
                        .unwrap();
                    send.send_response(resp);
                    return;
                }
                if is_pods && !watch {
                    api.pod_lists.fetch_add(1, Ordering::SeqCst);
                    while api.hold_pod_lists.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                let (body, tx) = if watch {
                    body_of(Vec::new())
                } else {
                    let items: Vec<Value> = if is_pods {
                        api.pods
                            .lock()
                            .iter()
                            .map(|p| serde_json::to_value(p).unwrap())
                            .collect()
                    } else {
                        api.pool.lock().iter().cloned().collect()
                    };
                    let list = json!({
                        "apiVersion": if is_pods { "v1" } else { "inference.networking.k8s.io/v1" },
                        "kind": if is_pods { "PodList" } else { "InferencePoolList" },
                        "metadata": {"resourceVersion": api.next_version()},
                        "items": items,
                    });
                    body_of(vec![Bytes::from(list.to_string())])
                };
                if watch {
                    let slot = if is_pods {
                        &api.pod_watch
                    } else {
                        &api.pool_watch
                    };
                    *slot.lock() = Some(tx);
                } else {
                    drop(tx);
                }
                send.send_response(Response::builder().body(body).unwrap());
            });
        }
    }

    /// Sends one watch event on the pod (or pool) watch, waiting for it to be open.
    async fn event(&self, pods: bool, kind: &str, object: Value) {
        let line = format!("{}\n", json!({"type": kind, "object": object}));
        for _ in 0..10_000 {
            let slot = if pods {
                &self.pod_watch
            } else {
                &self.pool_watch
            };
            if let Some(tx) = slot.lock().as_ref() {
                if tx.send(Ok(Frame::data(Bytes::from(line.clone())))).is_ok() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no open watch to send {kind} to");
    }

    /// Adds or replaces a pod in the list and announces it on the watch.
    async fn put_pod(&self, p: Pod) {
        let value = self.with_version(serde_json::to_value(&p).unwrap());
        let mut pods = self.pods.lock().clone();
        let kind = match pods.iter().position(|x| x.metadata.name == p.metadata.name) {
            Some(i) => {
                pods[i] = p;
                "MODIFIED"
            }
            None => {
                pods.push(p);
                "ADDED"
            }
        };
        *self.pods.lock() = pods;
        self.event(true, kind, value).await;
    }

    async fn delete_pod(&self, name: &str) {
        let p = {
            let mut pods = self.pods.lock();
            let i = pods
                .iter()
                .position(|x| x.metadata.name.as_deref() == Some(name))
                .unwrap();
            pods.remove(i)
        };
        let value = self.with_version(serde_json::to_value(&p).unwrap());
        self.event(true, "DELETED", value).await;
    }

    async fn put_pool(&self, pool: Value) {
        let kind = if self.pool.lock().is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        *self.pool.lock() = Some(pool.clone());
        let value = self.with_version(pool);
        self.event(false, kind, value).await;
    }

    /// Ends both open watches (as when the API server drops connections).
    fn close_watches(&self) {
        self.pod_watch.lock().take();
        self.pool_watch.lock().take();
    }
}

const APP: (&str, &str) = ("app", "vllm");

/// Starts discovery of pool `pool` in `ns` against a fake API server holding `pods`.
fn start(api: &Arc<FakeApi>, source: Source) -> (Arc<EndpointTable>, tokio::task::JoinHandle<()>) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<MockBody>>();
    tokio::spawn(Arc::clone(api).serve(handle));
    let client = Client::new(service, "ns");
    let table = Arc::new(EndpointTable::new());
    let t = Arc::clone(&table);
    let task = tokio::spawn(async move {
        let _ = run(client, "ns", source, t).await;
    });
    (table, task)
}

fn pool_source() -> Source {
    Source::Pool {
        name: "pool".into(),
        group: PoolGroup::V1,
    }
}

fn addresses(table: &EndpointTable) -> Vec<String> {
    table
        .snapshot()
        .endpoints
        .iter()
        .map(|e| e.endpoint.address_string())
        .collect()
}

async fn wait_for(table: &EndpointTable, want: &[&str]) {
    for _ in 0..500 {
        if table.is_synced() && addresses(table) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "endpoints never became {want:?}; synced={} now {:?}",
        table.is_synced(),
        addresses(table)
    );
}

fn pick(table: &EndpointTable) -> Option<String> {
    Scheduler::default()
        .pick(&PickRequest::default(), &table.snapshot())
        .ok()
        .map(|d| d.decode.endpoint().address_string())
}

#[tokio::test(start_paused = true)]
async fn pod_added_made_unready_and_deleted() {
    let api = Arc::new(FakeApi::default());
    *api.pool.lock() = Some(pool_json(&[APP], &[8000]));
    *api.pods.lock() = vec![
        pod("a", &[APP], true, Some("10.0.0.1")),
        pod("b", &[APP], false, Some("10.0.0.2")),
        pod("c", &[("app", "other")], true, Some("10.0.0.3")),
    ];
    let (table, task) = start(&api, pool_source());
    wait_for(&table, &["10.0.0.1:8000"]).await;
    assert_eq!(pick(&table).as_deref(), Some("10.0.0.1:8000"));

    api.put_pod(pod("d", &[APP], true, Some("10.0.0.4"))).await;
    wait_for(&table, &["10.0.0.1:8000", "10.0.0.4:8000"]).await;

    api.put_pod(pod("a", &[APP], false, Some("10.0.0.1"))).await;
    wait_for(&table, &["10.0.0.4:8000"]).await;
    assert_eq!(pick(&table).as_deref(), Some("10.0.0.4:8000"));

    api.put_pod(pod("b", &[APP], true, Some("10.0.0.2"))).await;
    wait_for(&table, &["10.0.0.2:8000", "10.0.0.4:8000"]).await;

    api.delete_pod("d").await;
    api.delete_pod("b").await;
    wait_for(&table, &[]).await;
    assert!(table.is_synced(), "an empty pool stays synced");
    assert_eq!(pick(&table), None);
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn not_synced_before_both_lists_and_the_pool_exist() {
    let api = Arc::new(FakeApi::default());
    api.hold_pod_lists.store(true, Ordering::SeqCst);
    *api.pods.lock() = vec![pod("a", &[APP], true, Some("10.0.0.1"))];
    let (table, task) = start(&api, pool_source());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(api.pod_lists.load(Ordering::SeqCst), 1);
    assert!(!table.is_synced(), "synced before the pod list arrived");
    api.hold_pod_lists.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !table.is_synced(),
        "synced although the pool does not exist"
    );
    api.put_pool(pool_json(&[APP], &[8000])).await;
    wait_for(&table, &["10.0.0.1:8000"]).await;
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn pool_selector_and_port_edits_apply_without_restart() {
    let api = Arc::new(FakeApi::default());
    *api.pool.lock() = Some(pool_json(&[APP], &[8000]));
    *api.pods.lock() = vec![
        pod("v", &[APP], true, Some("10.0.0.1")),
        pod("s", &[("app", "sglang")], true, Some("10.0.0.2")),
    ];
    let (table, task) = start(&api, pool_source());
    wait_for(&table, &["10.0.0.1:8000"]).await;
    api.put_pool(pool_json(&[("app", "sglang")], &[30000, 30001]))
        .await;
    wait_for(&table, &["10.0.0.2:30000", "10.0.0.2:30001"]).await;
    assert_eq!(
        api.pod_lists.load(Ordering::SeqCst),
        1,
        "pods were re-listed"
    );
    // Deleting the pool empties the set.
    let pool = api.pool.lock().take().unwrap();
    api.event(false, "DELETED", api.with_version(pool)).await;
    wait_for(&table, &[]).await;
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn watch_error_relists_and_swaps_in_the_new_state() {
    let api = Arc::new(FakeApi::default());
    *api.pool.lock() = Some(pool_json(&[APP], &[8000]));
    *api.pods.lock() = vec![pod("a", &[APP], true, Some("10.0.0.1"))];
    let (table, task) = start(&api, pool_source());
    wait_for(&table, &["10.0.0.1:8000"]).await;
    // Changes the watch missed: only a re-list can reveal them.
    *api.pods.lock() = vec![pod("e", &[APP], true, Some("10.0.0.5"))];
    let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": "too old resource version", "reason": "Expired", "code": 410});
    api.event(true, "ERROR", gone).await;
    wait_for(&table, &["10.0.0.5:8000"]).await;
    assert!(api.pod_lists.load(Ordering::SeqCst) >= 2);
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn losing_the_api_server_keeps_the_last_state_and_recovers() {
    let api = Arc::new(FakeApi::default());
    *api.pool.lock() = Some(pool_json(&[APP], &[8000]));
    *api.pods.lock() = vec![pod("a", &[APP], true, Some("10.0.0.1"))];
    let (table, task) = start(&api, pool_source());
    wait_for(&table, &["10.0.0.1:8000"]).await;
    api.down.store(true, Ordering::SeqCst);
    api.close_watches();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(table.is_synced());
    assert_eq!(addresses(&table), ["10.0.0.1:8000"]);
    assert_eq!(pick(&table).as_deref(), Some("10.0.0.1:8000"));
    // Back: the watch resumes (after backoff) and delivers what happened meanwhile.
    api.down.store(false, Ordering::SeqCst);
    api.put_pod(pod("f", &[APP], true, Some("10.0.0.6"))).await;
    wait_for(&table, &["10.0.0.1:8000", "10.0.0.6:8000"]).await;
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn selector_mode_without_a_pool() {
    let api = Arc::new(FakeApi::default());
    *api.pods.lock() = vec![
        pod("a", &[APP, ("tier", "gpu")], true, Some("10.0.0.1")),
        pod("b", &[APP], false, Some("10.0.0.2")),
    ];
    let source = Source::selector("app=vllm,tier=gpu", "8000,8001").unwrap();
    let (table, task) = start(&api, source);
    wait_for(&table, &["10.0.0.1:8000", "10.0.0.1:8001"]).await;
    api.put_pod(pod("a", &[APP, ("tier", "gpu")], false, Some("10.0.0.1")))
        .await;
    wait_for(&table, &[]).await;
    task.abort();
}

#[test]
fn selector_and_ports_flags_parse() {
    assert!(matches!(
        Source::selector("app=x", "8000"),
        Ok(Source::Selector(_))
    ));
    assert!(Source::selector("", "8000").is_err());
    assert!(Source::selector("app", "8000").is_err());
    assert!(Source::selector("=x", "8000").is_err());
    assert!(Source::selector("app=x", "").is_err());
    assert!(Source::selector("app=x", "0").is_err());
    assert!(Source::selector("app=x", "80,http").is_err());
    assert_eq!(
        PoolGroup::parse(GROUP_V1ALPHA2).unwrap(),
        PoolGroup::V1Alpha2
    );
    assert!(PoolGroup::parse("example.com").is_err());
}

#[test]
fn rbac_manifest_grants_read_only_namespaced_access() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use serde::Deserialize;
    let text = include_str!("../../../manifests/rbac.yaml");
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ServiceAccount", "Role", "RoleBinding"]);
    let sa: ServiceAccount = serde_yaml::from_value(docs[0].clone()).unwrap();
    let role: Role = serde_yaml::from_value(docs[1].clone()).unwrap();
    let binding: RoleBinding = serde_yaml::from_value(docs[2].clone()).unwrap();
    let rules = role.rules.unwrap();
    for rule in &rules {
        assert_eq!(rule.verbs, ["get", "list", "watch"]);
    }
    let grants = |group: &str, resource: &str| {
        rules.iter().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
        })
    };
    assert!(grants("", "pods"));
    assert!(grants(GROUP_V1, "inferencepools"));
    assert!(grants(GROUP_V1ALPHA2, "inferencepools"));
    assert_eq!(binding.role_ref.kind, "Role");
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    assert_eq!(binding.subjects.unwrap()[0].name, sa.metadata.name.unwrap());
}

/// Measurement for `docs/discovery.md`: time from a pod's readiness change arriving
/// on the watch to `Scheduler::pick` on the live table answering differently. Run
/// with `cargo test --release --lib readiness_to_decision -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, not a check"]
async fn readiness_to_decision_latency() {
    let api = Arc::new(FakeApi::default());
    *api.pool.lock() = Some(pool_json(&[APP], &[8000]));
    *api.pods.lock() = vec![pod("a", &[APP], true, Some("10.0.0.1"))];
    let (table, task) = start(&api, pool_source());
    wait_for(&table, &["10.0.0.1:8000"]).await;
    let scheduler = Scheduler::default();
    let mut samples = Vec::new();
    for i in 0..400 {
        let ready = i % 2 == 1;
        let p = pod("a", &[APP], ready, Some("10.0.0.1"));
        let value = api.with_version(serde_json::to_value(&p).unwrap());
        *api.pods.lock() = vec![p];
        let start = std::time::Instant::now();
        api.event(true, "MODIFIED", value).await;
        loop {
            let routed = scheduler
                .pick(&PickRequest::default(), &table.snapshot())
                .is_ok();
            if routed == ready {
                break;
            }
            tokio::task::yield_now().await;
        }
        samples.push(start.elapsed());
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    println!(
        "readiness change -> decision change over {} flips: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
        samples.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        samples[samples.len() - 1]
    );
    task.abort();
}
