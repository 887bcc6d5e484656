//! InferenceObjective watch: the priorities of the pool's objectives, for admission.
//!
//! GIE v1.6 removed InferenceObjective from its API (#2973); the llm-d Router
//! (v0.10) now owns it as `llm-d.ai/v1alpha2` and still reads the older
//! `inference.networking.x-k8s.io/v1alpha2` group. kvpick watches both in the
//! pool's namespace (read-only: get, list, watch) and keeps the objectives whose
//! `spec.poolRef` names its pool; an unset `spec.priority` counts as 0, as llm-d
//! does. When both groups hold an objective of one name, `llm-d.ai` wins. A group
//! whose CRD is not installed simply contributes nothing.
//!
//! The request header `x-gateway-inference-objective` names an objective by
//! `metadata.name`; [`crate::admission::Objectives`] is the table this writes.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;

use futures::stream::{BoxStream, StreamExt};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, CustomResource, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::pool::GROUP_V1;
use crate::admission::Objectives;
use crate::error_chain::ErrorChain;

/// API group of the llm-d Router's InferenceObjective.
pub const GROUP_LLMD: &str = "llm-d.ai";
/// API group of the older (GIE) InferenceObjective.
pub const GROUP_X_K8S: &str = "inference.networking.x-k8s.io";

/// Specification of an InferenceObjective (`llm-d.ai/v1alpha2`).
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "llm-d.ai",
    version = "v1alpha2",
    kind = "InferenceObjective",
    plural = "inferenceobjectives",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Higher is served first; negative is sheddable; unset counts as 0.
    #[serde(default)]
    pub priority: Option<i32>,
    /// The pool the objective applies to (same namespace).
    #[serde(default)]
    pub pool_ref: PoolObjectReference,
}

/// Specification of the older `inference.networking.x-k8s.io/v1alpha2` InferenceObjective.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    root = "InferenceObjectiveXK8s",
    plural = "inferenceobjectives",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveXK8sSpec {
    /// Higher is served first; negative is sheddable; unset counts as 0.
    #[serde(default)]
    pub priority: Option<i32>,
    /// The pool the objective applies to (same namespace).
    #[serde(default)]
    pub pool_ref: PoolObjectReference,
}

/// Reference to an InferencePool.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
pub struct PoolObjectReference {
    /// Group of the pool (default `inference.networking.k8s.io`).
    #[serde(default = "pool_group")]
    pub group: String,
    /// Name of the pool.
    #[serde(default)]
    pub name: String,
}

impl Default for PoolObjectReference {
    fn default() -> Self {
        PoolObjectReference {
            group: pool_group(),
            name: String::new(),
        }
    }
}

fn pool_group() -> String {
    GROUP_V1.to_string()
}

/// What the watch needs from an objective of either group.
trait ObjectiveShape {
    fn pool_ref(&self) -> &PoolObjectReference;
    fn priority(&self) -> Option<i32>;
}

impl ObjectiveShape for InferenceObjective {
    fn pool_ref(&self) -> &PoolObjectReference {
        &self.spec.pool_ref
    }
    fn priority(&self) -> Option<i32> {
        self.spec.priority
    }
}

impl ObjectiveShape for InferenceObjectiveXK8s {
    fn pool_ref(&self) -> &PoolObjectReference {
        &self.spec.pool_ref
    }
    fn priority(&self) -> Option<i32> {
        self.spec.priority
    }
}

/// Which pool the objectives must reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    /// The pool's name.
    pub name: String,
    /// The pool's API group.
    pub group: String,
}

/// One objective reduced to what admission uses: `None` when it is not for our pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reduced(Option<i32>);

fn reduce(o: &impl ObjectiveShape, pool: &PoolRef) -> Reduced {
    let r = o.pool_ref();
    let ours = r.name == pool.name && r.group == pool.group;
    Reduced(ours.then(|| o.priority().unwrap_or(0)))
}

/// Which group an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Group {
    Llmd,
    XK8s,
}

/// Objectives seen per group, with the buffered state of a re-list.
#[derive(Debug, Default)]
struct State {
    seen: HashMap<Group, HashMap<String, Reduced>>,
    buffer: HashMap<Group, HashMap<String, Reduced>>,
}

impl State {
    fn apply(&mut self, group: Group, event: Event<(String, Reduced)>) {
        match event {
            Event::Init => {
                self.buffer.insert(group, HashMap::new());
            }
            Event::InitApply((name, r)) => {
                self.buffer.entry(group).or_default().insert(name, r);
            }
            Event::InitDone => {
                let listed = self.buffer.remove(&group).unwrap_or_default();
                self.seen.insert(group, listed);
            }
            Event::Apply((name, r)) => {
                self.seen.entry(group).or_default().insert(name, r);
            }
            Event::Delete((name, _)) => {
                if let Some(m) = self.seen.get_mut(&group) {
                    m.remove(&name);
                }
            }
        }
    }

