"""helm lint / helm template of helm/raylm, checked against KubeRay's CRDs and raylm's own
serving config: what the chart renders is what build_openai_app will load."""

from __future__ import annotations

import copy
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

from raylm.cluster.serve.deployment.config import load_app_config

CHART = Path(__file__).resolve().parents[2] / "helm" / "raylm"

OVERRIDE = {
    "llmConfig": {
        "model_loading_config": {"model_id": "llama-70b", "model_source": "/models/llama-70b"},
        "engine_kwargs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                          "data_parallel_size": 1, "max_num_seqs": 96,
                          "kv_cache_memory_bytes": 8589934592},
        "deployment_config": {
            "max_ongoing_requests": 48,
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                   "target_ongoing_requests": 12},
        },
        "accelerator_type": "H100",
    },
    "workerGroups": [
        {"name": "gpu-a", "replicas": 1, "minReplicas": 1, "maxReplicas": 4, "gpus": 4,
         "resources": {"requests": {"cpu": "16", "memory": "64Gi"},
                       "limits": {"cpu": "16", "memory": "64Gi"}},
         "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
         "rayStartParams": {"num-cpus": 16}},
        {"name": "gpu-b", "minReplicas": 0, "maxReplicas": 2, "gpus": 8},
    ],
    "batch": {"enabled": True, "input": "/data/in.jsonl", "output": "/data/out put.jsonl",
              "extraArgs": ["--model", "/models/llama-70b"],
              "runtimeEnv": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
              "ttlSecondsAfterFinished": 600},
    "drain": {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 240},
}


def _container(pod_template: dict) -> dict:
    return pod_template["spec"]["containers"][0]


def _args(rayservice: dict) -> dict:
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "raylm.cluster:build_openai_app"
    assert set(app["args"]) == {"llm_configs"}
    return app["args"]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("override", [False, True])
