//! A test Kubernetes API server: list and watch for Pods (core v1) and
//! InferencePools (`inference.networking.k8s.io/v1`) from an in-memory state
//! that tests change, so kube-rs clients (reflectors, watchers) run over real HTTP.
//!
//! Supported: namespaced and cluster-wide list; `resourceVersion` on every object
//! and list; `?watch=true&resourceVersion=N` streaming JSON-lines watch events
//! (`ADDED`, `MODIFIED`, `DELETED`); `allowWatchBookmarks=true` → periodic
//! `BOOKMARK` events; streaming lists (`sendInitialEvents=true`, as client-go's
//! informers send by default): the current state as `ADDED` events, then a
//! `BOOKMARK` annotated `k8s.io/initial-events-end`, then the changes; an `ERROR` event with a 410 `Expired` status for a
//! resourceVersion older than the retained history (as the real API server does);
//! `timeoutSeconds`; `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`,
//! `k notin (a,b)`, comma = and) and `fieldSelector` (`path=v`, `path!=v` over
//! dotted JSON paths such as `metadata.name` or `status.phase`); legacy
//! (unaggregated) discovery of those two resources (`/api`, `/apis`, `/api/v1`,
//! `/apis/inference.networking.k8s.io/v1`), which client-go's REST mapper
//! reads before it lists. Not supported:
//! create/update/patch over HTTP, paging (`limit` is ignored and no `continue` is
//! returned), protobuf, authentication.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::serve::Server;

/// The resource kinds served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// core/v1 Pod.
    Pod,
    /// inference.networking.k8s.io/v1 InferencePool.
    InferencePool,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Pod => "v1",
            Kind::InferencePool => "inference.networking.k8s.io/v1",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::InferencePool => "InferencePool",
        }
    }
}

/// A change as watchers see it.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    /// The object before (`None` when created).
    before: Option<Value>,
    /// The object after (`None` when deleted).
    after: Option<Value>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Kind, String, String), Value>,
    history: Vec<Change>,
    /// Watches from a resourceVersion below this get 410 Gone.
    oldest: u64,
    next_uid: u64,
}

/// The shared state tests change.
pub struct ApiState {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    bookmark_every: Duration,
}

/// Why an object could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The object has no `metadata.name`.
    #[error("object has no metadata.name")]
    NoName,
    /// The listener could not bind.
    #[error("cannot bind {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
}

fn meta_str(obj: &Value, field: &str) -> Option<String> {
    obj.get("metadata")?
        .get(field)?
        .as_str()
        .map(str::to_string)
}

impl ApiState {
    fn new(bookmark_every: Duration) -> Self {
        ApiState {
            store: Mutex::new(Store {
                rv: 1,
                oldest: 1,
                ..Store::default()
            }),
            changes: broadcast::channel(1024).0,
            bookmark_every,
        }
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.store.lock().rv
    }

    /// Creates or replaces an object (namespace defaults to `default`); returns its new resourceVersion.
    pub fn apply(&self, kind: Kind, mut obj: Value) -> Result<u64, ApiError> {
        let name = meta_str(&obj, "name").ok_or(ApiError::NoName)?;
        let ns = meta_str(&obj, "namespace").unwrap_or_else(|| "default".into());
        let mut s = self.store.lock();
        s.rv += 1;
        let rv = s.rv;
        let key = (kind, ns.clone(), name);
        let before = s.objects.get(&key).cloned();
        let uid = match before.as_ref().and_then(|b| meta_str(b, "uid")) {
            Some(uid) => uid,
            None => {
                s.next_uid += 1;
                format!("00000000-0000-4000-8000-{:012x}", s.next_uid)
            }
        };
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.name());
        let meta = &mut obj["metadata"];
        meta["namespace"] = json!(ns);
        meta["resourceVersion"] = json!(rv.to_string());
        meta["uid"] = json!(uid);
        if meta.get("creationTimestamp").is_none() {
            meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        s.objects.insert(key, obj.clone());
        let change = Change {
            rv,
            kind,
            before,
            after: Some(obj),
        };
        s.history.push(change.clone());
        let _ = self.changes.send(change);
        Ok(rv)
    }

