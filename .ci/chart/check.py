#!/usr/bin/env python3
"""Renders charts/kvpick with real Helm and validates every object it makes.

Helm is Helm's own Go SDK (v4), loaded through the `helm-python-sdk` package
(`libhelm_c`, no helm binary). For each values file in charts/kvpick/ci/ (each
on top of the chart's defaults, chart-testing's convention) this:

- renders the chart (values.schema.json, the templates' `fail` checks);
- runs `helm lint --strict` with the same values: any warning or error fails;
- validates every rendered object: built-in kinds with `kubernetes-validate`
  (strict: unknown fields fail) at the oldest Kubernetes the chart's
  kubeVersion admits; the InferencePool against GIE's CRD shipped in
  manifests/crds/; Gateway API, ServiceMonitor and Istio objects against the
  pinned upstream CRD schemas in .ci/chart/schemas/ (see its README);
  a kind without a schema fails;
- checks what the chart promises: least-privilege RBAC, the metrics port name,
  the drain timeout against the grace period, kvpick's args accepted by the
  kvpick binary (`--kvpick BIN`: `kvpick check-args`).

Values that must not render (no selector, no image, clashing pool group, ...)
must fail with the message that names the value. Finally a copy of the chart
with a broken template must fail validation, so this check can fail.

    python3 .ci/chart/check.py [--kvpick target/debug/kvpick]
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHART = ROOT / "charts" / "kvpick"
SCHEMAS = HERE / "schemas"
POOL_CRD = ROOT / "manifests" / "crds" / "inferencepool.yaml"
RELEASE = "kvpick"
NAMESPACE = "inference"

# Kinds the chart makes and the Kubernetes API validates itself.
READ_ONLY_VERBS = {"get", "list", "watch"}
# What kvpick reads (src/discovery): its pool, the pool's pods, objectives.
READABLE = {
    "": {"pods"},
    "inference.networking.k8s.io": {"inferencepools"},
    "inference.networking.x-k8s.io": {"inferencepools", "inferenceobjectives"},
    "llm-d.ai": {"inferenceobjectives"},
}


class CheckFailed(Exception):
    """One check of one case failed."""


def crd_schemas(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version of the CRDs."""
    out = {}
    for crd in docs:
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        group = crd["spec"]["group"]
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = version["schema"]["openAPIV3Schema"]
                out[(f"{group}/{version['name']}", kind)] = schema
    return out


