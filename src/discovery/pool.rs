//! The InferencePool custom resource (Gateway API Inference Extension) as Rust types.
//!
//! [`InferencePool`] is the `inference.networking.k8s.io/v1` shape kvpick's client reads.
//! The CRD kvpick installs is GIE's own ([`CRD_YAML`], shipped verbatim from a pinned
//! release, [`CRD_SOURCE`]); tests keep the Rust types within its schema.
//! [`InferencePoolV1Alpha2`] reads the older `inference.networking.x-k8s.io/v1alpha2`
//! shape (`targetPortNumber`, plain selector map) when `--pool-group` names it.
//! Both deserialise leniently: unknown fields are ignored and malformed optional
//! parts fall back to their defaults instead of failing the whole object.
//! [`PoolTarget`] is what discovery needs from either: a label selector and ports.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// API group of the current InferencePool.
pub const GROUP_V1: &str = "inference.networking.k8s.io";
/// API group of the older (v1alpha2) InferencePool.
pub const GROUP_V1ALPHA2: &str = "inference.networking.x-k8s.io";

/// Deserialises `T`, or `T::default()` when the value does not fit (lenient reading).
fn lenient<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned + Default,
{
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).unwrap_or_default())
}

/// Specification of an InferencePool (`inference.networking.k8s.io/v1`).
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced,
    status = "InferencePoolStatus",
    doc = "InferencePool is the Schema for the InferencePools API: a pool of model-server pods behind one endpoint picker."
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = require_selector_and_ports)]
pub struct InferencePoolSpec {
    /// Which pods (in the pool's namespace) belong to the pool.
    #[serde(default, deserialize_with = "lenient")]
    pub selector: LabelSelector,
    /// Ports the model servers listen on; one endpoint per pod and port.
    #[serde(default, deserialize_with = "lenient")]
    #[schemars(length(min = 1, max = 8))]
    pub target_ports: Vec<Port>,
    /// Protocol of the model servers (`http` or `kubernetes.io/h2c`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub app_protocol: Option<String>,
    /// The endpoint picker extension serving this pool.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// Schema of the spec as the API server should validate it: `selector` and
/// `targetPorts` are required there, although kvpick reads objects without them.
fn require_selector_and_ports(schema: &mut schemars::Schema) {
    const REQUIRED: [&str; 2] = ["selector", "targetPorts"];
    if let Some(props) = schema.get_mut("properties").and_then(|p| p.as_object_mut()) {
        for name in REQUIRED {
            if let Some(p) = props.get_mut(name).and_then(|p| p.as_object_mut()) {
                p.remove("default");
            }
        }
    }
    schema.insert("required".into(), serde_json::json!(REQUIRED));
}

/// A label selector of which only `matchLabels` is used.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a pod must carry (all of them) to be in the pool.
    #[serde(default, deserialize_with = "lenient")]
    pub match_labels: BTreeMap<String, String>,
}

/// A port number.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct Port {
    /// The port, 1-65535.
    #[schemars(range(min = 1, max = 65535))]
    pub number: i32,
}

/// Reference to the endpoint picker (a Service) the gateway calls for this pool.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// Kind of the referent (default `Service`).
    #[serde(default = "service_kind")]
    pub kind: String,
    /// Name of the referent.
    pub name: String,
    /// Port of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
    /// What the gateway does when the picker is unavailable.
    #[serde(default, deserialize_with = "lenient")]
    pub failure_mode: FailureMode,
}

fn service_kind() -> String {
    "Service".to_string()
}

/// What the gateway does when the endpoint picker cannot be reached.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FailureMode {
    /// Route to any endpoint of the pool.
    FailOpen,
    /// Fail the request (the default).
    #[default]
    FailClose,
}

/// Status of an InferencePool, written by the gateways that reference it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct InferencePoolStatus {
    /// One entry per parent (Gateway) that references the pool.
    #[serde(default, deserialize_with = "lenient")]
    pub parents: Vec<ParentStatus>,
}

/// The pool's status as one parent sees it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    /// The parent (usually a Gateway).
    #[serde(default, deserialize_with = "lenient")]
    pub parent_ref: ParentReference,
    /// Conditions such as `Accepted` and `ResolvedRefs`.
    #[serde(default, deserialize_with = "lenient")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

