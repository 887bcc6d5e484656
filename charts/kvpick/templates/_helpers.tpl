{{/* Chart name, truncated to a valid label value. */}}
{{- define "kvpick.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects. */}}
{{- define "kvpick.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart label value: name-version. */}}
{{- define "kvpick.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select kvpick's own pods. */}}
{{- define "kvpick.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpick.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "kvpick.labels" -}}
helm.sh/chart: {{ include "kvpick.chart" . }}
{{ include "kvpick.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{/* ServiceAccount kvpick runs as. */}}
{{- define "kvpick.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpick.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Name of the InferencePool kvpick serves. */}}
{{- define "kvpick.poolName" -}}
{{- default (include "kvpick.fullname" .) .Values.inferencePool.name }}
{{- end }}

{{/* Secret that holds the session-token signing key. */}}
{{- define "kvpick.sessionKeySecret" -}}
{{- default (printf "%s-session-key" (include "kvpick.fullname" .)) .Values.sessionKey.existingSecret }}
{{- end }}

{{/* Image reference. */}}
{{- define "kvpick.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Namespace of the Gateway the HTTPRoute attaches to. */}}
{{- define "kvpick.gatewayNamespace" -}}
{{- default .Release.Namespace .Values.envoyGateway.gateway.namespace }}
{{- end }}

{{/*
Namespace of the gateway's pods the NetworkPolicy admits: networkPolicy.gatewayNamespace,
else Envoy Gateway's default (provider none); empty with provider istio, which
kvpick.validate rejects.
*/}}
{{- define "kvpick.networkPolicy.gatewayNamespace" -}}
{{- if .Values.networkPolicy.gatewayNamespace }}
{{- .Values.networkPolicy.gatewayNamespace }}
{{- else if eq .Values.provider.name "none" }}
{{- "envoy-gateway-system" }}
{{- end }}
{{- end }}

{{/*
Labels of the gateway's pods the NetworkPolicy admits (YAML): networkPolicy.gatewayPodLabels,
else the labels the provider puts on every gateway pod it runs: Envoy Gateway's
proxies (its EnvoyAppLabel) or Istio's Gateway API deployments.
*/}}
{{- define "kvpick.networkPolicy.gatewayPodLabels" -}}
{{- if .Values.networkPolicy.gatewayPodLabels }}
{{- toYaml .Values.networkPolicy.gatewayPodLabels }}
{{- else if eq .Values.provider.name "istio" }}
gateway.istio.io/managed: istio.io-gateway-controller
{{- else }}
app.kubernetes.io/name: envoy
app.kubernetes.io/component: proxy
app.kubernetes.io/managed-by: envoy-gateway
{{- end }}
{{- end }}

{{/* The pool's matchLabels as a kubectl label selector: k1=v1,k2=v2. */}}
{{- define "kvpick.poolSelector" -}}
{{- $pairs := list }}
{{- range $k, $v := .Values.inferencePool.selector }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
The replica-sync server URL when sync is on, else empty: on when
replicaSync.enabled is true, or `auto` with replicaCount > 1 and a server (an
external url, or the bundled one). `true` without a server fails.
*/}}
{{- define "kvpick.replicaSyncUrl" -}}
{{- $s := .Values.replicaSync -}}
{{- $server := $s.url -}}
{{- if and (not $server) $s.bundled.enabled -}}
{{- $server = printf "redis://%s-sync:6379" (include "kvpick.fullname" .) -}}
{{- end -}}
{{- $on := or (eq (toString $s.enabled) "true") (and (eq (toString $s.enabled) "auto") (gt (int .Values.replicaCount) 1)) -}}
{{- if and $on (not $server) (eq (toString $s.enabled) "true") -}}
{{- fail "replicaSync.enabled=true needs a server: set replicaSync.url or replicaSync.bundled.enabled=true" -}}
{{- end -}}
{{- if $on -}}{{ $server }}{{- end -}}
{{- end -}}

{{/* Labels on the bundled replica-sync server's objects. */}}
{{- define "kvpick.syncLabels" -}}
helm.sh/chart: {{ include "kvpick.chart" . }}
app.kubernetes.io/name: {{ include "kvpick.name" . }}-sync
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: replica-sync
{{- end }}