def test_lint(helm_bin, tmp_path, strict, override):
    cmd = [helm_bin, "lint", str(CHART)] + (["--strict"] if strict else [])
    if override:
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(OVERRIDE))
        cmd += ["--values", str(tmp_path / "values.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_render_is_one_valid_rayservice(helm_template, crd_errors):
    out = helm_template()
    assert [d["kind"] for d in out.docs] == ["RayService"]
    svc = out.one("RayService")
    assert crd_errors(svc) == []
    spec = svc["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in _container(head["template"])["ports"]}
    assert ports["serve"] == 8000 and ports["dashboard"] == 8265
    # The head keeps KubeRay's own probe: Serve is deployed only after the head is ready.
    assert "readinessProbe" not in _container(head["template"])
    (group,) = cluster["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 1, 2)
    worker = _container(group["template"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    probe = worker["readinessProbe"]["httpGet"]
    assert probe == {"path": "/-/healthz", "port": "serve"}
    cfg = load_app_config(_args(svc)).llm_configs[0]
    assert cfg.model_id == "raylm-demo" and cfg.model_loading_config.is_demo
    assert cfg.num_gpus_per_worker == 1 and cfg.use_gpu  # derived from the GPU worker group


def test_override_render_matches_values(helm_template, crd_errors):
    out = helm_template(OVERRIDE)
    assert sorted(d["kind"] for d in out.docs) == ["RayJob", "RayService"]
    svc = out.one("RayService")
    assert crd_errors(svc) == []

    app = load_app_config(_args(svc))
    (cfg,) = app.llm_configs
    ek = cfg.engine_kwargs
    assert (ek.tensor_parallel_size, ek.pipeline_parallel_size, ek.data_parallel_size) == (2, 2, 1)
    assert ek.max_num_seqs == 96 and ek.kv_cache_memory_bytes == 8589934592
    auto = cfg.deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 12)
    assert cfg.deployment_config.max_ongoing_requests == 48
    assert cfg.model_loading_config.model_source == "/models/llama-70b"
    assert cfg.accelerator_type == "H100"
    bundles = cfg.get_placement_group().bundles
    # The replica's CPU, then TP x PP = 4 GPUs, none in a bundle bigger than a TP group.
    assert bundles[0] == {"CPU": 1.0}
    assert sum(b["GPU"] for b in bundles[1:]) == 4.0
    assert all(0 < b["GPU"] <= 2 for b in bundles[1:])

    groups = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["gpu-a", "gpu-b"]
    a, b = groups
    assert (a["minReplicas"], a["replicas"], a["maxReplicas"]) == (1, 1, 4)
    assert (b["minReplicas"], b["replicas"], b["maxReplicas"]) == (0, 0, 2)
    assert a["rayStartParams"] == {  # stringified for the CRD; accelerator for the autoscaler
        "num-cpus": "16", "resources": "\"{\\\"accelerator_type:H100\\\":1}\""}
    assert _container(a["template"])["resources"]["limits"] == {
        "cpu": "16", "memory": "64Gi", "nvidia.com/gpu": 4}
    assert _container(b["template"])["resources"]["requests"] == {"nvidia.com/gpu": 8}
    assert a["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert a["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    for pod in [svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"],
                a["template"], b["template"]]:
        assert pod["spec"]["terminationGracePeriodSeconds"] == 300
        assert "sleep 240; ray stop" in _container(pod)["lifecycle"]["preStop"]["exec"]["command"][-1]


def test_override_rayjob(helm_template, crd_errors):
    job = helm_template(OVERRIDE).one("RayJob")
    assert crd_errors(job) == []
    spec = job["spec"]
    assert spec["entrypoint"] == ("raylm batch --input /data/in.jsonl --output "
                                  "'/data/out put.jsonl' --num-replicas 1 "
                                  "--model /models/llama-70b")
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 600
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    cluster = spec["rayClusterSpec"]
    assert [g["groupName"] for g in cluster["workerGroupSpecs"]] == ["gpu-a", "gpu-b"]
    # No Serve in a batch cluster: no serve port, no Serve readiness probe.
    for g in cluster["workerGroupSpecs"]:
        assert "readinessProbe" not in _container(g["template"])
        assert "ports" not in _container(g["template"])


def test_rayjob_on_existing_cluster(helm_template, crd_errors):
    job = helm_template({"batch": {"enabled": True, "input": "a.jsonl", "output": "/data/b.jsonl",
                                   "clusterName": "shared-ray"}}).one("RayJob")
    assert crd_errors(job) == []
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "shared-ray"}
    # KubeRay rejects shutdownAfterJobFinishes / a cluster spec in clusterSelector mode.
    assert "rayClusterSpec" not in job["spec"] and "shutdownAfterJobFinishes" not in job["spec"]


def test_embedded_cluster_is_a_valid_raycluster(helm_template, crd_errors):
    svc = helm_template(OVERRIDE).one("RayService")
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"},
               "spec": svc["spec"]["rayClusterConfig"]}
    assert crd_errors(cluster) == []


def test_serve_config_is_valid_for_ray_serve(helm_template):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema
    svc = helm_template(OVERRIDE).one("RayService")
    serve = ServeDeploySchema.model_validate(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    assert serve.http_options.port == 8000
    assert serve.applications[0].route_prefix == "/"


def test_names_fit_kuberay_limits(helm_template):
    release = "a-very-long-release-name-that-goes-on-and-on-forever"
    out = helm_template({"batch": {"enabled": True, "input": "i", "output": "s3://b/o"}},
                        release=release)
    for doc in out.docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 47 and name[0].isalpha() and not name.endswith("-"), name


def test_validator_rejects_broken_manifests(helm_template, crd_errors):
    """The CRD check must be able to fail: break a valid manifest in several ways."""
    svc = helm_template().one("RayService")
    assert crd_errors(svc) == []
    cluster = svc["spec"]["rayClusterConfig"]

    def broken(mutate):
        doc = copy.deepcopy(svc)
        mutate(doc["spec"]["rayClusterConfig"])
        return crd_errors(doc)

    errs = broken(lambda c: c["workerGroupSpecs"][0].update(replicas="two"))
    assert any("workerGroupSpecs/0/replicas" in e for e in errs), errs
    errs = broken(lambda c: _container(c["headGroupSpec"]["template"]).update(bogusField=1))
    assert any("bogusField" in e for e in errs), errs
    errs = broken(lambda c: c["workerGroupSpecs"][0].pop("groupName"))
    assert any("groupName" in e for e in errs), errs
    errs = broken(lambda c: _container(c["headGroupSpec"]["template"])["resources"]["limits"]
                  .update(cpu="lots"))
    assert any("limits/cpu" in e for e in errs), errs
    errs = broken(lambda c: c["autoscalerOptions"].update(upscalingMode="Eager"))
    assert any("upscalingMode" in e for e in errs), errs
    errs = broken(lambda c: c["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}))
    assert any("rayStartParams/num-gpus" in e for e in errs), errs
    assert cluster == svc["spec"]["rayClusterConfig"]  # the rendered manifest was not touched


def test_cpu_only_render(helm_template, crd_errors):
    """A worker group without GPUs: no GPU resources, and the LLMConfig runs on CPU."""
    cpu_group = {"name": "cpu", "minReplicas": 1, "maxReplicas": 3, "gpus": 0,
                 "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}
    svc = helm_template({"workerGroups": [cpu_group],
                         "llmConfig": {"engine_kwargs": {"tensor_parallel_size": 2}}}
                        ).one("RayService")
    assert crd_errors(svc) == []
    (group,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert _container(group["template"])["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}
    assert "tolerations" not in group["template"]["spec"]
    cfg = load_app_config(_args(svc)).llm_configs[0]
    assert cfg.num_gpus_per_worker == 0 and not cfg.use_gpu
    bundles = cfg.default_placement_group().bundles
    # The replica's CPU, then one CPU per TP rank, never a GPU.
    assert bundles[0] == {"CPU": 1.0} and sum(b["CPU"] for b in bundles) == 3.0
    assert all(set(b) == {"CPU"} for b in bundles)


def test_fixed_replica_count_replaces_autoscaling(helm_template, crd_errors):
    svc = helm_template({"llmConfig": {"deployment_config": {"num_replicas": 3}}}
                        ).one("RayService")
    assert crd_errors(svc) == []
    (llm,) = _args(svc)["llm_configs"]
    assert "autoscaling_config" not in llm["deployment_config"]
    cfg = load_app_config(_args(svc)).llm_configs[0]
    assert cfg.deployment_config.to_serve_options() == {
        "max_ongoing_requests": 192, "num_replicas": 3, "graceful_shutdown_timeout_s": 60}
