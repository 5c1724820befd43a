{{/*
Checks values.schema.json cannot express. Each failure names the value and what to change.
*/}}
{{- define "raylm.validate" -}}
{{- $v := .Values }}
{{- $name := include "raylm.fullname" . }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "raylm: resource name %q must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter) as KubeRay requires; set fullnameOverride." $name) }}
{{- end }}

{{- /* Ray token authentication needs Ray 2.52.0 or newer (and KubeRay needs rayVersion). */}}
{{- if eq (toString $v.security.rayTokenAuth) "true" }}
{{- if not $v.rayVersion }}
{{- fail "raylm: security.rayTokenAuth=true needs rayVersion (KubeRay enables token authentication only for a stated Ray 2.52.0 or newer)." }}
{{- else if not (semverCompare ">=2.52.0-0" $v.rayVersion) }}
{{- fail (printf "raylm: security.rayTokenAuth=true but rayVersion %s has no token authentication (Ray 2.52.0 or newer); upgrade the image or set security.rayTokenAuth=auto." $v.rayVersion) }}
{{- end }}
{{- end }}

{{- /* Serve replica autoscaling. */}}
{{- $dc := $v.llmConfig.deployment_config }}
{{- $as := $dc.autoscaling_config }}
{{- if gt (float64 $as.min_replicas) (float64 $as.max_replicas) }}
{{- fail (printf "raylm: llmConfig.deployment_config.autoscaling_config.min_replicas (%v) must not exceed max_replicas (%v)." $as.min_replicas $as.max_replicas) }}
{{- end }}
{{- if and (kindIs "invalid" $dc.num_replicas) (gt (float64 $as.target_ongoing_requests) (float64 $dc.max_ongoing_requests)) }}
{{- fail (printf "raylm: llmConfig.deployment_config.autoscaling_config.target_ongoing_requests (%v) exceeds max_ongoing_requests (%v): a replica could never reach its target." $as.target_ongoing_requests $dc.max_ongoing_requests) }}
{{- end }}

{{- include "raylm.validateGroups" (dict "groups" $v.workerGroups "path" "workerGroups") }}
{{- if $v.batch.enabled }}
{{- include "raylm.validateGroups" (dict "groups" $v.batch.workerGroups "path" "batch.workerGroups") }}
{{- end }}

{{- /* GPUs. A replica's placement group holds bundle 0 ({"CPU": 1}, the replica), then one
bundle per pipeline stage (and DP rank) with that stage's whole tensor-parallel group:
{"GPU": tensor_parallel_size x num_gpus_per_worker}. Ray puts a bundle on one node, so a TP
group must fit inside one worker pod (stages may use different pods), and a pod of g GPUs
holds floor(g / group GPUs) groups: capacity is counted in whole TP groups, and min_replicas
(or num_replicas) replicas of PP x DP groups each must fit. */}}
{{- $llm := include "raylm.llmConfig" . | fromYaml }}
{{- $ek := $llm.engine_kwargs }}
{{- $tp := int (default 1 $ek.tensor_parallel_size) }}
{{- $pp := int (default 1 $ek.pipeline_parallel_size) }}
{{- $dp := int (default 1 $ek.data_parallel_size) }}
{{- $gpw := float64 $llm.num_gpus_per_worker }}
{{- $maxPerPod := float64 (include "raylm.maxGpusPerPod" .) }}
{{- if and $llm.accelerator_type (eq $maxPerPod 0.0) }}
{{- fail (printf "raylm: llmConfig.accelerator_type is %q but no worker group has gpus > 0; give a worker group GPUs or unset accelerator_type." $llm.accelerator_type) }}
{{- end }}
{{- if gt $gpw 0.0 }}
{{- $groupGpus := mulf (float64 $tp) $gpw }}
{{- if gt $groupGpus $maxPerPod }}
{{- fail (printf "raylm: llmConfig.engine_kwargs.tensor_parallel_size (%d) x llmConfig.num_gpus_per_worker (%v) = %v GPUs form one tensor-parallel group, which Ray places inside one worker pod, but every worker group has fewer (largest workerGroups[].gpus: %v). Raise a worker group's gpus to at least %v, or lower tensor_parallel_size (pipeline_parallel_size splits a model across pods)." $tp $gpw $groupGpus $maxPerPod $groupGpus) }}
{{- end }}
{{- $capacity := 0 }}
{{- range $v.workerGroups }}
{{- $perPod := int (floor (divf (float64 (default 0 (get . "gpus"))) $groupGpus)) }}
{{- $capacity = add $capacity (mul (int .maxReplicas) $perPod) }}
{{- end }}
{{- $floor := $as.min_replicas }}
{{- if not (kindIs "invalid" (get $dc "num_replicas")) }}{{ $floor = $dc.num_replicas }}{{ end }}
{{- $replicas := max 1 (int $floor) }}
{{- $need := mul $replicas $pp $dp }}
{{- if gt $need $capacity }}
{{- fail (printf "raylm: %d Serve replica(s) x pipeline_parallel_size (%d) x data_parallel_size (%d) need %d tensor-parallel groups of %v GPUs (tensor_parallel_size %d x num_gpus_per_worker %v), each inside one pod, but the worker groups hold at most %d (sum of maxReplicas x floor(gpus / %v)); raise maxReplicas, or gpus to a multiple of %v, or lower min_replicas or the parallel sizes." $replicas $pp $dp $need $groupGpus $tp $gpw $capacity $groupGpus $groupGpus) }}
{{- end }}
{{- end }}

