#!/usr/bin/env bash
# End-to-end run of kvpick behind a real Envoy Gateway in a kind cluster.
#
#   e2e/kind/run.sh            create the cluster, install, run the scenarios, delete the cluster
#   KEEP_CLUSTER=1 e2e/kind/run.sh   ...and leave the cluster up for poking around
#
# Needs docker (with a running engine), kind, kubectl, helm, curl and jq.
# See e2e/kind/README.md for what it installs and checks.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${CLUSTER:-kvpick-e2e}"
NS="${NS:-kvpick-e2e}"
TAG="${TAG:-e2e}"
KVPICK_IMAGE="kvpick/kvpick:${TAG}"
MOCK_IMAGE="kvpick/mock-worker:${TAG}"
# Envoy Gateway serves InferencePool backends through the Envoy AI Gateway
# extension server; these are the versions its docs pair.
EG_VERSION="${EG_VERSION:-v1.8.1}"
AIGW_VERSION="${AIGW_VERSION:-v1.1.0}"
AIGW_RAW="https://raw.githubusercontent.com/envoyproxy/ai-gateway/${AIGW_VERSION}"
POOL=mock-pool
GATEWAY=inference-gateway
LOCAL_PORT="${LOCAL_PORT:-18080}"
WORK="$(mktemp -d)"
PF_PID=""

log() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nFAIL: %s\n' "$*" >&2; exit 1; }
pass() { printf 'PASS: %s\n' "$*"; }

cleanup() {
  [[ -n "${PF_PID}" ]] && kill "${PF_PID}" 2>/dev/null || true
  rm -rf "${WORK}"
  if [[ "${KEEP_CLUSTER:-0}" != "1" ]]; then
    kind delete cluster --name "${CLUSTER}" >/dev/null 2>&1 || true
  else
    echo "cluster ${CLUSTER} kept (kind delete cluster --name ${CLUSTER})"
  fi
}

# ---- prerequisites ---------------------------------------------------------
missing=()
for tool in docker kind kubectl helm curl jq; do
  command -v "${tool}" >/dev/null 2>&1 || missing+=("${tool}")
