//! Kubernetes discovery: watches the InferencePool and the Pods of its namespace
//! through kube-rs watchers and publishes the ready endpoints to the
//! [`EndpointTable`].
//!
//! - Pool mode (`--pool-name`): one watcher on the named InferencePool (v1, or
//!   v1alpha2 when `--pool-group` names the older group) and one on all Pods of the
//!   namespace. The selector is applied locally, so selector and port edits on the
//!   pool take effect at once, without restarting a watch.
//! - Selector mode (`--endpoint-selector`): no pool; one Pod watcher with the
//!   selector as a server-side label selector and the `--endpoint-target-ports`.
//!
//! Nothing is published before the first complete list of both (the table's first
//! `replace` marks it synced, which turns gRPC health SERVING). A re-list after a
//! watch error is buffered and swapped in whole, so it never flaps the table. When
//! the API server is lost, the last published set stays in place and the watchers
//! retry with kube's default backoff (0.8 s doubling to 30 s, jittered).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;

use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use super::pods::pool_endpoints;
use super::pool::{
    InferencePool, InferencePoolV1Alpha2, PoolShape, PoolTarget, GROUP_V1, GROUP_V1ALPHA2,
};
use crate::endpoints::{Endpoint, EndpointTable};
use crate::error_chain::ErrorChain;

/// Why Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// `--pool-group` names a group kvpick does not read.
    #[error("unsupported --pool-group {0:?} (expected {GROUP_V1} or {GROUP_V1ALPHA2})")]
    UnsupportedGroup(String),
    /// `--endpoint-selector` is malformed.
    #[error("invalid --endpoint-selector {0:?}: expected key=value[,key=value...]")]
    BadSelector(String),
    /// `--endpoint-target-ports` is malformed.
    #[error("invalid --endpoint-target-ports {0:?}: expected port[,port...] with ports 1-65535")]
    BadPorts(String),
    /// Both watch streams ended (they never do while the process lives).
    #[error("Kubernetes watch streams ended")]
    StreamsEnded,
}