def strict(schema: Any) -> Any:
    """The API server's strict field validation (kubectl's default): an object
    schema that lists its properties and does not preserve unknown fields
    rejects other fields instead of pruning them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def load_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = crd_schemas(list(yaml.safe_load_all(POOL_CRD.read_text())))
    for path in sorted(SCHEMAS.glob("*.json")):
        entry = json.loads(path.read_text())
        schemas[(entry["apiVersion"], entry["kind"])] = entry["schema"]
    out = {}
    for key, schema in schemas.items():
        # Every object has these at its root, whether the CRD lists them or not.
        root = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
        out[key] = strict({**schema, "properties": {**root, **schema.get("properties", {})}})
    return out


def min_kube_version(chart_yaml: dict[str, Any]) -> str:
    """The oldest Kubernetes `kubeVersion: ">=X.Y.Z-0"` admits, as X.Y.Z."""
    m = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.(\d+)(-0)?", chart_yaml["kubeVersion"].strip())
    if not m:
        raise CheckFailed(f"Chart.yaml kubeVersion {chart_yaml['kubeVersion']!r} is not '>=X.Y.Z-0'")
    if (int(m[1]), int(m[2])) < (1, 32):
        raise CheckFailed(f"kubeVersion {chart_yaml['kubeVersion']!r} admits Kubernetes older than 1.32, which Envoy AI Gateway needs")
    return f"{m[1]}.{m[2]}.{m[3]}"


def render(chart_dir: pathlib.Path, values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(str(chart_dir)) as chart:
        return chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(manifests: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append((template, doc))
    return out


def validate_object(
    obj: dict[str, Any], kube: str, schemas: dict[tuple[str, str], dict[str, Any]]
) -> None:
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    where = f"{key[1]}/{obj.get('metadata', {}).get('name')}"
    if key in schemas:
        errors = sorted(
            jsonschema.Draft7Validator(schemas[key]).iter_errors(obj), key=lambda e: list(e.path)
        )
        if errors:
            e = errors[0]
            raise CheckFailed(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        return
    try:
        kubernetes_validate.validate(obj, kube, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise CheckFailed(f"{where} (Kubernetes {kube}): {'.'.join(map(str, e.path))}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        raise CheckFailed(f"{where}: no schema for {key[0]} {key[1]}: {e.message}")


def lint(chart_dir: pathlib.Path, values: dict[str, Any], kube: str) -> None:
    report = helm.lint(
        str(chart_dir), values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube}"
    )
    bad = [m for m in report["messages"] if m["severity"] >= 2] + [
        {"error": e} for e in report["errors"]
    ]
    if bad:
        raise CheckFailed(f"helm lint --strict: {bad}")


def kvpick_deployment(objs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """kvpick's Deployment (not the bundled replica-sync server's)."""
    return next(
        o
        for _, o in objs
        if o["kind"] == "Deployment"
        and any(c["name"] == "kvpick" for c in o["spec"]["template"]["spec"]["containers"])
    )


def kvpick_container(objs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    deployment = kvpick_deployment(objs)
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "kvpick"
    )


def check_promises(objs: list[tuple[str, dict[str, Any]]], kvpick: str | None) -> None:
    """What the chart promises beyond schema validity."""
    kinds = {o["kind"] for _, o in objs}
    if "ClusterRole" in kinds or "ClusterRoleBinding" in kinds:
        raise CheckFailed("RBAC must stay namespaced (Role, not ClusterRole)")
    for _, o in objs:
        if o["kind"] != "Role":
            continue
        for rule in o["rules"]:
            verbs = set(rule["verbs"])
            if not verbs <= READ_ONLY_VERBS:
                raise CheckFailed(f"Role grants {sorted(verbs - READ_ONLY_VERBS)}: kvpick only reads")
            for group in rule["apiGroups"]:
                extra = set(rule["resources"]) - READABLE.get(group, set())
                if extra:
                    raise CheckFailed(f"Role grants {group}/{sorted(extra)}, which kvpick never reads")
    container = kvpick_container(objs)
    if "http-metrics" not in {p["name"] for p in container["ports"]}:
        raise CheckFailed("the metrics port must be named http-metrics (GIE's monitors)")
    for _, o in objs:
        component = o["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if o["kind"] == "Service" and component == "endpoint-picker":
            names = {p["name"] for p in o["spec"]["ports"]}
            if "http-metrics" not in names:
                raise CheckFailed(f"Service ports {sorted(names)} lack http-metrics")
    pod = kvpick_deployment(objs)["spec"]["template"]["spec"]
    args = container["args"]
    drain = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--drain-timeout-ms="))
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    if pre_stop * 1000 + drain >= pod["terminationGracePeriodSeconds"] * 1000:
        raise CheckFailed(
            f"preStop {pre_stop}s + drain {drain}ms reach the grace period "
            f"{pod['terminationGracePeriodSeconds']}s: the kubelet would kill open streams"
        )
    if kvpick:
        files = {}
        for _, o in objs:
            if o["kind"] == "ConfigMap":
                files.update(o["data"])
        with tempfile.TemporaryDirectory() as tmp:
            run_args = []
            for a in args:
                # Files the pod mounts: the EndpointPickerConfig from its ConfigMap.
                if a.startswith("--config-file="):
                    name = pathlib.Path(a.split("=", 1)[1]).name
                    path = pathlib.Path(tmp) / name
                    path.write_text(files[name])
                    a = f"--config-file={path}"
                run_args.append(a)
            done = subprocess.run(
                [kvpick, *run_args, "check-args"], capture_output=True, text=True, timeout=60
            )
            if done.returncode != 0:
                errors = [l for l in done.stderr.splitlines() if l.lower().startswith("error")]
                raise CheckFailed(f"kvpick rejects the chart's args {run_args}: {errors or done.stderr}")


def effective(chart_dir: pathlib.Path, values: dict[str, Any]) -> dict[str, Any]:
    """The values a template sees: the chart's values.yaml under the overlay."""
    return merge(yaml.safe_load((chart_dir / "values.yaml").read_text()), values)


