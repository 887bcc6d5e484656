{{/*
Combinations of values the schema cannot express; rendering fails with a
message naming the value to set. Included from deployment.yaml.
*/}}
{{- define "kvpick.validate" -}}
{{- if and .Values.inferencePool.create (empty .Values.inferencePool.selector) }}
{{- fail "inferencePool.selector is required: the labels of the model-server pods the InferencePool selects, e.g. --set inferencePool.selector.app=vllm-llama3 (or set inferencePool.create=false to use an existing pool)." }}
{{- end }}
{{- if not .Values.image.repository }}
{{- fail "image.repository is required: kvpick publishes no image. Build it from the repository root with `docker build --target kvpick -t REPOSITORY:TAG .` (docs/deploy.md), push it where the cluster pulls from, and set image.repository (and image.tag)." }}
{{- end }}
{{- if and .Values.inferencePool.create (ne .Values.kvpick.poolGroup "inference.networking.k8s.io") }}
{{- fail (printf "inferencePool.create=true makes an inference.networking.k8s.io/v1 InferencePool, but kvpick.poolGroup=%s would watch another group: keep kvpick.poolGroup=inference.networking.k8s.io, or set inferencePool.create=false to serve an existing pool of that group." .Values.kvpick.poolGroup) }}
{{- end }}
{{- if .Values.mtls.enabled }}
{{- if not .Values.kvpick.secureServing }}
{{- fail "mtls.enabled needs kvpick.secureServing=true: client certificates are checked in the TLS handshake." }}
{{- end }}
{{- if eq (empty .Values.mtls.clientCASecret) (empty .Values.mtls.clientCAConfigMap) }}
{{- fail "mtls.enabled needs exactly one of mtls.clientCASecret and mtls.clientCAConfigMap: the PEM bundle of CAs that sign the gateway's client certificates." }}
{{- end }}
{{- end }}
{{- if and (eq .Values.provider.name "istio") .Values.mtls.enabled (not .Values.provider.istio.destinationRule.clientCertSecret) }}
{{- fail "provider.name=istio with mtls.enabled needs provider.istio.destinationRule.clientCertSecret: the Secret with the client certificate Istio's gateway presents to kvpick." }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not (include "kvpick.networkPolicy.gatewayNamespace" .)) }}
{{- fail (printf "networkPolicy.gatewayNamespace is required with provider.name=%s: Istio runs a Gateway's pods in the Gateway's own namespace, which the chart cannot know, and the NetworkPolicy (on by default) admits only that namespace to the ext_proc port. Set it, e.g. --set networkPolicy.gatewayNamespace=<the Gateway's namespace>, or --set networkPolicy.enabled=false to admit every pod." .Values.provider.name) }}
{{- end }}
{{- if le (int .Values.terminationGracePeriodSeconds) (add (int .Values.preStopSleepSeconds) 5 | int) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) by more than 5 s: kvpick drains open streams for the difference minus 5 s (--drain-timeout-ms)." (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds)) }}
{{- end }}
{{- end }}

{{/* --drain-timeout-ms: the grace period left after the preStop sleep, minus 5 s for the exit. */}}
{{- define "kvpick.drainTimeoutMs" -}}
{{- mul (sub (sub (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds)) 5) 1000 }}
{{- end }}