/// Which InferencePool API shape to watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolGroup {
    /// `inference.networking.k8s.io/v1`.
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2`.
    V1Alpha2,
}

impl PoolGroup {
    /// The shape `--pool-group` names.
    pub fn parse(group: &str) -> Result<PoolGroup, KubeError> {
        match group.trim() {
            "" | GROUP_V1 => Ok(PoolGroup::V1),
            GROUP_V1ALPHA2 => Ok(PoolGroup::V1Alpha2),
            other => Err(KubeError::UnsupportedGroup(other.to_string())),
        }
    }
}

/// What to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An InferencePool by name.
    Pool {
        /// The pool's name.
        name: String,
        /// The pool's API shape.
        group: PoolGroup,
    },
    /// Pods matching a fixed selector, without a pool.
    Selector(PoolTarget),
}

impl Source {
    /// Selector mode from the `--endpoint-selector` and `--endpoint-target-ports` strings.
    pub fn selector(selector: &str, ports: &str) -> Result<Source, KubeError> {
        let mut labels = BTreeMap::new();
        for pair in selector.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| KubeError::BadSelector(selector.to_string()))?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() {
                return Err(KubeError::BadSelector(selector.to_string()));
            }
            labels.insert(k.to_string(), v.to_string());
        }
        if labels.is_empty() {
            return Err(KubeError::BadSelector(selector.to_string()));
        }
        let mut numbers = Vec::new();
        for p in ports.split(',').filter(|p| !p.trim().is_empty()) {
            match p.trim().parse::<u16>() {
                Ok(n) if n != 0 => numbers.push(i32::from(n)),
                _ => return Err(KubeError::BadPorts(ports.to_string())),
            }
        }
        if numbers.is_empty() {
            return Err(KubeError::BadPorts(ports.to_string()));
        }
        Ok(Source::Selector(PoolTarget::new(labels, numbers)))
    }
}

/// One event from either watcher, with the pool already reduced to its target.
#[derive(Debug)]
enum Update {
    Pool(Event<PoolTarget>),
    Pods(Box<Event<Pod>>),
}

/// The state both watchers build up, and the last set published from it.
#[derive(Debug, Default)]
struct State {
    pool: Option<PoolTarget>,
    pool_buffer: Option<PoolTarget>,
    pool_synced: bool,
    pods: HashMap<String, Pod>,
    pods_buffer: HashMap<String, Pod>,
    pods_synced: bool,
    published: Option<Vec<Endpoint>>,
    warned: HashSet<String>,
}

impl State {
    fn apply(&mut self, update: Update) {
        match update {
            Update::Pool(ev) => match ev {
                Event::Init => self.pool_buffer = None,
                Event::InitApply(t) => self.pool_buffer = Some(t),
                Event::InitDone => {
                    self.pool = self.pool_buffer.take();
                    self.pool_synced = true;
                }
                Event::Apply(t) => self.pool = Some(t),
                Event::Delete(_) => self.pool = None,
            },
            Update::Pods(ev) => match *ev {
                Event::Init => self.pods_buffer.clear(),
                Event::InitApply(p) => {
                    self.pods_buffer.insert(p.name_any(), p);
                }
                Event::InitDone => {
                    self.pods = std::mem::take(&mut self.pods_buffer);
                    self.pods_synced = true;
                }
                Event::Apply(p) => {
                    self.pods.insert(p.name_any(), p);
                }
                Event::Delete(p) => {
                    self.pods.remove(&p.name_any());
                }
            },
        }
    }

    /// The endpoint set to publish now, if it is complete and differs from the last.
    fn take_changed_set(&mut self) -> Option<Vec<Endpoint>> {
        if !(self.pool_synced && self.pods_synced) {
            return None;
        }
        // Before the first publish, wait for the pool to exist: an EPP whose pool
        // is missing is not ready. After that, a deleted pool empties the set.
        if self.pool.is_none() && self.published.is_none() {
            return None;
        }
        let mapped = match &self.pool {
            Some(pool) => pool_endpoints(self.pods.values(), pool),
            None => Default::default(),
        };
        let current: HashSet<String> = mapped.warnings.iter().cloned().collect();
        for w in &mapped.warnings {
            if !self.warned.contains(w) {
                warn!("{w}");
            }
        }
        self.warned = current;
        if self.published.as_ref() == Some(&mapped.endpoints) {
            return None;
        }
        self.published = Some(mapped.endpoints.clone());
        Some(mapped.endpoints)
    }
}

fn pool_stream<K>(api: Api<K>, name: &str) -> BoxStream<'static, Result<Update, watcher::Error>>
where
    K: Resource + PoolShape + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    watcher::watcher(api, config)
        .default_backoff()
        .map(|r| {
            r.map(|ev| {
                Update::Pool(match ev {
                    Event::Apply(k) => Event::Apply(k.target()),
                    Event::Delete(k) => Event::Delete(k.target()),
                    Event::InitApply(k) => Event::InitApply(k.target()),
                    Event::Init => Event::Init,
                    Event::InitDone => Event::InitDone,
                })
            })
        })
        .boxed()
}

fn label_selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Watches `source` in `namespace` and publishes its ready endpoints to `table`
/// until the process ends. Watch errors are logged and retried with backoff; the
/// last published set stays in place meanwhile.
pub async fn run(
    client: Client,
    namespace: &str,
    source: Source,
    table: Arc<EndpointTable>,
) -> Result<(), KubeError> {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut state = State::default();
    let (pool_updates, pods_config) = match &source {
        Source::Pool { name, group } => {
            let pools = match group {
                PoolGroup::V1 => pool_stream(
                    Api::<InferencePool>::namespaced(client.clone(), namespace),
                    name,
                ),
                PoolGroup::V1Alpha2 => pool_stream(
                    Api::<InferencePoolV1Alpha2>::namespaced(client.clone(), namespace),
                    name,
                ),
            };
            (pools, watcher::Config::default())
        }
        Source::Selector(target) => {
            state.pool = Some(target.clone());
            state.pool_synced = true;
            let config = watcher::Config::default().labels(&label_selector(&target.selector));
            (futures::stream::pending().boxed(), config)
        }
    };
    let pod_updates = watcher::watcher(pods_api, pods_config)
        .default_backoff()
        .map(|r| r.map(|ev| Update::Pods(Box::new(ev))))
        .boxed();
    let mut updates = futures::stream::select(pool_updates, pod_updates);
    info!(namespace, ?source, "watching Kubernetes for endpoints");
    while let Some(update) = updates.next().await {
        match update {
            Ok(update) => {
                state.apply(update);
                if let Some(endpoints) = state.take_changed_set() {
                    let count = endpoints.len();
                    let removed = table.replace(endpoints);
                    debug!(
                        endpoints = count,
                        removed = removed.len(),
                        "endpoint set changed"
                    );
                    if !removed.is_empty() {
                        info!(
                            endpoints = count,
                            removed = ?removed.iter().map(|e| e.address_string()).collect::<Vec<_>>(),
                            "endpoints left the pool"
                        );
                    }
                }
            }
            Err(e) => {
                warn!(error = %ErrorChain(&e), "Kubernetes watch failed; serving the last known endpoints and retrying")
            }
        }
    }
    Err(KubeError::StreamsEnded)
}

#[cfg(test)]
mod tests;