def check_network_policy(objs: list[tuple[str, dict[str, Any]]], values: dict[str, Any]) -> None:
    """`values` are the effective values. networkPolicy.enabled: a NetworkPolicy
    selects kvpick's pods, admits the ext_proc port only from selected
    namespaces (never everyone, never an IP block), and leaves the plaintext
    gRPC health port closed to pods; disabled: no NetworkPolicy."""
    policies = [o for _, o in objs if o["kind"] == "NetworkPolicy"]
    if not values["networkPolicy"]["enabled"]:
        if policies:
            raise CheckFailed(f"networkPolicy.enabled=false renders {len(policies)} NetworkPolicies")
        return
    if len(policies) != 1:
        raise CheckFailed(f"networkPolicy.enabled renders {len(policies)} NetworkPolicies, not 1")
    policy = policies[0]["spec"]
    deployment = kvpick_deployment(objs)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selected = policy.get("podSelector", {}).get("matchLabels", {})
    if not selected or any(pod_labels.get(k) != v for k, v in selected.items()):
        raise CheckFailed(f"NetworkPolicy selects {selected}, not kvpick's pods {pod_labels}")
    if "Ingress" not in policy.get("policyTypes", []):
        raise CheckFailed("NetworkPolicy does not restrict Ingress")
    ports = {p["name"]: p["containerPort"] for p in kvpick_container(objs)["ports"]}
    for rule in policy.get("ingress", []):
        # A rule without ports admits every port; one without `from` admits everyone.
        opened = {p["port"] for p in rule.get("ports", [])} or set(ports.values())
        if ports["grpc-health"] in opened:
            raise CheckFailed(f"NetworkPolicy opens the plaintext health port: {rule}")
        if ports["grpc"] not in opened:
            continue
        peers = rule.get("from", [])
        if not peers:
            raise CheckFailed(f"NetworkPolicy admits everyone to the ext_proc port: {rule}")
        for peer in peers:
            ns = peer.get("namespaceSelector", {})
            if "ipBlock" in peer or not (ns.get("matchLabels") or ns.get("matchExpressions")):
                raise CheckFailed(f"NetworkPolicy admits more than the gateway's namespace: {peer}")


# The labels Envoy Gateway puts on every proxy pod it runs (EnvoyAppLabel in
# envoyproxy/gateway internal/infrastructure/kubernetes/proxy/resource.go), in
# the namespace it runs them in by default.
ENVOY_GATEWAY_PROXY_NAMESPACE = "envoy-gateway-system"
ENVOY_GATEWAY_PROXY_LABELS = {
    "app.kubernetes.io/name": "envoy",
    "app.kubernetes.io/component": "proxy",
    "app.kubernetes.io/managed-by": "envoy-gateway",
}


def check_default_network_policy(chart_dir: pathlib.Path) -> None:
    """Only the required values (provider.name=none, next to Envoy Gateway):
    the NetworkPolicy is on and admits the ext_proc port to Envoy Gateway's
    proxies in envoy-gateway-system, and to nothing else."""
    values = yaml.safe_load((chart_dir / "ci" / "minimal-values.yaml").read_text())
    objs = objects(render(chart_dir, values))
    policies = [o for _, o in objs if o["kind"] == "NetworkPolicy"]
    if len(policies) != 1:
        raise CheckFailed(f"the default render makes {len(policies)} NetworkPolicies, not 1")
    check_network_policy(objs, effective(chart_dir, values))
    grpc = next(p["containerPort"] for p in kvpick_container(objs)["ports"] if p["name"] == "grpc")
    want = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ENVOY_GATEWAY_PROXY_NAMESPACE}},
        "podSelector": {"matchLabels": ENVOY_GATEWAY_PROXY_LABELS},
    }
    peers = [
        peer
        for rule in policies[0]["spec"]["ingress"]
        if grpc in {p["port"] for p in rule.get("ports", [])}
        for peer in rule.get("from", [])
    ]
    if peers != [want]:
        raise CheckFailed(f"the default NetworkPolicy admits {peers} to the ext_proc port, not Envoy Gateway's proxies {want}")