    /// `base` overlaid with the older group's objectives, then llm-d's.
    fn table(&self, base: &HashMap<String, i32>) -> HashMap<String, i32> {
        let mut out = base.clone();
        for group in [Group::XK8s, Group::Llmd] {
            for (name, r) in self.seen.get(&group).into_iter().flatten() {
                if let Reduced(Some(p)) = r {
                    out.insert(name.clone(), *p);
                }
            }
        }
        out
    }
}

/// One watch event, an objective reduced to its name and what admission uses.
type WatchResult = Result<Event<(String, Reduced)>, watcher::Error>;

fn objective_stream<K>(
    api: Api<K>,
    group: Group,
    pool: PoolRef,
) -> BoxStream<'static, (Group, WatchResult)>
where
    K: Resource + ObjectiveShape + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .map(move |r| {
            let r = r.map(|ev| {
                let one = |k: K| (k.name_any(), reduce(&k, &pool));
                match ev {
                    Event::Apply(k) => Event::Apply(one(k)),
                    Event::Delete(k) => Event::Delete(one(k)),
                    Event::InitApply(k) => Event::InitApply(one(k)),
                    Event::Init => Event::Init,
                    Event::InitDone => Event::InitDone,
                }
            });
            (group, r)
        })
        .boxed()
}