    /// Deletes an object; returns whether it existed.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        let mut s = self.store.lock();
        let Some(mut gone) = s
            .objects
            .remove(&(kind, namespace.to_string(), name.to_string()))
        else {
            return false;
        };
        s.rv += 1;
        let rv = s.rv;
        // Watchers get the object as it was at deletion, with the new version.
        gone["metadata"]["resourceVersion"] = json!(rv.to_string());
        let change = Change {
            rv,
            kind,
            before: Some(gone),
            after: None,
        };
        s.history.push(change.clone());
        let _ = self.changes.send(change);
        true
    }

    /// The stored object, if any.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        self.store
            .lock()
            .objects
            .get(&(kind, namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Sets a pod's Ready condition (and phase Running); returns false if there is no such pod.
    pub fn set_pod_ready(&self, namespace: &str, name: &str, ready: bool) -> bool {
        let Some(mut pod) = self.get(Kind::Pod, namespace, name) else {
            return false;
        };
        set_ready(&mut pod, ready);
        self.apply(Kind::Pod, pod).is_ok()
    }

    /// Forgets all history: watches from any older resourceVersion now get 410.
    pub fn compact(&self) {
        let mut s = self.store.lock();
        s.history.clear();
        s.oldest = s.rv;
    }
}

fn set_ready(pod: &mut Value, ready: bool) {
    let status = if ready { "True" } else { "False" };
    pod["status"]["phase"] = json!("Running");
    pod["status"]["conditions"] = json!([
        {"type": "Ready", "status": status},
        {"type": "ContainersReady", "status": status},
    ]);
}

/// A pod object: `ip` as its podIP, `labels`, `annotations`, Ready when `ready`.
pub fn pod(
    namespace: &str,
    name: &str,
    ip: &str,
    ready: bool,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> Value {
    let map = |kv: &[(&str, &str)]| -> serde_json::Map<String, Value> {
        kv.iter().map(|(k, v)| (k.to_string(), json!(v))).collect()
    };
    let mut p = json!({
        "metadata": {"name": name, "namespace": namespace,
                     "labels": map(labels), "annotations": map(annotations)},
        "spec": {"containers": [{"name": "worker", "image": "mock-worker"}]},
        "status": {"podIP": ip, "podIPs": [{"ip": ip}]},
    });
    set_ready(&mut p, ready);
    p
}

/// An InferencePool selecting pods by `selector` on `target_ports`, with its
/// endpoint picker at `epp_service:epp_port`.
pub fn inference_pool(
    namespace: &str,
    name: &str,
    selector: &[(&str, &str)],
    target_ports: &[u16],
    epp_service: &str,
    epp_port: u16,
) -> Value {
    let labels: serde_json::Map<String, Value> = selector
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": target_ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": epp_service, "port": {"number": epp_port}},
        },
    })
}

/// Seeds an InferencePool `pool` in `namespace` selecting `app=<pool>` on
/// `port`, and one Ready pod per worker (`<pool>-<i>`, pod IP = the worker's IP,
/// annotated with its `kvpick.io/instance-id`); every worker must listen on `port`.
pub fn seed_pool(
    state: &ApiState,
    namespace: &str,
    pool: &str,
    port: u16,
    workers: &[(SocketAddr, u64)],
) -> Result<(), ApiError> {
    state.apply(
        Kind::InferencePool,
        inference_pool(namespace, pool, &[("app", pool)], &[port], "kvpick", 9002),
    )?;
    for (i, (addr, id)) in workers.iter().enumerate() {
        let id = id.to_string();
        state.apply(
            Kind::Pod,
            pod(
                namespace,
                &format!("{pool}-{i}"),
                &addr.ip().to_string(),
                true,
                &[("app", pool)],
                &[("kvpick.io/instance-id", &id)],
            ),
        )?;
    }
    Ok(())
}

/// Writes a kubeconfig pointing at `server` (e.g. `http://127.0.0.1:PORT`) with
/// `namespace` as the context's default namespace and no credentials.
pub fn write_kubeconfig(path: &Path, server: &str, namespace: &str) -> std::io::Result<()> {
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {server}\n\
         users:\n- name: e2e\n  user: {{}}\ncontexts:\n- name: e2e\n  context:\n    cluster: e2e\n    \
         user: e2e\n    namespace: {namespace}\ncurrent-context: e2e\n"
    );
    std::fs::write(path, yaml)
}

/// A running test API server.
pub struct ApiServer {
    state: Arc<ApiState>,
    server: Server,
}