# (name, overlay on minimal-values.yaml or None for the bare defaults, message the render must fail with)
MUST_FAIL: list[tuple[str, dict[str, Any] | None, str]] = [
    ("no values", None, "inferencePool.selector is required"),
    ("no image", {"image": {"repository": ""}}, "image.repository is required"),
    (
        "v1alpha2 group with a created pool",
        {"kvpick": {"poolGroup": "inference.networking.x-k8s.io"}},
        "inferencePool.create=true makes an inference.networking.k8s.io/v1 InferencePool",
    ),
    ("mtls without CAs", {"mtls": {"enabled": True}}, "mtls.enabled needs exactly one of"),
    (
        "mtls over plaintext",
        {"mtls": {"enabled": True, "clientCASecret": "ca"}, "kvpick": {"secureServing": False}},
        "mtls.enabled needs kvpick.secureServing=true",
    ),
    (
        "istio mtls without a client certificate",
        {"mtls": {"enabled": True, "clientCASecret": "ca"}, "provider": {"name": "istio"}},
        "provider.istio.destinationRule.clientCertSecret",
    ),
    (
        "grace period shorter than preStop",
        {"terminationGracePeriodSeconds": 10, "preStopSleepSeconds": 5},
        "terminationGracePeriodSeconds (10) must exceed preStopSleepSeconds (5)",
    ),
    ("unknown provider", {"provider": {"name": "linkerd"}}, "/provider/name"),
    (
        "istio with the default NetworkPolicy and no gateway namespace",
        {"provider": {"name": "istio"}},
        "networkPolicy.gatewayNamespace is required with provider.name=istio",
    ),
    (
        "replica sync forced on without a server",
        {"replicaSync": {"enabled": True}},
        "replicaSync.enabled=true needs a server",
    ),
    (
        "replica sync URL that is not redis://",
        {"replicaSync": {"url": "nats://sync:4222"}},
        "/replicaSync/url",
    ),
]


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_chart(
    chart_dir: pathlib.Path, kvpick: str | None, schemas: dict[tuple[str, str], dict[str, Any]]
) -> list[str]:
    """Every check on one chart directory; returns the failures."""
    kube = min_kube_version(yaml.safe_load((chart_dir / "Chart.yaml").read_text()))
    failures = []
    cases = sorted((chart_dir / "ci").glob("*-values.yaml"))
    if not cases:
        return [f"{chart_dir}/ci has no *-values.yaml files"]
    for path in cases:
        values = yaml.safe_load(path.read_text()) or {}
        try:
            objs = objects(render(chart_dir, values))
            for _, obj in objs:
                validate_object(obj, kube, schemas)
            lint(chart_dir, values, kube)
            check_promises(objs, kvpick)
            check_network_policy(objs, effective(chart_dir, values))
            kinds = sorted(f"{o['kind']}" for _, o in objs)
            print(f"ok   {path.name}: {len(objs)} objects valid for Kubernetes {kube}: {' '.join(kinds)}")
        except (CheckFailed, helm.HelmError) as e:
            failures.append(f"{path.name}: {e}")
            print(f"FAIL {path.name}: {e}")
    try:
        check_default_network_policy(chart_dir)
        print(f"ok   default NetworkPolicy: admits {ENVOY_GATEWAY_PROXY_NAMESPACE} pods labelled {ENVOY_GATEWAY_PROXY_LABELS}")
    except (CheckFailed, helm.HelmError) as e:
        failures.append(f"default NetworkPolicy: {e}")
        print(f"FAIL default NetworkPolicy: {e}")
    minimal = yaml.safe_load((chart_dir / "ci" / "minimal-values.yaml").read_text())
    for name, overlay, message in MUST_FAIL:
        values = {} if overlay is None else merge(minimal, overlay)
        try:
            render(chart_dir, values)
            failures.append(f"must fail: {name}: rendered")
            print(f"FAIL must fail: {name}: rendered")
        except helm.HelmError as e:
            if message not in str(e):
                failures.append(f"must fail: {name}: wrong message: {e}")
                print(f"FAIL must fail: {name}: message lacks {message!r}: {e}")
            else:
                print(f"ok   must fail: {name}")
    return failures


