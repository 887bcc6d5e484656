//! Pure mapping from Pods and a pool to endpoints: readiness and worker identity.
//!
//! A pod yields endpoints when it carries every selector label, its `Ready`
//! condition is `True`, it has a pod IP and it is not terminating (no
//! `deletionTimestamp`). It then yields one endpoint per target port. Identity
//! comes from the pod (see `docs/discovery.md`):
//!
//! | source | meaning | default |
//! | --- | --- | --- |
//! | annotation `kvpick.io/instance-id` | decimal u64 instance id | FNV-1a-53 of `namespace/name` |
//! | annotation `kvpick.io/dp-size` | data-parallel ranks, 1-1024 | 1 |
//! | label `kvpick.io/role` | `prefill`, `decode`, `both` | `both` |
//! | label `inference.networking.k8s.io/engine-type` | `vllm`, `sglang`, `trtllm` | `vllm` |
//! | annotation `kvpick.io/kv-events-port` | KV-event publisher port | none |
//! | annotation `kvpick.io/bootstrap-port` | disaggregation bootstrap port | none (the scheduler uses `--sglang-bootstrap-port`, 8998, for `sglang` pods) |
//!
//! With several target ports, the first port's endpoint has the pod's instance id
//! and each further port `p` has the hash of `namespace/name:p`, so every endpoint
//! is its own worker. Bad values fall back to the default and produce a warning.
//! An instance id already taken by an older pod (or an earlier port) falls back
//! to the default too, with a warning naming both pods.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;

use super::pool::PoolTarget;
use crate::endpoints::{Endpoint, Engine, Role};
use crate::identity::instance_id_for;

/// Annotation with an explicit instance id.
pub const INSTANCE_ID_ANNOTATION: &str = "kvpick.io/instance-id";
/// Annotation with the data-parallel size.
pub const DP_SIZE_ANNOTATION: &str = "kvpick.io/dp-size";
/// Label with the worker role.
pub const ROLE_LABEL: &str = "kvpick.io/role";
/// Label with the engine type (GIE's name).
pub const ENGINE_LABEL: &str = "inference.networking.k8s.io/engine-type";
/// Annotation with the KV-event publisher port.
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvpick.io/kv-events-port";
/// Annotation with the disaggregation bootstrap port.
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "kvpick.io/bootstrap-port";
/// Largest accepted `kvpick.io/dp-size`.
pub const MAX_DP_SIZE: u32 = crate::endpoints::MAX_DP_SIZE;

/// The endpoints of a set of pods, with warnings about values that were ignored.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Mapped {
    /// Endpoints of the ready, selected pods.
    pub endpoints: Vec<Endpoint>,
    /// One line per ignored (malformed) value, naming the pod.
    pub warnings: Vec<String>,
}

/// Whether `labels` carries every `selector` label; an empty selector selects nothing.
pub fn selects(
    selector: &BTreeMap<String, String>,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    if selector.is_empty() {
        return false;
    }
    let Some(labels) = labels else { return false };
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Whether the pod can take traffic: Ready=True, has an IP, not terminating.
pub fn is_ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(status) = &pod.status else {
        return false;
    };
    let has_ip = status.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty());
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    has_ip && ready
}

/// Endpoints of all selected, ready pods, sorted by address. Instance ids are
/// unique in the result: see [`dedup_instance_ids`].
pub fn pool_endpoints<'a>(pods: impl IntoIterator<Item = &'a Pod>, pool: &PoolTarget) -> Mapped {
    let mut pods: Vec<&Pod> = pods.into_iter().collect();
    // Oldest first (then by name), so which pod keeps a contested id does not
    // depend on the order the watch delivered them in.
    pods.sort_by(|a, b| {
        let key = |p: &'a Pod| {
            let m = &p.metadata;
            (
                m.creation_timestamp.as_ref().map(|t| t.0),
                &m.namespace,
                &m.name,
            )
        };
        key(a).cmp(&key(b))
    });
    let mut out = Mapped::default();
    for pod in pods {
        out.endpoints
            .extend(pod_endpoints(pod, pool, &mut out.warnings));
    }
    dedup_instance_ids(&mut out);
    out.endpoints.sort_by_key(|e| e.address);
    out
}