/// Reference to a parent object.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ParentReference {
    /// API group of the parent.
    #[serde(default)]
    pub group: String,
    /// Kind of the parent.
    #[serde(default)]
    pub kind: String,
    /// Name of the parent.
    #[serde(default)]
    pub name: String,
    /// Namespace of the parent, when not the pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Specification of the older `inference.networking.x-k8s.io/v1alpha2` InferencePool.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferencePool",
    root = "InferencePoolV1Alpha2",
    plural = "inferencepools",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolV1Alpha2Spec {
    /// Labels a pod must carry (all of them) to be in the pool.
    #[serde(default, deserialize_with = "lenient")]
    pub selector: BTreeMap<String, String>,
    /// The single port the model servers listen on.
    #[serde(default, deserialize_with = "lenient")]
    pub target_port_number: Option<i32>,
}

/// What discovery needs from a pool of either shape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolTarget {
    /// Labels a pod must carry (all of them); empty selects nothing.
    pub selector: BTreeMap<String, String>,
    /// Valid target ports, in order, without duplicates.
    pub target_ports: Vec<u16>,
}

impl PoolTarget {
    /// A target from a selector and raw port numbers; numbers outside 1-65535 and
    /// duplicates are dropped.
    pub fn new(selector: BTreeMap<String, String>, ports: impl IntoIterator<Item = i32>) -> Self {
        let mut target_ports: Vec<u16> = Vec::new();
        for p in ports {
            if let Ok(p) = u16::try_from(p) {
                if p != 0 && !target_ports.contains(&p) {
                    target_ports.push(p);
                }
            }
        }
        PoolTarget {
            selector,
            target_ports,
        }
    }
}

/// A pool object discovery can watch.
pub trait PoolShape {
    /// The selector and ports this pool describes.
    fn target(&self) -> PoolTarget;
}

impl PoolShape for InferencePool {
    fn target(&self) -> PoolTarget {
        PoolTarget::new(
            self.spec.selector.match_labels.clone(),
            self.spec.target_ports.iter().map(|p| p.number),
        )
    }
}

impl PoolShape for InferencePoolV1Alpha2 {
    fn target(&self) -> PoolTarget {
        PoolTarget::new(self.spec.selector.clone(), self.spec.target_port_number)
    }
}

/// Where [`CRD_YAML`] comes from: GIE's own InferencePool CRD at a pinned release.
pub const CRD_SOURCE: &str = "kubernetes-sigs/gateway-api-inference-extension v1.5.0 \
config/crd/bases/inference.networking.k8s.io_inferencepools.yaml";

/// SHA-256 of the upstream file at [`CRD_SOURCE`]; a test holds the shipped copy to it.
pub const CRD_SHA256: &str = "0bc3ddd94db6f588a5cecc627c39e3d12b4343d51c48d47ffa68c50fa73c290c";

