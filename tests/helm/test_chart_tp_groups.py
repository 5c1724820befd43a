"""GPU placement by whole tensor-parallel groups. A replica's placement group has one bundle
per pipeline stage holding the stage's whole TP group (tensor_parallel_size x
num_gpus_per_worker GPUs), and Ray puts a bundle on one node: the chart must give the TP
group a pod that holds it, count its capacity in whole groups, run the engine in Ray actors
of its own by default, and size Serve's request limits for a GPU replica."""

from __future__ import annotations

import pytest
import yaml

from raylm.cluster.serve.deployment.app import replica_bundles, runs_model_in_replica
from raylm.cluster.serve.deployment.config import EngineKwargs, load_app_config


def _llm_configs(svc: dict) -> list[dict]:
    serve = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    return app["args"]["llm_configs"]


def _pod_gpus(svc: dict) -> dict[str, int]:
    """GPUs each worker group's pod requests, by group name."""
    out = {}
    for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        out[g["groupName"]] = limits.get("nvidia.com/gpu", 0)
    return out


def _group(name: str, gpus: int, max_replicas: int) -> dict:
    return {"name": name, "minReplicas": 0, "maxReplicas": max_replicas, "gpus": gpus}


def _tp(tp: int, pp: int = 1, min_replicas: int = 1, max_replicas: int = 4) -> dict:
    return {"engine_kwargs": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            "deployment_config": {"autoscaling_config": {
                "min_replicas": min_replicas, "max_replicas": max_replicas,
                "target_ongoing_requests": 16}}}


# (a) A TP group inside one pod.

def test_tp2_pp2_on_the_default_worker_group_keeps_each_tp_group_in_one_pod(
        helm_template, crd_errors):
    svc = helm_template({"llmConfig": {"engine_kwargs": {
        "tensor_parallel_size": 2, "pipeline_parallel_size": 2}}}).one("RayService")
    assert crd_errors(svc) == []
    pods = _pod_gpus(svc)
    assert pods == {"gpu-workers": 8}  # the default group: one 8-GPU node per pod
    assert all(g >= 2 for g in pods.values() if g)
    (cfg,) = load_app_config({"llm_configs": _llm_configs(svc)}).llm_configs
    bundles = replica_bundles(cfg)
    # Whatever the bundle layout, the GPUs of one replica are TP x PP, and no bundle (which
    # Ray puts on one node) asks for more GPUs than one pod has.
    assert sum(b.get("GPU", 0) for b in bundles) == 4
    assert max(b.get("GPU", 0) for b in bundles) <= max(pods.values())
    assert bundles[0] == {"CPU": 1.0}


def test_tp8_fits_one_default_pod(helm_template):
    svc = helm_template({"llmConfig": {"engine_kwargs": {"tensor_parallel_size": 8}}}
                        ).one("RayService")
    assert _pod_gpus(svc) == {"gpu-workers": 8}
    (group,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 1, 2)
    requests = group["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": 8}


# (b) A TP group larger than every pod is refused.

@pytest.mark.parametrize("tp,gpw,groups,need", [
    (4, None, [_group("g", 2, 2)], 4),
    (4, None, [_group("small", 2, 4), _group("mid", 3, 4)], 4),
    (2, 2, [_group("g", 3, 4)], 4),
])
def test_tp_group_larger_than_every_pod_is_refused(helm_template, tp, gpw, groups, need):
    llm = {"engine_kwargs": {"tensor_parallel_size": tp}, "num_gpus_per_worker": gpw}
    out = helm_template({"llmConfig": llm, "workerGroups": groups})
    assert out.returncode != 0, out.stdout[:500]
    largest = max(g["gpus"] for g in groups)
    assert (f"llmConfig.engine_kwargs.tensor_parallel_size ({tp}) x "
            f"llmConfig.num_gpus_per_worker ({gpw or 1}) = {need} GPUs") in out.stderr
    assert f"largest workerGroups[].gpus: {largest}" in out.stderr
    assert f"Raise a worker group's gpus to at least {need}" in out.stderr


def test_tp_group_equal_to_the_pod_renders(helm_template):
    out = helm_template({"llmConfig": {"engine_kwargs": {"tensor_parallel_size": 4}},
                         "workerGroups": [_group("small", 2, 4), _group("big", 4, 1)]})
    assert out.returncode == 0, out.stderr