def broken_copy(tmp: pathlib.Path, mutate: Callable[[str], str], template: str) -> pathlib.Path:
    dest = tmp / "kvpick"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(CHART, dest)
    target = dest / "templates" / template
    before = target.read_text()
    after = mutate(before)
    assert after != before, f"the mutation of {template} changed nothing"
    target.write_text(after)
    return dest


def self_test(schemas: dict[tuple[str, str], dict[str, Any]], kvpick: str | None) -> list[str]:
    """Broken templates must make the check fail."""
    breaks = [
        ("deployment.yaml", lambda s: s.replace("containerPort:", "containerPorts:", 1), "minimal"),
        ("service.yaml", lambda s: s.replace("port: {{ .Values.ports.grpc }}", "port: \"{{ .Values.ports.grpc }}\"", 1), "minimal"),
        ("inferencepool.yaml", lambda s: s.replace("failureMode:", "failMode:", 1), "minimal"),
        ("rbac.yaml", lambda s: s.replace('verbs: ["get", "list", "watch"]', 'verbs: ["get", "list", "watch", "delete"]', 1), "minimal"),
        # Every namespace's pods with the gateway's labels, not the gateway's namespace.
        (
            "networkpolicy.yaml",
            lambda s: re.sub(r"namespaceSelector:\n\s+matchLabels:\n\s+kubernetes.io/metadata.name: [^\n]+", "namespaceSelector: {}", s, count=1),
            "mtls",
        ),
        # The policy rendered only when asked for: off by default again.
        (
            "networkpolicy.yaml",
            lambda s: s.replace("if .Values.networkPolicy.enabled", "if and .Values.networkPolicy.enabled false", 1),
            "minimal",
        ),
    ]
    failures = []
    if kvpick:
        values = merge(
            yaml.safe_load((CHART / "ci" / "minimal-values.yaml").read_text()),
            {"kvpick": {"extraArgs": ["--no-such-flag=1"]}},
        )
        try:
            check_promises(objects(render(CHART, values)), kvpick)
            failures.append("self-test: kvpick accepted --no-such-flag")
            print("FAIL self-test: kvpick accepted --no-such-flag")
        except CheckFailed as e:
            print(f"ok   self-test: an unknown flag caught: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        for template, mutate, case in breaks:
            chart = broken_copy(pathlib.Path(tmp), mutate, template)
            values = yaml.safe_load((chart / "ci" / f"{case}-values.yaml").read_text())
            try:
                objs = objects(render(chart, values))
                for _, obj in objs:
                    validate_object(obj, min_kube_version(yaml.safe_load((chart / "Chart.yaml").read_text())), schemas)
                check_promises(objs, None)
                check_network_policy(objs, effective(chart, values))
                failures.append(f"self-test: a broken {template} passed")
                print(f"FAIL self-test: a broken {template} passed")
            except CheckFailed as e:
                print(f"ok   self-test: broken {template} caught: {e}")
    return failures


def extract(crd_files: list[str], out_dir: pathlib.Path, source: str) -> None:
    """Writes one schema file per served (apiVersion, kind) of the given CRD files."""
    for f in crd_files:
        docs = list(yaml.safe_load_all(pathlib.Path(f).read_text()))
        for (api, kind), schema in crd_schemas(docs).items():
            name = f"{api.replace('/', '_')}_{kind.lower()}.json"
            entry = {"apiVersion": api, "kind": kind, "source": source, "schema": schema}
            (out_dir / name).write_text(json.dumps(entry, separators=(",", ":"), sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvpick", help="kvpick binary: the chart's args must pass `kvpick check-args`")
    parser.add_argument("--extract", nargs="+", metavar="CRD_YAML", help="write schemas of these CRDs to .ci/chart/schemas/")
    parser.add_argument("--source", default="", help="with --extract: where the CRD files come from")
    args = parser.parse_args()
    if args.extract:
        extract(args.extract, SCHEMAS, args.source)
        return 0
    print(f"Helm SDK {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}), kubernetes-validate {kubernetes_validate.__version__}")
    schemas = load_schemas()
    failures = check_chart(CHART, args.kvpick, schemas) + self_test(schemas, args.kvpick)
    passed = len(list((CHART / "ci").glob("*-values.yaml"))) + 1 + len(MUST_FAIL) + 6 + bool(args.kvpick) - len(failures)
    print(f"chart: {passed} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
