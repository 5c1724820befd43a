{{/*
The RayCluster spec shared by the RayService (serving: true) and the RayJob (serving: false).
Args: root (the chart context), groups (worker group values), serving (bool).
*/}}
{{- define "raylm.rayClusterSpec" -}}
{{- $v := .root.Values }}
{{- with $v.rayVersion }}
rayVersion: {{ . | quote }}
{{- end }}
{{- if include "raylm.rayTokenAuth" .root }}
# Ray's token authentication: KubeRay keeps a generated token in a Secret and sets
# RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in every Ray container; the GCS, the dashboard
# and its job API refuse callers without it.
authOptions:
  mode: token
{{- end }}
enableInTreeAutoscaling: {{ $v.autoscaler.enabled }}
{{- if $v.autoscaler.enabled }}
autoscalerOptions:
  idleTimeoutSeconds: {{ int $v.autoscaler.idleTimeoutSeconds }}
  upscalingMode: {{ $v.autoscaler.upscalingMode }}
  {{- with $v.autoscaler.version }}
  version: {{ . }}
  {{- end }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- with $v.autoscaler.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
headGroupSpec:
  # The head's GCS, dashboard and client ports stay inside the cluster: the model is served
  # through <name>-serve-svc, which carries the Serve port alone.
  serviceType: ClusterIP
  rayStartParams:
    {{- /* merge gives the first dict precedence: num-gpus "0" always wins. */}}
    {{- $params := merge (dict "num-gpus" "0") (deepCopy (default (dict) $v.head.rayStartParams)) (dict "dashboard-host" "0.0.0.0") }}
    {{- include "raylm.rayStartParams" (dict "params" $params) | trim | nindent 4 }}
  template:
    {{- include "raylm.podTemplate" (dict "root" .root "group" $v.head "kind" "head" "serving" .serving "gpus" 0) | trim | nindent 4 }}
{{- with .groups }}
workerGroupSpecs:
{{- range $g := . }}
  - groupName: {{ $g.name }}
    replicas: {{ int (hasKey $g "replicas" | ternary (get $g "replicas") $g.minReplicas) }}
    minReplicas: {{ int $g.minReplicas }}
    maxReplicas: {{ int $g.maxReplicas }}
    {{- with get $g "idleTimeoutSeconds" }}
    idleTimeoutSeconds: {{ int . }}
    {{- end }}
    rayStartParams:
      {{- $params := deepCopy (default (dict) (get $g "rayStartParams")) }}
      {{- $custom := include "raylm.groupCustomResources" (dict "root" $.root "group" $g) | fromJson }}
      {{- if and $custom (not (hasKey $params "resources")) }}
      {{- /* KubeRay's form: a JSON object in double quotes, for the autoscaler to read. */}}
      {{- $_ := set $params "resources" (printf "%q" (toJson $custom)) }}
      {{- end }}
      {{- if $params }}
      {{- include "raylm.rayStartParams" (dict "params" $params) | trim | nindent 6 }}
      {{- else }} {}
      {{- end }}
    template:
      {{- include "raylm.podTemplate" (dict "root" $.root "group" $g "kind" "worker" "serving" $.serving "gpus" (default 0 (get $g "gpus"))) | trim | nindent 6 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A Ray pod template. Args: root, group (head or a worker group's values), kind ("head" or
"worker"), serving (bool), gpus (GPUs per pod).
*/}}
{{- define "raylm.podTemplate" -}}
{{- $v := .root.Values }}
{{- $g := .group }}
{{- $annotations := merge (dict) (default (dict) (get $g "annotations")) (default (dict) $v.commonAnnotations) }}
metadata:
  labels:
    {{- include "raylm.podLabels" (dict "root" .root "extra" (get $g "labels")) | nindent 4 }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  # Time for the preStop drain (in-flight generations) before the pod is killed.
  terminationGracePeriodSeconds: {{ int $v.drain.terminationGracePeriodSeconds }}
  {{- with $v.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with get $g "nodeSelector" }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with get $g "tolerations" }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with get $g "affinity" }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ .kind }}
      image: {{ include "raylm.image" .root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- $env := concat (default (list) $v.env) (default (list) (get $g "env")) }}
      {{- with $env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or (eq .kind "head") .serving }}
      ports:
        {{- if eq .kind "head" }}
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
        {{- if .serving }}
        - {name: serve, containerPort: {{ int $v.serve.port }}}
        {{- end }}
      {{- end }}
      {{- $res := deepCopy (default (dict) (get $g "resources")) }}
      {{- if gt (float64 .gpus) 0.0 }}
      {{- range $part := list "limits" "requests" }}
      {{- $m := default (dict) (get $res $part) }}
      {{- $_ := set $m $v.gpuResourceName (int $.gpus) }}
      {{- $_ := set $res $part $m }}
      {{- end }}
      {{- end }}
      {{- with $res }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if and .serving (eq .kind "worker") $v.serve.readinessProbe.enabled }}
      {{- $p := $v.serve.readinessProbe }}
      # Serve proxy health on this pod: 503 while draining, absent without a replica.
      readinessProbe:
        httpGet: {path: {{ $p.path | quote }}, port: serve}
        initialDelaySeconds: {{ int $p.initialDelaySeconds }}
        periodSeconds: {{ int $p.periodSeconds }}
        timeoutSeconds: {{ int $p.timeoutSeconds }}
        failureThreshold: {{ int $p.failureThreshold }}
      {{- end }}
      lifecycle:
        preStop:
          exec:
            # Let open streams finish, then leave the Ray cluster cleanly.
            command: ["/bin/sh", "-c", "sleep {{ int $v.drain.preStopSleepSeconds }}; ray stop"]
      {{- $shm := and (eq .kind "worker") $v.shm.enabled }}
      {{- $mounts := default (list) $v.extraVolumeMounts }}
      {{- if $shm }}
      {{- $mounts = append $mounts (dict "name" "dshm" "mountPath" "/dev/shm") }}
      {{- end }}
      {{- with $mounts }}
      volumeMounts:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  {{- $volumes := default (list) $v.extraVolumes }}
  {{- if $shm }}
  {{- /* Memory-backed: Ray's object store and NCCL's intra-pod transport live here. */}}
  {{- $dir := dict "medium" "Memory" }}
  {{- with $v.shm.sizeLimit }}{{ $_ := set $dir "sizeLimit" . }}{{ end }}
  {{- $volumes = append $volumes (dict "name" "dshm" "emptyDir" $dir) }}
  {{- end }}
  {{- with $volumes }}
  volumes:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
Custom Ray resources a worker group declares (JSON object) so that the KubeRay autoscaler
knows which group can hold the placement group bundles that ask for them: with
llmConfig.accelerator_type set, every GPU group offers "accelerator_type:<T>" (Ray also
detects it on a running GPU node, but the autoscaler scales from zero pods on the declared
value alone). Args: root, group.
*/}}
{{- define "raylm.groupCustomResources" -}}
{{- $res := dict }}
{{- $t := .root.Values.llmConfig.accelerator_type }}
{{- if and $t (gt (float64 (default 0 (get .group "gpus"))) 0.0) }}
{{- $_ := set $res (printf "accelerator_type:%s" $t) 1 }}
{{- end }}
{{- toJson $res }}
{{- end }}

{{/*
"true" when the Ray cluster runs with token authentication (security.rayTokenAuth; auto:
from rayVersion 2.52.0, the first Ray that has it), else "".
*/}}
{{- define "raylm.rayTokenAuth" -}}
{{- $mode := .Values.security.rayTokenAuth }}
{{- $version := .Values.rayVersion }}
{{- if eq (toString $mode) "true" }}true
{{- else if and (eq (toString $mode) "auto") $version (semverCompare ">=2.52.0-0" $version) }}true
{{- end }}
{{- end }}