impl ApiServer {
    /// Starts on `addr`; watchers that allow bookmarks get one every `bookmark_every`.
    pub async fn start(addr: SocketAddr, bookmark_every: Duration) -> Result<Self, ApiError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| ApiError::Bind(addr, e))?;
        let state = Arc::new(ApiState::new(bookmark_every));
        let pools = "/apis/inference.networking.k8s.io/v1";
        let router = Router::new()
            .route("/api", get(|| async { Json(discovery::core_versions()) }))
            .route("/apis", get(|| async { Json(discovery::groups()) }))
            .route("/api/v1", get(|| async { Json(discovery::core_v1()) }))
            .route(pools, get(|| async { Json(discovery::pools_v1()) }))
            .route("/api/v1/pods", get(list_all_pods))
            .route("/api/v1/namespaces/{ns}/pods", get(list_pods))
            .route(&format!("{pools}/inferencepools"), get(list_all_pools))
            .route(
                &format!("{pools}/namespaces/{{ns}}/inferencepools"),
                get(list_pools),
            )
            .with_state(Arc::clone(&state));
        Ok(ApiServer {
            state,
            server: Server::start(listener, router),
        })
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// The state to change.
    pub fn state(&self) -> &Arc<ApiState> {
        &self.state
    }

    /// Serves until aborted.
    pub async fn wait(self) {
        self.server.wait().await;
    }
}

/// Legacy discovery documents of the served resources.
mod discovery {
    use serde_json::{json, Value};

    const POOL_GROUP: &str = "inference.networking.k8s.io";

    fn resource(name: &str, kind: &str) -> Value {
        json!({"name": name, "singularName": "", "namespaced": true, "kind": kind,
               "verbs": ["get", "list", "watch"]})
    }

    /// `/api`: the core group's versions.
    pub fn core_versions() -> Value {
        json!({"kind": "APIVersions", "versions": ["v1"],
               "serverAddressByClientCIDRs": []})
    }

    /// `/apis`: the named groups.
    pub fn groups() -> Value {
        let v1 = json!({"groupVersion": format!("{POOL_GROUP}/v1"), "version": "v1"});
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": POOL_GROUP, "versions": [v1.clone()], "preferredVersion": v1},
        ]})
    }

    /// `/api/v1`: Pods.
    pub fn core_v1() -> Value {
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
               "resources": [resource("pods", "Pod")]})
    }

    /// `/apis/inference.networking.k8s.io/v1`: InferencePools.
    pub fn pools_v1() -> Value {
        json!({"kind": "APIResourceList", "apiVersion": "v1",
               "groupVersion": format!("{POOL_GROUP}/v1"),
               "resources": [resource("inferencepools", "InferencePool")]})
    }
}

/// List and watch query parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    #[serde(default)]
    watch: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    allow_watch_bookmarks: Option<bool>,
    #[serde(default)]
    label_selector: Option<String>,
    #[serde(default)]
    field_selector: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<u64>,
    #[serde(default)]
    send_initial_events: Option<bool>,
}

type ApiResult = Response;

async fn list_all_pods(s: State<Arc<ApiState>>, q: Query<ListQuery>) -> ApiResult {
    list_or_watch(s.0, Kind::Pod, None, q.0)
}
async fn list_pods(s: State<Arc<ApiState>>, ns: UrlPath<String>, q: Query<ListQuery>) -> ApiResult {
    list_or_watch(s.0, Kind::Pod, Some(ns.0), q.0)
}
async fn list_all_pools(s: State<Arc<ApiState>>, q: Query<ListQuery>) -> ApiResult {
    list_or_watch(s.0, Kind::InferencePool, None, q.0)
}
async fn list_pools(
    s: State<Arc<ApiState>>,
    ns: UrlPath<String>,
    q: Query<ListQuery>,
) -> ApiResult {
    list_or_watch(s.0, Kind::InferencePool, Some(ns.0), q.0)
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn bad_request(message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(status(400, "BadRequest", &message)),
    )
        .into_response()
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Absent(String),
}