done
if ((${#missing[@]})); then
  echo "e2e/kind/run.sh needs: docker kind kubectl helm curl jq; missing: ${missing[*]}" >&2
  exit 2
fi
docker info >/dev/null 2>&1 || { echo "docker is installed but no Docker engine answers (docker info failed)" >&2; exit 2; }
trap cleanup EXIT

# ---- cluster and images ----------------------------------------------------
log "kind cluster ${CLUSTER}"
kind get clusters 2>/dev/null | grep -qx "${CLUSTER}" || kind create cluster --name "${CLUSTER}" --wait 120s
kubectl config use-context "kind-${CLUSTER}" >/dev/null

log "build images ${KVPICK_IMAGE} and ${MOCK_IMAGE}"
DOCKER_BUILDKIT=1 docker build --target kvpick -t "${KVPICK_IMAGE}" "${ROOT}"
DOCKER_BUILDKIT=1 docker build --target mock-worker -t "${MOCK_IMAGE}" "${ROOT}"
kind load docker-image --name "${CLUSTER}" "${KVPICK_IMAGE}" "${MOCK_IMAGE}"

# ---- gateway stack ---------------------------------------------------------
log "InferencePool CRD (manifests/crds)"
kubectl apply --server-side -f "${ROOT}/manifests/crds/inferencepool.yaml"
kubectl wait --for=condition=Established --timeout=60s crd/inferencepools.inference.networking.k8s.io

# Envoy Gateway watches InferencePool from start-up (the CRD above must exist
# first); the AI Gateway chart grants it the RBAC to do so and runs the
# extension server, after which Envoy Gateway is restarted to connect to it.
log "Envoy Gateway ${EG_VERSION} with the AI Gateway extension and InferencePool backends"
helm upgrade -i eg oci://docker.io/envoyproxy/gateway-helm --version "${EG_VERSION}" \
  --namespace envoy-gateway-system --create-namespace \
  -f "${AIGW_RAW}/manifests/envoy-gateway-values.yaml" \
  -f "${AIGW_RAW}/examples/inference-pool/envoy-gateway-values-addon.yaml"

log "Envoy AI Gateway ${AIGW_VERSION} (extension server that wires InferencePool backends)"
helm upgrade -i aieg-crd oci://docker.io/envoyproxy/ai-gateway-crds-helm --version "${AIGW_VERSION}" \
  --namespace envoy-ai-gateway-system --create-namespace
helm upgrade -i aieg oci://docker.io/envoyproxy/ai-gateway-helm --version "${AIGW_VERSION}" \
  --namespace envoy-ai-gateway-system --create-namespace
kubectl wait --timeout=5m -n envoy-ai-gateway-system deployment/ai-gateway-controller --for=condition=Available
kubectl rollout restart -n envoy-gateway-system deployment/envoy-gateway
kubectl rollout status -n envoy-gateway-system deployment/envoy-gateway --timeout=5m

# ---- workers and kvpick ----------------------------------------------------
log "namespace ${NS}: mock workers (manifests/mock-workers.yaml)"
kubectl create namespace "${NS}" --dry-run=client -o yaml | kubectl apply -f -
sed "s#kvpick/mock-worker:[0-9A-Za-z._-]*#${MOCK_IMAGE}#" "${ROOT}/manifests/mock-workers.yaml" \
  | kubectl -n "${NS}" apply -f -

cat >"${WORK}/values.yaml" <<VALUES
image:
  repository: kvpick/kvpick
  tag: "${TAG}"
  pullPolicy: IfNotPresent
kvpick:
  logFormat: text
inferencePool:
  name: ${POOL}
  selector:
    app: mock-worker
    kvpick.io/pool: ${POOL}
  targetPorts: [8000]
envoyGateway:
  enabled: true
  processingBodyMode: duplex
  gateway:
    name: ${GATEWAY}
    create: true
    createClass: true
    className: kvpick-e2e
  httpRoute:
    requestTimeout: 60s
VALUES

log "helm lint + install charts/kvpick"
helm lint "${ROOT}/charts/kvpick" -f "${WORK}/values.yaml"
for f in "${ROOT}"/charts/kvpick/ci/*.yaml; do helm lint "${ROOT}/charts/kvpick" -f "${f}"; done
helm upgrade -i kvpick "${ROOT}/charts/kvpick" -n "${NS}" -f "${WORK}/values.yaml" --wait --timeout 5m

log "rollouts"
kubectl -n "${NS}" rollout status deployment/kvpick --timeout=3m
kubectl -n "${NS}" rollout status deployment/mock-worker --timeout=3m
kubectl -n "${NS}" rollout status deployment/mock-worker-dp2 --timeout=3m
kubectl -n "${NS}" wait --for=condition=Programmed --timeout=3m "gateway/${GATEWAY}"

# ---- gateway port-forward ----------------------------------------------------
GW_SVC="$(kubectl -n envoy-gateway-system get svc \
  -l "gateway.envoyproxy.io/owning-gateway-name=${GATEWAY},gateway.envoyproxy.io/owning-gateway-namespace=${NS}" \
  -o jsonpath='{.items[0].metadata.name}')"
[[ -n "${GW_SVC}" ]] || fail "no Envoy Service for gateway ${GATEWAY}"
kubectl -n envoy-gateway-system port-forward "svc/${GW_SVC}" "${LOCAL_PORT}:80" >"${WORK}/pf.log" 2>&1 &
PF_PID=$!
GW="http://127.0.0.1:${LOCAL_PORT}"
for _ in $(seq 60); do
  curl -s -o /dev/null "${GW}/" && break
  sleep 1
done

# ---- helpers ---------------------------------------------------------------
# The stable 53-bit instance id kvpick gives a pod without an annotation:
# FNV-1a 64 over "namespace/pod-name", low 53 bits (src/identity.rs).
instance_id() {
  local key="$1" h=-3750763034362895579 i c  # 0xcbf29ce484222325 as a signed 64-bit integer
  for ((i = 0; i < ${#key}; i++)); do
    printf -v c '%d' "'${key:i:1}"
    h=$(((h ^ c) * 1099511628211))
  done
  echo $((h & ((1 << 53) - 1)))
}

# chat ID PROMPT [SESSION_JSON] [curl args...]: POST a chat completion tagged
# with x-e2e-id: ID; prints the HTTP status. Body in $WORK/ID.body, headers in $WORK/ID.headers.
chat() {
  local id="$1" prompt="$2" nvext="${3:-}"
  shift 3 || shift $#
  local body
  body="$(jq -cn --arg p "${prompt}" --argjson nv "${nvext:-null}" \
    '{model: "mock-llama", max_tokens: 8, messages: [{role: "user", content: $p}]}
     + (if $nv == null then {} else {nvext: {session_control: $nv}} end)')"
  curl -sS -o "${WORK}/${id}.body" -D "${WORK}/${id}.headers" -w '%{http_code}' \
    -H 'content-type: application/json' -H "x-e2e-id: ${id}" "$@" \
    --data "${body}" "${GW}/v1/chat/completions"
}

pods() {
  kubectl -n "${NS}" get pods -l "app=mock-worker,kvpick.io/pool=${POOL}" \
    --field-selector=status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}'
}

# seen_by ID: "pod instance-id dp-rank destination" of the worker that saw the
# request tagged ID (from the mock worker's /debug/seen, through the API server's pod proxy).
seen_by() {
  local id="$1" pod found=""
  for pod in $(pods); do
    local seen
    seen="$(kubectl get --raw "/api/v1/namespaces/${NS}/pods/${pod}:8000/proxy/debug/seen" 2>/dev/null)" || continue
    local hit
    hit="$(jq -c --arg id "${id}" \
      'first(.. | objects | select(.["x-e2e-id"]? == $id)) // empty' <<<"${seen}")"
    if [[ -n "${hit}" ]]; then
      [[ -z "${found}" ]] || fail "request ${id} reached two workers: ${found%% *} and ${pod}"
      found="${pod} $(jq -r '[.["x-worker-instance-id"] // "-", .["x-dp-rank"] // "-", .["x-gateway-destination-endpoint"] // "-"] | join(" ")' <<<"${hit}")"
    fi
  done
  [[ -n "${found}" ]] || fail "no worker saw request ${id}"
  echo "${found}"
}

expect_status() {
  local want="$1" got="$2" what="$3"
  [[ "${got}" == "${want}" ]] || { cat "${WORK}"/*.body 2>/dev/null | tail -c 600 >&2; fail "${what}: HTTP ${got}, want ${want}"; }
}

# ---- scenarios (the same ones the local e2e suite runs) ---------------------
log "1. routing headers reach the worker and match its identity"
status="$(chat r1 "Hello from the kind e2e run")"
expect_status 200 "${status}" "first request"
read -r pod wid rank dest <<<"$(seen_by r1)"
want="$(instance_id "${NS}/${pod}")"
[[ "${wid}" == "${want}" ]] || fail "${pod} saw x-worker-instance-id ${wid}, its id is ${want}"
pod_ip="$(kubectl -n "${NS}" get pod "${pod}" -o jsonpath='{.status.podIP}')"
[[ "${dest}" == "${pod_ip}:8000" ]] || fail "${pod} saw destination ${dest}, it is ${pod_ip}:8000"
pass "request went to ${pod} (id ${wid}, dp rank ${rank}, ${dest})"

log "2. a repeated prefix goes to the same worker"
PREFIX="$(printf 'You are a careful assistant for the e2e run. Rule %s. ' $(seq 1 60))"
first=""
for i in 1 2 3 4 5; do
  expect_status 200 "$(chat "p${i}" "${PREFIX} Question ${i}?")" "prefix request ${i}"
  read -r pod _ <<<"$(seen_by "p${i}")"
  first="${first:-${pod}}"
  [[ "${pod}" == "${first}" ]] || fail "prefix request ${i} went to ${pod}, earlier ones to ${first}"
done
pass "5 requests sharing a prefix all went to ${first}"
PREFIX_POD="${first}"

log "3. a session (open, turns, close) stays on one worker"
SID="e2e-session-$$"
token_args=()
session_pod=""
for turn in open mid1 mid2 close; do
  case "${turn}" in
    open) nv="{\"session_id\":\"${SID}\",\"action\":\"open\",\"timeout\":60}" ;;
    close) nv="{\"session_id\":\"${SID}\",\"action\":\"close\"}" ;;
    *) nv="{\"session_id\":\"${SID}\"}" ;;
  esac
  expect_status 200 "$(chat "s-${turn}" "turn ${turn} of the session" "${nv}" "${token_args[@]+"${token_args[@]}"}")" "session ${turn}"
  # Send kvpick's signed session token back, as a client behind several kvpick replicas would.
  token="$(grep -i '^x-kvpick-session:' "${WORK}/s-${turn}.headers" | cut -d' ' -f2- | tr -d '\r' || true)"
  [[ -n "${token}" ]] && token_args=(-H "x-kvpick-session: ${token}")
  read -r pod _ <<<"$(seen_by "s-${turn}")"
  session_pod="${session_pod:-${pod}}"
  [[ "${pod}" == "${session_pod}" ]] || fail "session turn ${turn} went to ${pod}, the session is on ${session_pod}"
done
pass "session ${SID} stayed on ${session_pod} from open to close"

log "4. a bad request gets a 400 from kvpick"
status="$(curl -sS -o "${WORK}/bad.body" -w '%{http_code}' -H 'content-type: application/json' \
  --data '{"model": "mock-llama", "messages": "not a list"' "${GW}/v1/chat/completions")"
expect_status 400 "${status}" "malformed body"
jq -e . "${WORK}/bad.body" >/dev/null || fail "the 400 body is not JSON: $(head -c 300 "${WORK}/bad.body")"
pass "malformed body: 400 with a JSON error"

log "5. spoofed routing headers are overwritten"
status="$(chat spoof "spoof attempt" "" -H 'x-worker-instance-id: 12345' \
  -H 'x-gateway-destination-endpoint: 10.255.255.1:1' -H 'x-prefill-instance-id: 7')"
expect_status 200 "${status}" "spoofed request"
read -r pod wid _ dest <<<"$(seen_by spoof)"
[[ "${wid}" != "12345" ]] || fail "the client's x-worker-instance-id reached ${pod}"
[[ "${wid}" == "$(instance_id "${NS}/${pod}")" ]] || fail "${pod} saw id ${wid}, not its own"
[[ "${dest}" != "10.255.255.1:1" ]] || fail "the client's destination header survived"
pass "spoofed headers replaced (${pod} saw its own id ${wid})"

log "6. deleting a worker pod moves its traffic"
kubectl -n "${NS}" delete pod "${PREFIX_POD}" --wait=true --timeout=90s
moved=""
for attempt in $(seq 1 20); do
  status="$(chat "after-delete-${attempt}" "${PREFIX} Question after delete?")"
  if [[ "${status}" == 200 ]]; then
    read -r pod _ <<<"$(seen_by "after-delete-${attempt}")"
    [[ "${pod}" != "${PREFIX_POD}" ]] || fail "traffic still reached the deleted pod ${PREFIX_POD}"
    moved="${pod}"
    break
  fi
  sleep 1
done
[[ -n "${moved}" ]] || fail "no request succeeded within 20 s after deleting ${PREFIX_POD}"
pass "after deleting ${PREFIX_POD}, the prefix went to ${moved} (attempt ${attempt})"

log "all scenarios passed"