# (c) Defaults: the engine in Ray actors of its own, Serve limits sized for a GPU replica.

def test_default_render_runs_the_engine_in_ray_actors_with_gpu_serve_limits(helm_template):
    svc = helm_template().one("RayService")
    (raw,) = _llm_configs(svc)
    assert raw["engine_kwargs"]["distributed_executor_backend"] == "ray"
    dc = raw["deployment_config"]
    assert dc["max_ongoing_requests"] == 192
    assert dc["autoscaling_config"]["target_ongoing_requests"] == 96
    (cfg,) = load_app_config({"llm_configs": [raw]}).llm_configs
    assert cfg.engine_kwargs.world_size == 1 and cfg.engine_kwargs.data_parallel_size == 1
    assert cfg.engine_kwargs.distributed_executor_backend == "ray"
    assert not runs_model_in_replica(cfg)
    # A replica takes more requests at once than its engine batches, and the autoscaler's
    # target is a sizeable share of that batch, never above the cap.
    max_num_seqs = EngineKwargs().max_num_seqs
    options = cfg.deployment_config.to_serve_options()
    assert options["max_ongoing_requests"] > max_num_seqs
    target = options["autoscaling_config"]["target_ongoing_requests"]
    assert max_num_seqs // 2 <= target <= options["max_ongoing_requests"]


@pytest.mark.parametrize("backend,rendered", [("uni", "uni"), ("ray", "ray"), (None, "ray")])
def test_a_set_executor_backend_wins(helm_template, backend, rendered):
    svc = helm_template({"llmConfig": {"engine_kwargs": {
        "distributed_executor_backend": backend}}}).one("RayService")
    (raw,) = _llm_configs(svc)
    assert raw["engine_kwargs"]["distributed_executor_backend"] == rendered
    (cfg,) = load_app_config({"llm_configs": [raw]}).llm_configs
    assert runs_model_in_replica(cfg) is (rendered == "uni")


# (d) Capacity in whole TP groups.

@pytest.mark.parametrize("llm,groups,ok", [
    # Three 3-GPU pods at TP = 2 hold 3 groups (one GPU of each pod is left over), not 9 // 2.
    (_tp(2, min_replicas=3), [_group("g", 3, 3)], True),
    (_tp(2, min_replicas=4), [_group("g", 3, 3)], False),
    # PP = 2: a replica needs two groups.
    (_tp(2, pp=2, min_replicas=1), [_group("g", 3, 3)], True),
    (_tp(2, pp=2, min_replicas=2), [_group("g", 3, 3)], False),
    # An 8-GPU pod holds two TP = 4 groups, a 3-GPU pod none.
    (_tp(4, min_replicas=4), [_group("big", 8, 2), _group("small", 3, 10)], True),
    (_tp(4, min_replicas=5, max_replicas=5), [_group("big", 8, 2), _group("small", 3, 10)],
     False),
])
def test_capacity_counts_whole_tp_groups(helm_template, llm, groups, ok):
    out = helm_template({"llmConfig": llm, "workerGroups": groups})
    if ok:
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode != 0, out.stdout[:500]
    ek = llm["engine_kwargs"]
    tp, pp = ek["tensor_parallel_size"], ek["pipeline_parallel_size"]
    replicas = llm["deployment_config"]["autoscaling_config"]["min_replicas"]
    held = sum(g["maxReplicas"] * (g["gpus"] // tp) for g in groups)
    assert (f"{replicas} Serve replica(s) x pipeline_parallel_size ({pp}) x "
            f"data_parallel_size (1) need {replicas * pp} tensor-parallel groups of {tp} GPUs"
            ) in out.stderr
    assert f"the worker groups hold at most {held} (sum of maxReplicas x floor(gpus / {tp}))" \
        in out.stderr


def test_num_replicas_counts_in_tp_groups_too(helm_template):
    groups = [_group("g", 3, 3)]
    fixed = {"engine_kwargs": {"tensor_parallel_size": 2},
             "deployment_config": {"num_replicas": 4}}
    out = helm_template({"llmConfig": fixed, "workerGroups": groups})
    assert out.returncode != 0
    assert "4 Serve replica(s)" in out.stderr and "hold at most 3" in out.stderr
    fixed["deployment_config"]["num_replicas"] = 3
    assert helm_template({"llmConfig": fixed, "workerGroups": groups}).returncode == 0