/// Two endpoints with one instance id would share a KV index, a load and
/// session bindings. In order (oldest pod first), the first keeps the id; a
/// later one falls back to the hash of its pod (then of its pod and port), with
/// a warning; one whose fallbacks are taken too is left out.
fn dedup_instance_ids(out: &mut Mapped) {
    let mut owner: HashMap<u64, String> = HashMap::with_capacity(out.endpoints.len());
    let warnings = &mut out.warnings;
    out.endpoints.retain_mut(|e| {
        if let Entry::Vacant(v) = owner.entry(e.instance_id) {
            v.insert(e.name.clone());
            return true;
        }
        let first = &owner[&e.instance_id];
        let fallbacks = [
            instance_id_for(&e.name),
            instance_id_for(&format!("{}:{}", e.name, e.address.port())),
        ];
        let Some(id) = fallbacks.into_iter().find(|id| !owner.contains_key(id)) else {
            warnings.push(format!(
                "pod {}: {INSTANCE_ID_ANNOTATION} {} is already pod {first}'s and no fallback id is free; {} left out",
                e.name, e.instance_id, e.address
            ));
            return false;
        };
        warnings.push(format!(
            "pod {}: {INSTANCE_ID_ANNOTATION} {} is already pod {first}'s; {} uses {id}",
            e.name, e.instance_id, e.address
        ));
        e.instance_id = id;
        owner.insert(id, e.name.clone());
        true
    });
}