/// Watches the InferenceObjectives of `namespace` that reference `pool` and keeps
/// `table` at `base` overlaid with their priorities, until the process ends.
pub async fn run(
    client: Client,
    namespace: String,
    pool: PoolRef,
    base: HashMap<String, i32>,
    table: Arc<Objectives>,
) {
    let llmd = objective_stream(
        Api::<InferenceObjective>::namespaced(client.clone(), &namespace),
        Group::Llmd,
        pool.clone(),
    );
    let legacy = objective_stream(
        Api::<InferenceObjectiveXK8s>::namespaced(client, &namespace),
        Group::XK8s,
        pool.clone(),
    );
    let mut events = futures::stream::select(llmd, legacy);
    let mut state = State::default();
    let mut failing: HashMap<Group, bool> = HashMap::new();
    info!(%namespace, pool = %pool.name, "watching InferenceObjectives");
    while let Some((group, event)) = events.next().await {
        match event {
            Ok(event) => {
                failing.insert(group, false);
                state.apply(group, event);
                let next = state.table(&base);
                debug!(objectives = next.len(), "objective priorities updated");
                table.replace(next);
            }
            Err(e) => {
                // A missing CRD fails every retry: say so once per failure streak.
                if !failing.insert(group, true).unwrap_or(false) {
                    warn!(?group, error = %ErrorChain(&e), "InferenceObjective watch failed; retrying");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use kube::client::Body;
    use std::convert::Infallible;
    use std::time::Duration;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::UnboundedReceiverStream;

    type Chunk = Result<Frame<Bytes>, Infallible>;
    type MockBody = StreamBody<UnboundedReceiverStream<Chunk>>;

    /// A fake API server: the llm-d group lists two objectives (one for another
    /// pool) and keeps its watch open; the older group's CRD is not installed (404).
    async fn fake_api(mut handle: tower_test::mock::Handle<Request<Body>, Response<MockBody>>) {
        let mut open_watches = Vec::new();
        while let Some((req, send)) = handle.next_request().await {
            let path = req.uri().path().to_string();
            let watch = req.uri().query().unwrap_or_default().contains("watch=true");
            let (tx, rx) = mpsc::unbounded_channel::<Chunk>();
            let body = StreamBody::new(UnboundedReceiverStream::new(rx));
            if path == "/apis/llm-d.ai/v1alpha2/namespaces/ns/inferenceobjectives" {
                if watch {
                    open_watches.push(tx);
                } else {
                    let item = |name: &str, pool: &str, prio: i32| {
                        serde_json::json!({
                            "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
                            "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
                            "spec": {"priority": prio, "poolRef": {"name": pool}}
                        })
                    };
                    let list = serde_json::json!({
                        "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjectiveList",
                        "metadata": {"resourceVersion": "1"},
                        "items": [item("chat", "p", 10), item("elsewhere", "q", 3)],
                    });
                    let _ = tx.send(Ok(Frame::data(Bytes::from(list.to_string()))));
                }
                send.send_response(Response::builder().body(body).unwrap());
            } else {
                assert_eq!(
                    path,
                    "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/ns/inferenceobjectives"
                );
                let status = serde_json::json!({"kind": "Status", "apiVersion": "v1",
                    "status": "Failure", "reason": "NotFound", "code": 404,
                    "message": "the server could not find the requested resource"});
                let _ = tx.send(Ok(Frame::data(Bytes::from(status.to_string()))));
                send.send_response(
                    Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .body(body)
                        .unwrap(),
                );
            }
        }
    }

    #[tokio::test]
    async fn the_watch_fills_the_table_even_when_one_group_is_not_installed() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<MockBody>>();
        let server = tokio::spawn(fake_api(handle));
        let client = Client::new(service, "ns");
        let table = Arc::new(Objectives::default());
        let base = HashMap::from([("batch".to_string(), -1)]);
        let watch = tokio::spawn(run(client, "ns".into(), pool(), base, Arc::clone(&table)));
        for _ in 0..200 {
            if table.priority("chat").is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(table.priority("chat"), Some(10));
        assert_eq!(table.priority("batch"), Some(-1));
        assert_eq!(table.priority("elsewhere"), None);
        watch.abort();
        server.abort();
    }

    #[test]
    fn rbac_grants_read_only_access_to_both_groups() {
        for text in [
            include_str!("../../manifests/rbac.yaml"),
            include_str!("../../charts/kvpick/templates/rbac.yaml"),
        ] {
            let rule = text
                .split("  - apiGroups:")
                .find(|r| r.contains("inferenceobjectives"))
                .expect("a rule for inferenceobjectives");
            assert!(
                rule.contains("\"llm-d.ai\"") && rule.contains("\"inference.networking.x-k8s.io\"")
            );
            assert!(
                rule.contains(r#"verbs: ["get", "list", "watch"]"#),
                "{rule}"
            );
        }
    }

    fn pool() -> PoolRef {
        PoolRef {
            name: "p".into(),
            group: GROUP_V1.into(),
        }
    }

    fn objective(name: &str, pool: &str, priority: Option<i32>) -> InferenceObjective {
        let mut o = InferenceObjective::new(
            name,
            InferenceObjectiveSpec {
                priority,
                pool_ref: PoolObjectReference {
                    group: GROUP_V1.into(),
                    name: pool.into(),
                },
            },
        );
        o.metadata.namespace = Some("ns".into());
        o
    }

    #[test]
    fn the_real_object_shape_deserialises() {
        // As in the llm-d Router's config/manifests/inferenceobjective.yaml.
        let o: InferenceObjective = serde_json::from_value(serde_json::json!({
            "apiVersion": "llm-d.ai/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "base-model", "namespace": "ns"},
            "spec": {"priority": 2, "poolRef": {"name": "p"}}
        }))
        .unwrap();
        assert_eq!(reduce(&o, &pool()), Reduced(Some(2)));
        let o: InferenceObjectiveXK8s = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "batch"},
            "spec": {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "p"}}
        }))
        .unwrap();
        assert_eq!(reduce(&o, &pool()), Reduced(Some(0)));
    }

    #[test]
    fn only_our_pools_objectives_count_and_llmd_wins() {
        let base = HashMap::from([("static".to_string(), 1), ("chat".to_string(), 1)]);
        let mut s = State::default();
        let ev = |o: InferenceObjective| (o.name_any(), reduce(&o, &pool()));
        s.apply(Group::Llmd, Event::Init);
        s.apply(
            Group::Llmd,
            Event::InitApply(ev(objective("chat", "p", Some(10)))),
        );
        s.apply(
            Group::Llmd,
            Event::InitApply(ev(objective("other", "q", Some(7)))),
        );
        s.apply(Group::Llmd, Event::InitDone);
        s.apply(Group::XK8s, Event::Apply(("chat".into(), Reduced(Some(3)))));
        s.apply(
            Group::XK8s,
            Event::Apply(("batch".into(), Reduced(Some(-1)))),
        );
        let t = s.table(&base);
        assert_eq!(t.get("chat"), Some(&10));
        assert_eq!(t.get("batch"), Some(&-1));
        assert_eq!(t.get("static"), Some(&1));
        assert_eq!(t.get("other"), None);
        s.apply(Group::XK8s, Event::Delete(("batch".into(), Reduced(None))));
        // A re-list replaces what the group held.
        s.apply(Group::Llmd, Event::Init);
        s.apply(Group::Llmd, Event::InitDone);
        let t = s.table(&base);
        assert_eq!(t.get("batch"), None);
        assert_eq!(t.get("chat"), Some(&3));
    }
}