/// GIE's InferencePool CRD, verbatim (`manifests/crds/inferencepool.yaml`); `kvpick crd`
/// prints it.
pub const CRD_YAML: &str = include_str!("../../manifests/crds/inferencepool.yaml");

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped_crd() -> serde_json::Value {
        serde_yaml::from_str(CRD_YAML).expect("the shipped CRD is YAML")
    }

    #[test]
    fn shipped_crd_is_the_pinned_upstream_file() {
        use sha2::{Digest, Sha256};
        let digest: String = Sha256::digest(CRD_YAML.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            digest, CRD_SHA256,
            "manifests/crds/inferencepool.yaml differs from {CRD_SOURCE}"
        );
    }

    #[test]
    fn shipped_crd_carries_the_api_approval_of_its_protected_group() {
        let crd = shipped_crd();
        assert_eq!(crd["spec"]["group"], GROUP_V1);
        assert!(crd["metadata"]["annotations"]["api-approved.kubernetes.io"]
            .as_str()
            .is_some_and(|url| url.contains("gateway-api-inference-extension")));
        assert_eq!(crd["spec"]["names"]["listKind"], "InferencePoolList");
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "infpool");
    }

    /// Every property the kube-rs type declares exists, at the same path, in GIE's schema,
    /// so what kvpick's client reads or writes is what the API server stores.
    #[test]
    fn rust_types_stay_within_the_shipped_schema() {
        use kube::CustomResourceExt;
        fn walk(ours: &serde_json::Value, theirs: &serde_json::Value, path: &str) {
            let Some(props) = ours.get("properties").and_then(|p| p.as_object()) else {
                if let Some(items) = ours.get("items") {
                    walk(items, &theirs["items"], &format!("{path}[]"));
                }
                return;
            };
            for (name, schema) in props {
                let upstream = &theirs["properties"][name];
                assert!(
                    !upstream.is_null(),
                    "{path}.{name} is not in GIE's InferencePool schema"
                );
                walk(schema, upstream, &format!("{path}.{name}"));
            }
        }
        let ours = serde_json::to_value(InferencePool::crd()).unwrap();
        let ours = &ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let theirs = shipped_crd();
        let theirs = &theirs["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        assert!(!ours["properties"]["spec"]["properties"]
            .as_object()
            .unwrap()
            .is_empty());
        walk(ours, theirs, "");
    }

    /// The InferencePools of GIE's own v1.5.0 conformance suite (valid under its CRD by
    /// construction) read into the Rust type with nothing lost that discovery needs.
    #[test]
    fn gie_conformance_pools_read_into_the_rust_type() {
        let text = include_str!("../../tests/fixtures/gie-v1.5.0/inferencepools.yaml");
        let mut read = 0;
        for doc in serde_yaml::Deserializer::from_str(text) {
            let value = serde_json::Value::deserialize(doc).unwrap();
            if value.is_null() {
                continue;
            }
            let pool: InferencePool = serde_json::from_value(value.clone()).unwrap();
            let target = pool.target();
            let ports = value["spec"]["targetPorts"].as_array().unwrap();
            assert_eq!(target.target_ports.len(), ports.len());
            let labels = value["spec"]["selector"]["matchLabels"]
                .as_object()
                .unwrap();
            assert_eq!(target.selector.len(), labels.len());
            let epp = pool
                .spec
                .endpoint_picker_ref
                .expect("every pool names its EPP");
            assert_eq!(
                epp.name,
                value["spec"]["endpointPickerRef"]["name"].as_str().unwrap()
            );
            read += 1;
        }
        assert!(read >= 5, "only {read} pools in the fixture");
    }

    #[test]
    fn v1_reads_full_object_and_ignores_unknown_fields() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}, "matchExpressions": []},
                "targetPorts": [{"number": 8000}, {"number": 8001}, {"number": 8000}],
                "appProtocol": "http",
                "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}, "failureMode": "FailOpen"},
                "somethingNew": true
            },
            "status": {"parents": [{"parentRef": {"name": "gw", "kind": "Gateway"},
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                  "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}]}
        }))
        .unwrap();
        let epp = pool.spec.endpoint_picker_ref.clone().unwrap();
        assert_eq!(epp.kind, "Service");
        assert_eq!(epp.failure_mode, FailureMode::FailOpen);
        assert_eq!(
            pool.status.as_ref().unwrap().parents[0].conditions[0].type_,
            "Accepted"
        );
        let t = pool.target();
        assert_eq!(t.selector.get("app").map(String::as_str), Some("vllm"));
        assert_eq!(t.target_ports, vec![8000, 8001]);
    }

    #[test]
    fn v1_malformed_parts_fall_back_to_defaults() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "selector": "not-an-object",
                "targetPorts": [{"number": 70000}, {"number": 0}, {"number": 8000}],
                "endpointPickerRef": {"name": "x", "failureMode": "Sometimes"},
                "appProtocol": 5
            },
            "status": {"parents": "bogus"}
        }))
        .unwrap();
        assert!(pool.spec.selector.match_labels.is_empty());
        assert_eq!(pool.spec.app_protocol, None);
        assert_eq!(
            pool.spec.endpoint_picker_ref.as_ref().unwrap().failure_mode,
            FailureMode::FailClose
        );
        assert_eq!(pool.target().target_ports, vec![8000]);
        // A missing spec body still deserialises (to an empty pool).
        let empty: InferencePool =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": {}}))
                .unwrap();
        assert_eq!(empty.target(), PoolTarget::default());
    }

    #[test]
    fn v1alpha2_shape() {
        let pool: InferencePoolV1Alpha2 = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {"selector": {"app": "sglang"}, "targetPortNumber": 30000,
                     "extensionRef": {"name": "epp"}}
        }))
        .unwrap();
        let t = pool.target();
        assert_eq!(t.target_ports, vec![30000]);
        assert_eq!(t.selector.get("app").map(String::as_str), Some("sglang"));
    }
}
