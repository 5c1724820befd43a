{{/*
Names. KubeRay limits RayService and RayJob names to 47 characters (it appends 6 for the
RayCluster and "-serve-svc" must stay within 63) and requires DNS-1035 labels.
*/}}
{{- define "raylm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" }}
{{- end }}

{{- define "raylm.fullname" -}}
{{- $name := "" }}
{{- if .Values.fullnameOverride }}
{{- $name = .Values.fullnameOverride }}
{{- else }}
{{- $base := default .Chart.Name .Values.nameOverride }}
{{- if contains $base .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name $base }}
{{- end }}
{{- end }}
{{- $name | trunc 47 | trimSuffix "-" }}
{{- end }}

{{- define "raylm.batchName" -}}
{{- printf "%s-batch" (include "raylm.fullname" . | trunc 41 | trimSuffix "-") }}
{{- end }}

{{- define "raylm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of the rendered objects. */}}
{{- define "raylm.labels" -}}
helm.sh/chart: {{ include "raylm.chart" . }}
{{ include "raylm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "raylm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raylm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Pod labels. Not app.kubernetes.io/name or created-by: KubeRay sets those on Ray pods itself.
Args: root, extra (a group's labels).
*/}}
{{- define "raylm.podLabels" -}}
{{- $labels := merge (dict) (default (dict) .extra) (default (dict) .root.Values.commonLabels) }}
{{- $_ := set $labels "app.kubernetes.io/instance" .root.Release.Name }}
{{- $_ := set $labels "app.kubernetes.io/part-of" (include "raylm.name" .root) }}
{{- toYaml $labels }}
{{- end }}

{{- define "raylm.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* A word for `sh -c`: left bare when safe, else single-quoted. */}}
{{- define "raylm.shellQuote" -}}
{{- $s := toString . }}
{{- if regexMatch "^[A-Za-z0-9_./:=,@%+-]+$" $s }}{{ $s }}{{ else }}{{ printf "'%s'" (replace "'" "'\\''" $s) }}{{ end }}
{{- end }}

{{/* Ray start params as the CRD wants them: a map of strings. Args: params (dict). */}}
{{- define "raylm.rayStartParams" -}}
{{- range $k, $v := .params }}
{{ $k | quote }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/*
The largest GPU count of one pod among the worker groups that serve the LLM.
*/}}
{{- define "raylm.maxGpusPerPod" -}}
{{- $max := 0.0 }}
{{- range .Values.workerGroups }}
{{- $max = maxf $max (float64 (default 0 (get . "gpus"))) }}
{{- end }}
{{- $max }}
{{- end }}

{{/*
The LLMConfig handed to raylm.cluster:build_openai_app, as YAML: llmConfig from the values,
with num_gpus_per_worker resolved (null: 1 when a worker group has GPUs, else 0),
engine_kwargs.distributed_executor_backend defaulted to "ray" and autoscaling_config
dropped when num_replicas is set.
*/}}
{{- define "raylm.llmConfig" -}}
{{- $cfg := deepCopy .Values.llmConfig }}
{{- $ek := default (dict) (get $cfg "engine_kwargs") }}
{{- if not (get $ek "distributed_executor_backend") }}
{{- /* As `raylm serve` does (SERVE_EXECUTOR_BACKEND in cluster/cli.py): even at
TP = PP = DP = 1 the model runs in a Ray worker actor of its own, not in the Serve replica,
so a forward step never waits for the replica's event loop (HTTP, tokenizing, streaming) to
release the GIL; with the model in the replica, bench/serve.py served 8-14% fewer tokens/s.
With TP, PP or DP above 1 "ray" is the engine's own default anyway. A value set in
engine_kwargs wins ("uni": the model in the replica's process). */}}
{{- $_ := set $ek "distributed_executor_backend" "ray" }}
{{- end }}
{{- $_ := set $cfg "engine_kwargs" $ek }}
{{- $dc := $cfg.deployment_config }}
{{- if not (kindIs "invalid" (get $dc "num_replicas")) }}
{{- /* A fixed replica count replaces autoscaling; LLMConfig rejects both at once. */}}
{{- $_ := unset $dc "autoscaling_config" }}
{{- end }}
{{- if kindIs "invalid" (get $cfg "num_gpus_per_worker") }}
{{- $gpu := 0 }}
{{- if gt (float64 (include "raylm.maxGpusPerPod" .)) 0.0 }}{{ $gpu = 1 }}{{ end }}
{{- $_ := set $cfg "num_gpus_per_worker" $gpu }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The Ray Serve config (RayService spec.serveConfigV2), as YAML. */}}
{{- define "raylm.serveConfig" -}}
{{- $s := .Values.serve }}
{{- $http := dict "host" "0.0.0.0" "port" (int $s.port) }}
{{- if not (kindIs "invalid" $s.requestTimeoutS) }}{{ $_ := set $http "request_timeout_s" $s.requestTimeoutS }}{{ end }}
{{- if not (kindIs "invalid" $s.keepAliveTimeoutS) }}{{ $_ := set $http "keep_alive_timeout_s" $s.keepAliveTimeoutS }}{{ end }}
{{- $args := dict "llm_configs" (list (include "raylm.llmConfig" . | fromYaml)) }}
{{- $app := dict "name" $s.applicationName "route_prefix" $s.routePrefix "import_path" "raylm.cluster:build_openai_app" "args" $args }}
{{- toYaml (dict "proxy_location" $s.proxyLocation "http_options" $http "applications" (list $app)) }}
{{- end }}
