//! Checks of the deployment files that need neither a cluster nor Helm.
//!
//! - Every YAML document under `manifests/` (except `manifests/crds/`, tested
//!   with the CRD generator) deserialises into its k8s-openapi type and
//!   serialises back to the same value, so a misspelt field fails; Gateway API
//!   and InferencePool objects, which k8s-openapi lacks, get field checks.
//! - References between the objects resolve: Service and InferencePool
//!   selectors match pods, endpointPickerRef names a Service port, routes name
//!   a Gateway and a pool, pool workers carry valid identity labels/annotations.
//! - The chart's `values.yaml` (and the `ci/` overlays) validate against
//!   `values.schema.json`; deliberately bad overlays are rejected at the right
//!   place; every `.Values.x.y` a template reads exists in `values.yaml`, and
//!   every value is read by some template.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, PodTemplateSpec, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use regex::Regex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

const POOL_API_VERSION: &str = "inference.networking.k8s.io/v1";
const GATEWAY_API_VERSION: &str = "gateway.networking.k8s.io/v1";
const ENVOY_GATEWAY_CONTROLLER: &str = "gateway.envoyproxy.io/gatewayclass-controller";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One YAML document and the file it came from.
#[derive(Debug, Clone)]
struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }
    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }
    fn at(&self) -> String {
        format!("{} {}/{}", self.file, self.kind(), self.name())
    }
}

/// All non-empty documents of a YAML text, as JSON values.
fn parse_documents(text: &str, file: &str) -> Vec<Doc> {
    serde_yaml::Deserializer::from_str(text)
        .map(|de| Value::deserialize(de).unwrap_or_else(|e| panic!("{file}: not valid YAML: {e}")))
        .filter(|v| !v.is_null())
        .map(|value| Doc {
            file: file.to_string(),
            value,
        })
        .collect()
}

/// YAML files under `dir`, recursively, skipping `skip` sub-directories.
fn yaml_files(dir: &Path, skip: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            if !skip.contains(&name.as_str()) {
                out.extend(yaml_files(&path, skip));
            }
        } else if name.ends_with(".yaml") || name.ends_with(".yml") {
            out.push(path);
        }
    }
    out
}

/// Every document of every file under `manifests/` except `crds/`.
fn manifest_docs() -> Vec<Doc> {
    let dir = root().join("manifests");
    let mut docs = Vec::new();
    for path in yaml_files(&dir, &["crds"]) {
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        let text = fs::read_to_string(&path).unwrap();
        let found = parse_documents(&text, &rel);
        assert!(!found.is_empty(), "{rel}: no YAML documents");
        docs.extend(found);
    }
    docs
}

/// The first place where `actual` differs from `expected`, as a JSON path.
fn first_difference(expected: &Value, actual: &Value, path: &str) -> Option<String> {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            for key in e.keys().chain(a.keys()).collect::<BTreeSet<_>>() {
                let p = format!("{path}.{key}");
                match (e.get(key), a.get(key)) {
                    (Some(ev), Some(av)) => {
                        if let Some(d) = first_difference(ev, av, &p) {
                            return Some(d);
                        }
                    }
                    (Some(_), None) => return Some(format!("{p} (dropped: unknown field?)")),
                    (None, Some(_)) => return Some(format!("{p} (added)")),
                    (None, None) => unreachable!(),
                }
            }
            None
        }
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => e
            .iter()
            .zip(a)
            .enumerate()
            .find_map(|(i, (ev, av))| first_difference(ev, av, &format!("{path}[{i}]"))),
        _ if expected == actual => None,
        _ => Some(format!("{path}: {expected} != {actual}")),
    }
}

/// Deserialises `doc` into `T` and checks that serialising it gives the same
/// value back: k8s-openapi ignores unknown fields, so a typo shows up here.
fn typed<T: DeserializeOwned + Serialize>(doc: &Doc) -> T {
    let obj: T = serde_json::from_value(doc.value.clone())
        .unwrap_or_else(|e| panic!("{}: does not deserialise: {e}", doc.at()));
    let back = serde_json::to_value(&obj).unwrap();
    if let Some(diff) = first_difference(&doc.value, &back, "") {
        panic!(
            "{}: round trip through k8s-openapi differs at {diff}",
            doc.at()
        );
    }
    obj
}