/// Splits on commas outside parentheses.
fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_labels(sel: &str) -> Result<Vec<LabelReq>, String> {
    let set = |v: &str| -> Result<Vec<String>, String> {
        let v = v.trim();
        let inner = v
            .strip_prefix('(')
            .and_then(|v| v.strip_suffix(')'))
            .ok_or_else(|| format!("bad value set {v:?}"))?;
        Ok(inner.split(',').map(|x| x.trim().to_string()).collect())
    };
    split_top(sel)
        .into_iter()
        .map(|p| {
            if let Some((k, v)) = p.split_once("!=") {
                Ok(LabelReq::Ne(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Ok(LabelReq::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = p.split_once(" notin ") {
                Ok(LabelReq::NotIn(k.trim().into(), set(v)?))
            } else if let Some((k, v)) = p.split_once(" in ") {
                Ok(LabelReq::In(k.trim().into(), set(v)?))
            } else if let Some(k) = p.strip_prefix('!') {
                Ok(LabelReq::Absent(k.trim().into()))
            } else if p.chars().all(|c| c.is_alphanumeric() || "-_./".contains(c)) {
                Ok(LabelReq::Exists(p))
            } else {
                Err(format!("unsupported label selector term {p:?}"))
            }
        })
        .collect()
}

fn labels_match(obj: &Value, reqs: &[LabelReq]) -> bool {
    let label = |k: &str| obj["metadata"]["labels"].get(k).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
        LabelReq::Ne(k, v) => label(k) != Some(v.as_str()),
        LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        LabelReq::NotIn(k, vs) => !label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        LabelReq::Exists(k) => label(k).is_some(),
        LabelReq::Absent(k) => label(k).is_none(),
    })
}

fn parse_fields(sel: &str) -> Result<Vec<(String, bool, String)>, String> {
    split_top(sel)
        .into_iter()
        .map(|p| {
            if let Some((k, v)) = p.split_once("!=") {
                Ok((k.trim().into(), false, v.trim().into()))
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Ok((k.trim().into(), true, v.trim().into()))
            } else {
                Err(format!("unsupported field selector term {p:?}"))
            }
        })
        .collect()
}

fn fields_match(obj: &Value, reqs: &[(String, bool, String)]) -> bool {
    reqs.iter().all(|(path, eq, want)| {
        let got = path
            .split('.')
            .try_fold(obj, |v, k| v.get(k))
            .map(|v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
            .unwrap_or_default();
        (got == *want) == *eq
    })
}

/// What a list or watch selects.
struct Filter {
    kind: Kind,
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<(String, bool, String)>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        self.namespace
            .as_ref()
            .is_none_or(|ns| meta_str(obj, "namespace").as_deref() == Some(ns))
            && labels_match(obj, &self.labels)
            && fields_match(obj, &self.fields)
    }

    /// The watch event a change makes for this filter, if any.
    fn event(&self, c: &Change) -> Option<Value> {
        if c.kind != self.kind {
            return None;
        }
        let was = c.before.as_ref().is_some_and(|o| self.matches(o));
        let is = c.after.as_ref().is_some_and(|o| self.matches(o));
        let (kind, obj) = match (was, is, &c.after, &c.before) {
            (false, true, Some(after), _) => ("ADDED", after),
            (true, true, Some(after), _) => ("MODIFIED", after),
            // Deleted, or no longer selected: the watcher sees it go.
            (true, false, Some(after), _) => ("DELETED", after),
            (true, false, None, Some(before)) => ("DELETED", before),
            _ => return None,
        };
        Some(json!({"type": kind, "object": obj}))
    }
}

fn list_or_watch(
    state: Arc<ApiState>,
    kind: Kind,
    namespace: Option<String>,
    q: ListQuery,
) -> Response {
    let labels = match parse_labels(q.label_selector.as_deref().unwrap_or("")) {
        Ok(l) => l,
        Err(e) => return bad_request(e),
    };
    let fields = match parse_fields(q.field_selector.as_deref().unwrap_or("")) {
        Ok(f) => f,
        Err(e) => return bad_request(e),
    };
    let filter = Filter {
        kind,
        namespace,
        labels,
        fields,
    };
    let since = match q.resource_version.as_deref().filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => match v.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => return bad_request(format!("invalid resourceVersion {v:?}")),
        },
    };
    if matches!(q.watch.as_deref(), Some("true" | "1")) {
        return watch(state, filter, since, &q);
    }
    let s = state.store.lock();
    let items: Vec<&Value> = s
        .objects
        .iter()
        .filter(|((k, _, _), obj)| *k == kind && filter.matches(obj))
        .map(|(_, obj)| obj)
        .collect();
    Json(json!({
        "kind": format!("{}List", kind.name()),
        "apiVersion": kind.api_version(),
        "metadata": {"resourceVersion": s.rv.to_string()},
        "items": items,
    }))
    .into_response()
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn watch(state: Arc<ApiState>, filter: Filter, since: Option<u64>, q: &ListQuery) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let bookmarks = q.allow_watch_bookmarks.unwrap_or(false);
    let timeout = Duration::from_secs(q.timeout_seconds.unwrap_or(1800).max(1));
    // Subscribe and take the backlog under one lock, so no change is lost or doubled.
    let (mut changes, backlog, expired) = {
        let s = state.store.lock();
        let changes = state.changes.subscribe();
        let initial = || {
            s.objects
                .iter()
                .filter(|((k, _, _), o)| *k == filter.kind && filter.matches(o))
                .map(|(_, o)| json!({"type": "ADDED", "object": o}))
                .collect::<Vec<Value>>()
        };
        match since {
            // A streaming list: the state now, then the end-of-list bookmark.
            _ if q.send_initial_events == Some(true) => {
                let mut backlog = initial();
                backlog.push(json!({"type": "BOOKMARK", "object": {
                    "kind": filter.kind.name(), "apiVersion": filter.kind.api_version(),
                    "metadata": {"resourceVersion": s.rv.to_string(),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}}));
                (changes, backlog, false)
            }
            // No version or "0": start with the current state as ADDED events.
            None | Some(0) => (changes, initial(), false),
            Some(rv) if rv < s.oldest => (changes, Vec::new(), true),
            Some(rv) => {
                let backlog = s
                    .history
                    .iter()
                    .filter(|c| c.rv > rv)
                    .filter_map(|c| filter.event(c))
                    .collect();
                (changes, backlog, false)
            }
        }
    };
    let every = state.bookmark_every;
    tokio::spawn(async move {
        if expired {
            let _ = tx
                .send(line(&json!({"type": "ERROR",
                    "object": status(410, "Expired", "too old resource version")})))
                .await;
            return;
        }
        for ev in backlog {
            if tx.send(line(&ev)).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                _ = tick.tick(), if bookmarks => {
                    let rv = state.resource_version();
                    let bm = json!({"type": "BOOKMARK", "object": {
                        "kind": filter.kind.name(), "apiVersion": filter.kind.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()}}});
                    if tx.send(line(&bm)).await.is_err() { return; }
                }
                change = changes.recv() => match change {
                    Ok(c) => {
                        if let Some(ev) = filter.event(&c) {
                            if tx.send(line(&ev)).await.is_err() { return; }
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(line(&json!({"type": "ERROR",
                            "object": status(410, "Expired", "watch fell behind")}))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    });
    let body = Body::from_stream(ReceiverStream::new(rx).map(Ok::<_, Infallible>));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors() {
        let p = pod(
            "ns",
            "a",
            "10.0.0.1",
            true,
            &[("app", "vllm"), ("tier", "gpu")],
            &[],
        );
        let m = |s: &str| labels_match(&p, &parse_labels(s).unwrap());
        assert!(m("app=vllm"));
        assert!(m("app==vllm,tier"));
        assert!(!m("app!=vllm"));
        assert!(m("app in (sglang, vllm),!missing"));
        assert!(!m("tier notin (gpu)"));
        assert!(m(""));
        assert!(parse_labels("a b c").is_err());
    }

    #[test]
    fn field_selectors() {
        let p = pod("ns", "a", "10.0.0.1", true, &[], &[]);
        let m = |s: &str| fields_match(&p, &parse_fields(s).unwrap());
        assert!(m("metadata.name=a,status.phase=Running"));
        assert!(!m("metadata.name!=a"));
        assert!(m("status.podIP=10.0.0.1"));
    }

    #[test]
    fn changes_leaving_a_selection_become_deletes() {
        let state = ApiState::new(Duration::from_secs(1));
        let filter = Filter {
            kind: Kind::Pod,
            namespace: Some("ns".into()),
            labels: parse_labels("app=vllm").unwrap(),
            fields: vec![],
        };
        let mut rx = state.changes.subscribe();
        state
            .apply(
                Kind::Pod,
                pod("ns", "a", "10.0.0.1", true, &[("app", "vllm")], &[]),
            )
            .unwrap();
        state
            .apply(
                Kind::Pod,
                pod("ns", "a", "10.0.0.1", true, &[("app", "other")], &[]),
            )
            .unwrap();
        assert!(state.delete(Kind::Pod, "ns", "a"));
        let kinds: Vec<Option<String>> = (0..3)
            .map(|_| {
                filter
                    .event(&rx.try_recv().unwrap())
                    .map(|e| e["type"].as_str().unwrap().to_string())
            })
            .collect();
        assert_eq!(
            kinds,
            vec![Some("ADDED".into()), Some("DELETED".into()), None]
        );
    }
}