/// Endpoints of one pod (none unless selected and ready); malformed values are
/// replaced by defaults and described in `warnings`.
pub fn pod_endpoints(pod: &Pod, pool: &PoolTarget, warnings: &mut Vec<String>) -> Vec<Endpoint> {
    if !selects(&pool.selector, pod.metadata.labels.as_ref()) || !is_ready(pod) {
        return Vec::new();
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = format!(
        "{namespace}/{}",
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    let ip_text = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .unwrap_or_default();
    let ip: IpAddr = match ip_text.parse() {
        Ok(ip) => ip,
        Err(_) => {
            warnings.push(format!(
                "pod {name}: pod IP {ip_text:?} is not an IP address; skipped"
            ));
            return Vec::new();
        }
    };
    let annotations = pod.metadata.annotations.as_ref();
    let labels = pod.metadata.labels.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
    let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
    let mut warn = |key: &str, value: &str, default: &str| {
        warnings.push(format!(
            "pod {name}: {key}={value:?} is not valid; using {default}"
        ))
    };

    let base_id = match annotation(INSTANCE_ID_ANNOTATION) {
        None => instance_id_for(&name),
        Some(v) => v.trim().parse::<u64>().unwrap_or_else(|_| {
            warn(INSTANCE_ID_ANNOTATION, v, "the hash of namespace/name");
            instance_id_for(&name)
        }),
    };
    let dp_size = match annotation(DP_SIZE_ANNOTATION) {
        None => 1,
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n) if (1..=MAX_DP_SIZE).contains(&n) => n,
            _ => {
                warn(DP_SIZE_ANNOTATION, v, "1");
                1
            }
        },
    };
    let role = match label(ROLE_LABEL) {
        None => Role::Both,
        Some(v) => Role::parse(v).unwrap_or_else(|| {
            warn(ROLE_LABEL, v, "both");
            Role::Both
        }),
    };
    let engine = match label(ENGINE_LABEL) {
        None => Engine::Vllm,
        Some(v) => Engine::parse(v).unwrap_or_else(|| {
            warn(ENGINE_LABEL, v, "vllm");
            Engine::Vllm
        }),
    };
    let mut port = |key: &str| -> Option<u16> {
        let v = annotation(key)?;
        match v.trim().parse::<u16>() {
            Ok(p) if p != 0 => Some(p),
            _ => {
                warn(key, v, "none");
                None
            }
        }
    };
    let kv_events_port = port(KV_EVENTS_PORT_ANNOTATION);
    let bootstrap_port = port(BOOTSTRAP_PORT_ANNOTATION);

    pool.target_ports
        .iter()
        .enumerate()
        .map(|(i, &p)| Endpoint {
            address: SocketAddr::new(ip, p),
            instance_id: if i == 0 {
                base_id
            } else {
                instance_id_for(&format!("{name}:{p}"))
            },
            dp_size,
            role,
            engine,
            name: name.clone(),
            kv_events_port,
            bootstrap_port,
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    /// A pod in `ns` with `labels`, the given readiness and IP.
    pub(crate) fn pod(name: &str, labels: &[(&str, &str)], ready: bool, ip: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some("ns".to_string()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            spec: None,
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_string),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_string(),
                    status: if ready { "True" } else { "False" }.to_string(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    fn annotate(mut p: Pod, kv: &[(&str, &str)]) -> Pod {
        p.metadata.annotations = Some(
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        p
    }

    fn pool(ports: &[i32]) -> PoolTarget {
        PoolTarget::new(
            [("app".to_string(), "vllm".to_string())].into(),
            ports.iter().copied(),
        )
    }

    const APP: (&str, &str) = ("app", "vllm");

    #[test]
    fn ready_selected_pod_yields_default_identity() {
        let p = pod("w-0", &[APP, ("other", "x")], true, Some("10.0.0.5"));
        let m = pool_endpoints([&p], &pool(&[8000]));
        assert!(m.warnings.is_empty());
        assert_eq!(m.endpoints.len(), 1);
        let e = &m.endpoints[0];
        assert_eq!(e.address.to_string(), "10.0.0.5:8000");
        assert_eq!(e.instance_id, instance_id_for("ns/w-0"));
        assert_eq!(e.name, "ns/w-0");
        assert_eq!((e.dp_size, e.role, e.engine), (1, Role::Both, Engine::Vllm));
        assert_eq!((e.kv_events_port, e.bootstrap_port), (None, None));
    }

    #[test]
    fn unready_states_yield_nothing() {
        let pl = pool(&[8000]);
        let not_ready = pod("a", &[APP], false, Some("10.0.0.1"));
        let no_ip = pod("b", &[APP], true, None);
        let empty_ip = pod("c", &[APP], true, Some(""));
        let mut terminating = pod("d", &[APP], true, Some("10.0.0.4"));
        terminating.metadata.deletion_timestamp = Some(Time(Default::default()));
        let mut no_status = pod("e", &[APP], true, Some("10.0.0.5"));
        no_status.status = None;
        let mut no_conditions = pod("f", &[APP], true, Some("10.0.0.6"));
        no_conditions.status.as_mut().unwrap().conditions = None;
        let mut other_condition_true = pod("g", &[APP], false, Some("10.0.0.7"));
        other_condition_true
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(PodCondition {
                type_: "ContainersReady".into(),
                status: "True".into(),
                ..Default::default()
            });
        let pods = [
            not_ready,
            no_ip,
            empty_ip,
            terminating,
            no_status,
            no_conditions,
            other_condition_true,
        ];
        for p in &pods {
            assert!(
                pod_endpoints(p, &pl, &mut Vec::new()).is_empty(),
                "{:?} should not be an endpoint",
                p.metadata.name
            );
        }
        assert!(pool_endpoints(&pods, &pl).endpoints.is_empty());
    }

    #[test]
    fn selector_must_match_every_label() {
        let pl = PoolTarget::new(
            [("app".into(), "vllm".into()), ("tier".into(), "gpu".into())].into(),
            [8000],
        );
        let partial = pod("a", &[APP], true, Some("10.0.0.1"));
        let wrong_value = pod(
            "b",
            &[("app", "vllm"), ("tier", "cpu")],
            true,
            Some("10.0.0.2"),
        );
        let no_labels = {
            let mut p = pod("c", &[], true, Some("10.0.0.3"));
            p.metadata.labels = None;
            p
        };
        let full = pod(
            "d",
            &[("app", "vllm"), ("tier", "gpu")],
            true,
            Some("10.0.0.4"),
        );
        let m = pool_endpoints([&partial, &wrong_value, &no_labels, &full], &pl);
        assert_eq!(m.endpoints.len(), 1);
        assert_eq!(m.endpoints[0].name, "ns/d");
        // An empty selector selects nothing rather than the whole namespace.
        let empty = PoolTarget::new(BTreeMap::new(), [8000]);
        assert!(pool_endpoints([&full], &empty).endpoints.is_empty());
    }

    #[test]
    fn one_endpoint_per_port_with_distinct_ids() {
        let p = pod("w", &[APP], true, Some("10.0.0.9"));
        let m = pool_endpoints([&p], &pool(&[8001, 8000, 8002]));
        let addrs: Vec<String> = m.endpoints.iter().map(|e| e.address.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.9:8000", "10.0.0.9:8001", "10.0.0.9:8002"]);
        let id = |port: u16| {
            m.endpoints
                .iter()
                .find(|e| e.address.port() == port)
                .unwrap()
                .instance_id
        };
        // The first listed port keeps the pod's id; the others hash `ns/name:port`.
        assert_eq!(id(8001), instance_id_for("ns/w"));
        assert_eq!(id(8000), instance_id_for("ns/w:8000"));
        assert_eq!(id(8002), instance_id_for("ns/w:8002"));
        // No ports, no endpoints.
        assert!(pool_endpoints([&p], &pool(&[])).endpoints.is_empty());
    }

    #[test]
    fn ipv6_pod_ip() {
        let p = pod("w", &[APP], true, Some("fd00::5"));
        let m = pool_endpoints([&p], &pool(&[8000]));
        assert_eq!(m.endpoints[0].address.to_string(), "[fd00::5]:8000");
    }

    #[test]
    fn annotations_and_labels_set_identity() {
        let p = annotate(
            pod(
                "w",
                &[APP, (ROLE_LABEL, "prefill"), (ENGINE_LABEL, "SGLang")],
                true,
                Some("10.0.0.2"),
            ),
            &[
                (INSTANCE_ID_ANNOTATION, "7001"),
                (DP_SIZE_ANNOTATION, " 4 "),
                (KV_EVENTS_PORT_ANNOTATION, "5557"),
                (BOOTSTRAP_PORT_ANNOTATION, "8998"),
            ],
        );
        let m = pool_endpoints([&p], &pool(&[30000]));
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let e = &m.endpoints[0];
        assert_eq!(e.instance_id, 7001);
        assert_eq!(e.dp_size, 4);
        assert_eq!(e.role, Role::Prefill);
        assert_eq!(e.engine, Engine::Sglang);
        assert_eq!(e.kv_events_port, Some(5557));
        assert_eq!(e.bootstrap_port, Some(8998));
    }

    #[test]
    fn bad_values_fall_back_to_defaults_with_warnings() {
        let p = annotate(
            pod(
                "w",
                &[APP, (ROLE_LABEL, "leader"), (ENGINE_LABEL, "tgi")],
                true,
                Some("10.0.0.3"),
            ),
            &[
                (INSTANCE_ID_ANNOTATION, "-1"),
                (DP_SIZE_ANNOTATION, "0"),
                (KV_EVENTS_PORT_ANNOTATION, "70000"),
                (BOOTSTRAP_PORT_ANNOTATION, "abc"),
            ],
        );
        let m = pool_endpoints([&p], &pool(&[8000]));
        let e = &m.endpoints[0];
        assert_eq!(e.instance_id, instance_id_for("ns/w"));
        assert_eq!((e.dp_size, e.role, e.engine), (1, Role::Both, Engine::Vllm));
        assert_eq!((e.kv_events_port, e.bootstrap_port), (None, None));
        assert_eq!(m.warnings.len(), 6, "{:?}", m.warnings);
        for key in [
            INSTANCE_ID_ANNOTATION,
            DP_SIZE_ANNOTATION,
            ROLE_LABEL,
            ENGINE_LABEL,
            KV_EVENTS_PORT_ANNOTATION,
            BOOTSTRAP_PORT_ANNOTATION,
        ] {
            assert!(
                m.warnings
                    .iter()
                    .any(|w| w.contains(key) && w.contains("ns/w")),
                "no warning for {key}"
            );
        }
        let huge = annotate(
            pod("x", &[APP], true, Some("10.0.0.4")),
            &[(DP_SIZE_ANNOTATION, "5000")],
        );
        let m = pool_endpoints([&huge], &pool(&[8000]));
        assert_eq!((m.endpoints[0].dp_size, m.warnings.len()), (1, 1));
    }

    #[test]
    fn bad_pod_ip_is_skipped_with_warning() {
        let p = pod("w", &[APP], true, Some("not-an-ip"));
        let m = pool_endpoints([&p], &pool(&[8000]));
        assert!(m.endpoints.is_empty());
        assert_eq!(m.warnings.len(), 1);
    }
}

#[cfg(test)]
mod duplicate_id_tests {
    use super::tests::pod;
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn with_id(name: &str, ip: &str, id: &str, created_secs: i64) -> Pod {
        let mut p = pod(name, &[("app", "vllm")], true, Some(ip));
        p.metadata.annotations =
            Some([(INSTANCE_ID_ANNOTATION.to_string(), id.to_string())].into());
        p.metadata.creation_timestamp = Some(Time(
            k8s_openapi::chrono::DateTime::from_timestamp(created_secs, 0).unwrap(),
        ));
        p
    }

    fn pool(ports: &[i32]) -> PoolTarget {
        PoolTarget::new(
            [("app".to_string(), "vllm".to_string())].into(),
            ports.iter().copied(),
        )
    }

    #[test]
    fn a_duplicate_instance_id_stays_with_the_older_pod_and_the_newer_one_falls_back() {
        let old = with_id("old", "10.0.0.1", "7001", 100);
        let new = with_id("new", "10.0.0.2", "7001", 200);
        for order in [[&old, &new], [&new, &old]] {
            let m = pool_endpoints(order, &pool(&[8000]));
            let ids: Vec<(String, u64)> = m
                .endpoints
                .iter()
                .map(|e| (e.name.clone(), e.instance_id))
                .collect();
            assert_eq!(
                ids,
                [
                    ("ns/old".to_string(), 7001),
                    ("ns/new".to_string(), instance_id_for("ns/new"))
                ]
            );
            assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
            let w = &m.warnings[0];
            assert!(
                w.contains("ns/new") && w.contains("ns/old") && w.contains("7001"),
                "{w}"
            );
        }
    }

    #[test]
    fn ids_stay_unique_when_an_annotation_takes_another_pods_default() {
        // `b` claims the id `a` has by default, and `c` claims `b`'s default too.
        let a = pod("a", &[("app", "vllm")], true, Some("10.0.0.1"));
        let b = with_id("b", "10.0.0.2", &instance_id_for("ns/a").to_string(), 0);
        let c = with_id("c", "10.0.0.3", &instance_id_for("ns/b").to_string(), 0);
        let m = pool_endpoints([&a, &b, &c], &pool(&[8000, 8001]));
        let mut ids: Vec<u64> = m.endpoints.iter().map(|e| e.instance_id).collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!((ids.len(), n), (6, 6), "{:?}", m.warnings);
        assert!(!m.warnings.is_empty());
    }
}