fn str_at<'a>(v: &'a Value, pointer: &str, at: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| panic!("{at}: missing string {pointer}"))
}

fn labels_match(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn pod_labels(t: &PodTemplateSpec) -> BTreeMap<String, String> {
    t.metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

fn container_ports(t: &PodTemplateSpec) -> BTreeSet<i32> {
    t.spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .map(|p| p.container_port)
        .collect()
}

/// The hardened pod settings every Deployment here promises.
fn check_pod_hardening(d: &Deployment, at: &str) {
    let spec = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let pod_sc = spec.security_context.as_ref();
    assert_eq!(
        pod_sc.and_then(|s| s.run_as_non_root),
        Some(true),
        "{at}: pod must set runAsNonRoot"
    );
    assert_eq!(
        pod_sc
            .and_then(|s| s.seccomp_profile.as_ref())
            .map(|p| p.type_.as_str()),
        Some("RuntimeDefault"),
        "{at}: seccomp RuntimeDefault"
    );
    for c in &spec.containers {
        let sc = c
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: container {} has no securityContext", c.name));
        assert_eq!(
            sc.allow_privilege_escalation,
            Some(false),
            "{at}: {}",
            c.name
        );
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{at}: {}", c.name);
        let drops = sc.capabilities.as_ref().and_then(|c| c.drop.clone());
        assert_eq!(drops, Some(vec!["ALL".to_string()]), "{at}: {}", c.name);
    }
}

/// kvpick's own container: GIE ports, gRPC probes, downward-API env, pool flag.
fn check_kvpick_container(d: &Deployment, at: &str, pools: &BTreeSet<String>) {
    let spec = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = &spec.containers[0];
    let ports = container_ports(&d.spec.as_ref().unwrap().template);
    for p in [9002, 9003, 9090] {
        assert!(ports.contains(&p), "{at}: kvpick must expose port {p}");
    }
    for (probe, service) in [
        (&c.liveness_probe, "liveness"),
        (&c.readiness_probe, "readiness"),
    ] {
        let grpc = probe
            .as_ref()
            .and_then(|p| p.grpc.as_ref())
            .unwrap_or_else(|| panic!("{at}: {service} probe must be gRPC"));
        assert_eq!(grpc.port, 9003, "{at}: {service} probe port");
        assert_eq!(
            grpc.service.as_deref(),
            Some(service),
            "{at}: probe service"
        );
    }
    for (var, field) in [
        ("NAMESPACE", "metadata.namespace"),
        ("POD_NAME", "metadata.name"),
    ] {
        let env = c.env.iter().flatten().find(|e| e.name == var);
        let path = env
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        assert_eq!(path, Some(field), "{at}: env {var} from the downward API");
    }
    let args = c.args.clone().unwrap_or_default();
    let pool = args
        .iter()
        .find_map(|a| a.strip_prefix("--pool-name="))
        .unwrap_or_else(|| panic!("{at}: kvpick needs --pool-name"));
    assert!(
        pools.contains(pool),
        "{at}: --pool-name={pool} names no InferencePool here"
    );
    for a in &args {
        assert!(a.starts_with("--"), "{at}: argument {a:?} is not a flag");
    }
}

/// Identity labels and annotations of a pool's worker pods (DESIGN.md).
fn check_worker_identity(t: &PodTemplateSpec, at: &str) {
    let meta = t.metadata.as_ref().unwrap();
    let labels = meta.labels.clone().unwrap_or_default();
    let ann = meta.annotations.clone().unwrap_or_default();
    if let Some(role) = labels.get("kvpick.io/role") {
        assert!(
            ["prefill", "decode", "both"].contains(&role.as_str()),
            "{at}: role {role}"
        );
    }
    if let Some(engine) = labels.get("inference.networking.k8s.io/engine-type") {
        assert!(
            ["vllm", "sglang", "trtllm"].contains(&engine.as_str()),
            "{at}: engine {engine}"
        );
    }
    if let Some(dp) = ann.get("kvpick.io/dp-size") {
        let n: u32 = dp
            .parse()
            .unwrap_or_else(|_| panic!("{at}: dp-size {dp:?}"));
        assert!(n >= 1, "{at}: dp-size must be at least 1");
    }
    for key in ["kvpick.io/kv-events-port", "kvpick.io/bootstrap-port"] {
        if let Some(p) = ann.get(key) {
            let n: u16 = p.parse().unwrap_or_else(|_| panic!("{at}: {key} {p:?}"));
            assert!(n >= 1, "{at}: {key} must be a port");
        }
    }
    if let Some(id) = ann.get("kvpick.io/instance-id") {
        id.parse::<u64>()
            .unwrap_or_else(|_| panic!("{at}: instance-id {id:?} is not a u64"));
    }
}

/// The set of objects under manifests/, typed where k8s-openapi has the type.
#[derive(Default)]
struct Objects {
    deployments: Vec<(String, Deployment)>,
    services: Vec<(String, Service)>,
    pools: Vec<Doc>,
    gateway_classes: Vec<Doc>,
    gateways: Vec<Doc>,
    routes: Vec<Doc>,
}

fn load_objects() -> Objects {
    let mut o = Objects::default();
    for doc in manifest_docs() {
        let api = doc.value["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match (api.as_str(), doc.kind()) {
            ("kustomize.config.k8s.io/v1beta1", "Kustomization") => {}
            ("apps/v1", "Deployment") => o.deployments.push((doc.at(), typed(&doc))),
            ("v1", "Service") => o.services.push((doc.at(), typed(&doc))),
            ("v1", "ServiceAccount") => drop(typed::<ServiceAccount>(&doc)),
            ("v1", "ConfigMap") => drop(typed::<ConfigMap>(&doc)),
            ("v1", "Secret") => drop(typed::<Secret>(&doc)),
            ("rbac.authorization.k8s.io/v1", "Role") => drop(typed::<Role>(&doc)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => drop(typed::<RoleBinding>(&doc)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => drop(typed::<ClusterRole>(&doc)),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                drop(typed::<ClusterRoleBinding>(&doc))
            }
            ("policy/v1", "PodDisruptionBudget") => drop(typed::<PodDisruptionBudget>(&doc)),
            (POOL_API_VERSION, "InferencePool") => o.pools.push(doc),
            (GATEWAY_API_VERSION, "GatewayClass") => o.gateway_classes.push(doc),
            (GATEWAY_API_VERSION, "Gateway") => o.gateways.push(doc),
            (GATEWAY_API_VERSION, "HTTPRoute") => o.routes.push(doc),
            (api, kind) => panic!("{}: unexpected object {api} {kind}", doc.file),
        }
    }
    o
}

#[test]
fn every_manifest_is_a_known_object_and_round_trips() {
    let o = load_objects();
    assert!(o.deployments.len() >= 3, "kvpick and the mock workers");
    assert!(!o.services.is_empty() && !o.pools.is_empty() && !o.routes.is_empty());
    for (at, d) in &o.deployments {
        check_pod_hardening(d, at);
    }
}

#[test]
fn kvpick_deployments_follow_the_gie_conventions() {
    let o = load_objects();
    let pools: BTreeSet<String> = o.pools.iter().map(|p| p.name().to_string()).collect();
    let kvpicks: Vec<_> = o
        .deployments
        .iter()
        .filter(|(_, d)| {
            let spec = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
            spec.containers[0].name == "kvpick"
        })
        .collect();
    assert!(!kvpicks.is_empty(), "no kvpick Deployment under manifests/");
    for (at, d) in kvpicks {
        check_kvpick_container(d, at, &pools);
    }
}

#[test]
fn services_select_pods_that_serve_their_ports() {
    let o = load_objects();
    for (at, svc) in &o.services {
        let spec = svc.spec.as_ref().unwrap();
        let selector = spec.selector.clone().unwrap_or_default();
        let backing: Vec<_> = o
            .deployments
            .iter()
            .filter(|(_, d)| {
                labels_match(&selector, &pod_labels(&d.spec.as_ref().unwrap().template))
            })
            .collect();
        assert!(!backing.is_empty(), "{at}: selector matches no Deployment");
        for (_, d) in backing {
            let t = &d.spec.as_ref().unwrap().template;
            let named: BTreeSet<String> = t
                .spec
                .iter()
                .flat_map(|s| &s.containers)
                .flat_map(|c| c.ports.iter().flatten())
                .filter_map(|p| p.name.clone())
                .collect();
            for port in spec.ports.iter().flatten() {
                use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
                match &port.target_port {
                    Some(IntOrString::String(n)) => {
                        assert!(named.contains(n), "{at}: targetPort {n} not on the pods")
                    }
                    Some(IntOrString::Int(n)) => {
                        assert!(container_ports(t).contains(n), "{at}: targetPort {n}")
                    }
                    None => assert!(container_ports(t).contains(&port.port), "{at}"),
                }
            }
        }
    }
}

#[test]
fn inference_pools_are_complete_and_resolve() {
    let o = load_objects();
    for pool in &o.pools {
        let at = pool.at();
        let spec = &pool.value["spec"];
        let selector: BTreeMap<String, String> =
            serde_json::from_value(spec["selector"]["matchLabels"].clone())
                .unwrap_or_else(|e| panic!("{at}: selector.matchLabels: {e}"));
        assert!(!selector.is_empty(), "{at}: empty selector");
        let ports: Vec<i64> = spec["targetPorts"]
            .as_array()
            .unwrap_or_else(|| panic!("{at}: targetPorts"))
            .iter()
            .map(|p| p["number"].as_i64().unwrap_or(-1))
            .collect();
        assert!((1..=8).contains(&ports.len()), "{at}: 1 to 8 targetPorts");
        assert!(
            ports.iter().all(|p| (1..=65535).contains(p)),
            "{at}: {ports:?}"
        );
        assert_eq!(
            ports.iter().collect::<BTreeSet<_>>().len(),
            ports.len(),
            "{at}: unique"
        );
        if let Some(proto) = spec.get("appProtocol") {
            assert!(
                proto == "http" || proto == "kubernetes.io/h2c",
                "{at}: {proto}"
            );
        }

        // endpointPickerRef → a Service here with that port, speaking HTTP/2.
        let epp = &spec["endpointPickerRef"];
        let svc_name = str_at(epp, "/name", &at);
        let mode = epp
            .get("failureMode")
            .and_then(Value::as_str)
            .unwrap_or("FailClose");
        assert!(
            mode == "FailClose" || mode == "FailOpen",
            "{at}: failureMode {mode}"
        );
        assert!(matches!(
            epp.get("kind").and_then(Value::as_str),
            None | Some("Service")
        ));
        let port = epp["port"]["number"]
            .as_i64()
            .unwrap_or_else(|| panic!("{at}: endpointPickerRef.port.number is required"));
        let (_, svc) = o
            .services
            .iter()
            .find(|(_, s)| s.metadata.name.as_deref() == Some(svc_name))
            .unwrap_or_else(|| panic!("{at}: endpointPickerRef names no Service {svc_name}"));
        let svc_port = svc
            .spec
            .iter()
            .flat_map(|s| s.ports.iter().flatten())
            .find(|p| i64::from(p.port) == port)
            .unwrap_or_else(|| panic!("{at}: Service {svc_name} has no port {port}"));
        assert_eq!(
            svc_port.app_protocol.as_deref(),
            Some("http2"),
            "{at}: ext_proc is gRPC"
        );

        // The selector picks worker pods that listen on the target ports.
        let workers: Vec<_> = o
            .deployments
            .iter()
            .filter(|(_, d)| {
                labels_match(&selector, &pod_labels(&d.spec.as_ref().unwrap().template))
            })
            .collect();
        assert!(!workers.is_empty(), "{at}: selector matches no Deployment");
        for (wat, d) in workers {
            let t = &d.spec.as_ref().unwrap().template;
            for p in &ports {
                assert!(
                    container_ports(t).contains(&(*p as i32)),
                    "{wat}: no port {p}"
                );
            }
            check_worker_identity(t, wat);
        }
    }
}

#[test]
fn gateway_resources_reference_each_other() {
    let o = load_objects();
    for gw in &o.gateways {
        let at = gw.at();
        let class = str_at(&gw.value, "/spec/gatewayClassName", &at);
        let gc = o
            .gateway_classes
            .iter()
            .find(|c| c.name() == class)
            .unwrap_or_else(|| panic!("{at}: no GatewayClass {class}"));
        assert_eq!(
            str_at(&gc.value, "/spec/controllerName", &gc.at()),
            ENVOY_GATEWAY_CONTROLLER
        );
        let listeners = gw.value["spec"]["listeners"].as_array().expect("listeners");
        assert!(!listeners.is_empty(), "{at}: no listeners");
        for l in listeners {
            str_at(l, "/name", &at);
            str_at(l, "/protocol", &at);
            let p = l["port"].as_i64().unwrap_or(0);
            assert!((1..=65535).contains(&p), "{at}: listener port {p}");
        }
    }
    for route in &o.routes {
        let at = route.at();
        let parents = route.value["spec"]["parentRefs"]
            .as_array()
            .expect("parentRefs");
        assert!(!parents.is_empty(), "{at}: no parentRefs");
        for parent in parents {
            let name = str_at(parent, "/name", &at);
            let gw = o
                .gateways
                .iter()
                .find(|g| g.name() == name)
                .unwrap_or_else(|| panic!("{at}: parentRef {name} is no Gateway here"));
            if let Some(section) = parent.get("sectionName").and_then(Value::as_str) {
                let listeners = gw.value["spec"]["listeners"].as_array().unwrap();
                assert!(
                    listeners.iter().any(|l| l["name"] == section),
                    "{at}: {section}"
                );
            }
        }
        let rules = route.value["spec"]["rules"].as_array().expect("rules");
        for rule in rules {
            for backend in rule["backendRefs"].as_array().expect("backendRefs") {
                assert_eq!(backend["group"], "inference.networking.k8s.io", "{at}");
                assert_eq!(backend["kind"], "InferencePool", "{at}");
                assert!(
                    backend.get("port").is_none(),
                    "{at}: a pool backendRef takes no port"
                );
                let name = str_at(backend, "/name", &at);
                assert!(
                    o.pools.iter().any(|p| p.name() == name),
                    "{at}: no pool {name}"
                );
            }
        }
    }
}

#[test]
fn pods_run_as_service_accounts_defined_here() {
    let docs = manifest_docs();
    if !root().join("manifests/rbac.yaml").exists() {
        eprintln!("note: manifests/rbac.yaml not on this branch yet; ServiceAccounts unchecked");
        return;
    }
    let accounts: BTreeSet<&str> = docs
        .iter()
        .filter(|d| d.kind() == "ServiceAccount")
        .map(Doc::name)
        .collect();
    for d in docs.iter().filter(|d| d.kind() == "Deployment") {
        if let Some(sa) = d.value["spec"]["template"]["spec"]["serviceAccountName"].as_str() {
            assert!(
                accounts.contains(sa),
                "{}: no ServiceAccount {sa} under manifests/",
                d.at()
            );
        }
    }
}

#[test]
fn kustomization_lists_existing_files() {
    let dir = root().join("manifests");
    let text = fs::read_to_string(dir.join("kustomization.yaml")).unwrap();
    let k: Value = serde_yaml::from_str(&text).unwrap();
    let resources = k["resources"].as_array().expect("resources");
    // Written by the discovery work; absent on a branch that has not merged it yet.
    let generated_elsewhere = ["rbac.yaml"];
    for r in resources {
        let r = r.as_str().expect("resource path");
        assert!(
            !r.starts_with('/') && !r.contains(".."),
            "{r}: must stay inside manifests/"
        );
        if generated_elsewhere.contains(&r) && !dir.join(r).exists() {
            eprintln!("note: {r} not on this branch yet");
            continue;
        }
        assert!(dir.join(r).is_file(), "kustomization lists missing {r}");
    }
    for required in [
        "kvpick.yaml",
        "inferencepool.yaml",
        "mock-workers.yaml",
        "gateway.yaml",
    ] {
        assert!(
            resources.iter().any(|r| r == required),
            "{required} not in kustomization"
        );
    }
}

// ---- the Helm chart --------------------------------------------------------

fn chart() -> PathBuf {
    root().join("charts/kvpick")
}

fn load_yaml(path: &Path) -> Value {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Helm's merge of a values overlay onto the defaults: maps merge, the rest replaces.
fn merge(base: &mut Value, overlay: &Value) {
    match (base, overlay) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

fn schema_errors(values: &Value) -> Vec<(String, String)> {
    let schema = load_yaml(&chart().join("values.schema.json"));
    let validator = jsonschema::validator_for(&schema).expect("values.schema.json compiles");
    validator
        .iter_errors(values)
        .map(|e| (e.instance_path().to_string(), e.to_string()))
        .collect()
}

fn defaults() -> Value {
    load_yaml(&chart().join("values.yaml"))
}

#[test]
fn default_values_and_ci_overlays_satisfy_the_schema() {
    let errors = schema_errors(&defaults());
    assert!(errors.is_empty(), "values.yaml: {errors:?}");
    let overlays = yaml_files(&chart().join("ci"), &[]);
    assert!(
        !overlays.is_empty(),
        "charts/kvpick/ci/ has the alternative values files"
    );
    for path in overlays {
        let mut values = defaults();
        merge(&mut values, &load_yaml(&path));
        let errors = schema_errors(&values);
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
    }
}

#[test]
fn schema_rejects_bad_values_where_they_are() {
    // (overlay, the instance path the schema must complain about)
    let cases = [
        (json!({"replicaCount": 0}), "/replicaCount"),
        (json!({"replicaCount": "3"}), "/replicaCount"),
        (json!({"ports": {"grpc": 70000}}), "/ports/grpc"),
        (json!({"ports": {"metrics": 0}}), "/ports/metrics"),
        (
            json!({"inferencePool": {"failureMode": "FailSometimes"}}),
            "/inferencePool/failureMode",
        ),
        (
            json!({"inferencePool": {"targetPorts": []}}),
            "/inferencePool/targetPorts",
        ),
        (
            json!({"inferencePool": {"targetPorts": [8000, 8000]}}),
            "/inferencePool/targetPorts",
        ),
        (
            json!({"inferencePool": {"targetPorts": [1, 2, 3, 4, 5, 6, 7, 8, 9]}}),
            "/inferencePool/targetPorts",
        ),
        (
            json!({"inferencePool": {"selector": {"app": "not a label!"}}}),
            "/inferencePool/selector/app",
        ),
        (
            json!({"inferencePool": {"selector": {"app": 5}}}),
            "/inferencePool/selector/app",
        ),
        (
            json!({"inferencePool": {"appProtocol": "grpc"}}),
            "/inferencePool/appProtocol",
        ),
        (json!({"kvpick": {"logFormat": "xml"}}), "/kvpick/logFormat"),
        (
            json!({"kvpick": {"secureServing": "yes"}}),
            "/kvpick/secureServing",
        ),
        (
            json!({"kvpick": {"extraArgs": ["-v"]}}),
            "/kvpick/extraArgs/0",
        ),
        (
            json!({"envoyGateway": {"processingBodyMode": "streamed"}}),
            "/envoyGateway/processingBodyMode",
        ),
        (
            json!({"envoyGateway": {"httpRoute": {"requestTimeout": "5 minutes"}}}),
            "/envoyGateway/httpRoute/requestTimeout",
        ),
        (
            json!({"image": {"pullPolicy": "Sometimes"}}),
            "/image/pullPolicy",
        ),
        (
            json!({"tokenizer": {"volume": {"configMap": {"name": "a"}, "secret": {"secretName": "b"}}}}),
            "/tokenizer/volume",
        ),
        (json!({"provider": {"name": "linkerd"}}), "/provider/name"),
        (json!({"mtls": {"enabled": "yes"}}), "/mtls/enabled"),
        (
            json!({"networkPolicy": {"gatewayNamespace": "Not_A_Namespace"}}),
            "/networkPolicy/gatewayNamespace",
        ),
        (json!({"preStopSleepSeconds": -1}), "/preStopSleepSeconds"),
        (json!({"replicas": 2}), ""),
        (
            json!({"serviceMonitor": {"enabeld": true}}),
            "/serviceMonitor",
        ),
    ];
    for (overlay, path) in cases {
        let mut values = defaults();
        merge(&mut values, &overlay);
        let errors = schema_errors(&values);
        assert!(
            errors.iter().any(|(p, _)| p == path),
            "{overlay} must be rejected at {path:?}; errors: {errors:?}"
        );
    }
}

/// Dotted paths of every key in a values tree.
fn value_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Value::Object(m) = v {
        for (k, child) in m {
            let p = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.insert(p.clone());
            value_paths(child, &p, out);
        }
    }
}

/// `.Values.a.b` paths the templates read, with `$x := .Values.a` aliases resolved.
fn template_value_refs() -> BTreeMap<String, String> {
    let direct = Regex::new(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)").unwrap();
    let alias_def = Regex::new(r"\$([A-Za-z_]\w*)\s*:=\s*\.Values((?:\.[A-Za-z_]\w*)+)").unwrap();
    let alias_use = Regex::new(r"\$([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)").unwrap();
    let mut refs = BTreeMap::new();
    let dir = chart().join("templates");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let text = fs::read_to_string(&path).unwrap();
        for c in direct.captures_iter(&text) {
            refs.insert(c[1][1..].to_string(), file.clone());
        }
        let aliases: BTreeMap<String, String> = alias_def
            .captures_iter(&text)
            .map(|c| (c[1].to_string(), c[2][1..].to_string()))
            .collect();
        for c in alias_use.captures_iter(&text) {
            if let Some(base) = aliases.get(&c[1]) {
                refs.insert(format!("{base}{}", &c[2]), file.clone());
            }
        }
    }
    refs
}

#[test]
fn templates_read_only_values_that_exist() {
    let mut known = BTreeSet::new();
    value_paths(&defaults(), "", &mut known);
    let refs = template_value_refs();
    assert!(
        refs.len() > 30,
        "the scan found too few references: {refs:?}"
    );
    for (path, file) in &refs {
        assert!(
            known.contains(path),
            "{file} reads .Values.{path}, which values.yaml lacks"
        );
    }
}

#[test]
fn every_value_is_read_by_a_template() {
    let mut known = BTreeSet::new();
    value_paths(&defaults(), "", &mut known);
    let refs = template_value_refs();
    for path in &known {
        // A value is used when a template reads it, an ancestor (toYaml of a
        // whole object) or a descendant (a section read key by key).
        let used = refs.keys().any(|r| {
            r == path || path.starts_with(&format!("{r}.")) || r.starts_with(&format!("{path}."))
        });
        assert!(used, "values.yaml has {path}, which no template reads");
    }
}

#[test]
fn every_value_is_documented() {
    // A key needs a comment right above it, unless an ancestor key is commented
    // (the object is documented as a whole) or it is a section whose own keys
    // carry the comments.
    let text = fs::read_to_string(chart().join("values.yaml")).unwrap();
    let key = Regex::new(r"^(\s*)([A-Za-z_][\w.-]*):").unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // (indent, documented) of the enclosing keys
    let mut stack: Vec<(usize, bool)> = Vec::new();
    let mut undocumented = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(c) = key.captures(line) else {
            continue;
        };
        let indent = c[1].len();
        while stack.last().is_some_and(|(d, _)| *d >= indent) {
            stack.pop();
        }
        let commented = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .is_some_and(|l| l.trim_start().starts_with('#'));
        let inherited = stack.iter().any(|(_, doc)| *doc);
        let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty());
        let is_section = next.is_some_and(|n| {
            key.captures(n).is_some_and(|nc| nc[1].len() > indent)
                || (n.trim_start().starts_with('#') && n.len() - n.trim_start().len() > indent)
        });
        if !commented && !inherited && !is_section {
            undocumented.push(format!("line {}: {}", i + 1, line.trim()));
        }
        stack.push((indent, commented));
    }
    assert!(
        undocumented.is_empty(),
        "values.yaml keys without a comment: {undocumented:?}"
    );
}