{{- /* Drain timing. */}}
{{- $grace := float64 $v.drain.terminationGracePeriodSeconds }}
{{- $sleep := float64 $v.drain.preStopSleepSeconds }}
{{- if lt $grace (addf $sleep 10) }}
{{- fail (printf "raylm: drain.terminationGracePeriodSeconds (%v) must be at least drain.preStopSleepSeconds (%v) + 10, or Kubernetes kills the pod before `ray stop` runs." $v.drain.terminationGracePeriodSeconds $v.drain.preStopSleepSeconds) }}
{{- end }}

{{- /* Batch. */}}
{{- if $v.batch.enabled }}
{{- if or (not $v.batch.input) (not $v.batch.output) }}
{{- fail "raylm: batch.enabled needs batch.input and batch.output (JSONL paths the Ray head can reach)." }}
{{- end }}
{{- if not (or (hasPrefix "/" $v.batch.output) (contains "://" $v.batch.output)) }}
{{- fail (printf "raylm: batch.output %q is relative: it would be written in the job's temporary working directory and lost. Use an object-store URI (s3://bucket/out.jsonl) or an absolute path on a volume mounted on the head (extraVolumes, e.g. /data/out.jsonl)." $v.batch.output) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Worker groups: unique names, minReplicas <= replicas <= maxReplicas. Args: groups, path. */}}
{{- define "raylm.validateGroups" -}}
{{- $path := .path }}
{{- $seen := dict }}
{{- range $i, $g := .groups }}
{{- if hasKey $seen $g.name }}
{{- fail (printf "raylm: %s[%d].name %q is used twice; group names must be unique." $path $i $g.name) }}
{{- end }}
{{- $_ := set $seen $g.name true }}
{{- if gt (float64 $g.minReplicas) (float64 $g.maxReplicas) }}
{{- fail (printf "raylm: %s[%d] (%s): minReplicas (%v) must not exceed maxReplicas (%v)." $path $i $g.name $g.minReplicas $g.maxReplicas) }}
{{- end }}
{{- if hasKey $g "replicas" }}
{{- if or (lt (float64 $g.replicas) (float64 $g.minReplicas)) (gt (float64 $g.replicas) (float64 $g.maxReplicas)) }}
{{- fail (printf "raylm: %s[%d] (%s): replicas (%v) must lie between minReplicas (%v) and maxReplicas (%v)." $path $i $g.name $g.replicas $g.minReplicas $g.maxReplicas) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
