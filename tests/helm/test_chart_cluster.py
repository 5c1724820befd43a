"""What a GPU cluster needs from the chart: /dev/shm as a memory-backed volume on worker
pods, and the custom resources the placement asks for declared on the worker groups, so
the KubeRay autoscaler can tell which group satisfies a pending bundle."""

from __future__ import annotations

import json

import yaml

from raylm.cluster.serve.deployment.app import replica_bundles
from raylm.cluster.serve.deployment.config import load_app_config

GPU_AND_CPU = {
    "llmConfig": {"accelerator_type": "A10G",
                  "engine_kwargs": {"tensor_parallel_size": 2}},
    "workerGroups": [
        {"name": "gpu", "minReplicas": 0, "maxReplicas": 2, "gpus": 2},
        {"name": "cpu", "minReplicas": 0, "maxReplicas": 2, "gpus": 0},
    ],
}


def _groups(svc: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _declared(group: dict) -> dict[str, float]:
    """The custom resources a group's `ray start` declares (KubeRay: a quoted JSON object)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def test_worker_pods_mount_a_memory_backed_dev_shm(helm_template, crd_errors):
    svc = helm_template(GPU_AND_CPU).one("RayService")
    assert crd_errors(svc) == []
    for group in _groups(svc).values():
        spec = group["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "dshm" not in [v["name"] for v in head.get("volumes", [])]


def test_shm_size_and_switch_and_extra_volumes_together(helm_template, crd_errors):
    extra = {"extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
             "extraVolumeMounts": [{"name": "models", "mountPath": "/models"}]}
    svc = helm_template({**extra, "shm": {"enabled": True, "sizeLimit": None}}).one("RayService")
    assert crd_errors(svc) == []
    (group,) = _groups(svc).values()
    spec = group["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["models", "dshm"]
    assert spec["volumes"][1]["emptyDir"] == {"medium": "Memory"}
    off = helm_template({**extra, "shm": {"enabled": False, "sizeLimit": "1Gi"}}).one("RayService")
    (group,) = _groups(off).values()
    assert [v["name"] for v in group["template"]["spec"]["volumes"]] == ["models"]


def test_gpu_groups_declare_the_resources_the_placement_asks_for(helm_template, crd_errors):
    svc = helm_template(GPU_AND_CPU).one("RayService")
    assert crd_errors(svc) == []
    groups = _groups(svc)
    assert _declared(groups["gpu"]) == {"accelerator_type:A10G": 1}
    assert _declared(groups["cpu"]) == {}  # cannot hold a GPU bundle: must not claim to
    serve = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (cfg,) = load_app_config(serve["applications"][0]["args"]).llm_configs
    asked = {k for b in replica_bundles(cfg) for k in b if k not in ("CPU", "GPU")}
    assert asked == {"accelerator_type:A10G"}
    assert asked <= set(_declared(groups["gpu"]))


def test_no_accelerator_type_declares_nothing_and_user_resources_win(helm_template):
    plain = helm_template({"workerGroups": GPU_AND_CPU["workerGroups"]}).one("RayService")
    assert all("resources" not in g["rayStartParams"] for g in _groups(plain).values())
    mine = '"{\\"accelerator_type:A10G\\": 2, \\"zone_a\\": 1}"'
    own = {**GPU_AND_CPU, "workerGroups": [
        {"name": "gpu", "minReplicas": 0, "maxReplicas": 2, "gpus": 2,
         "rayStartParams": {"resources": mine}}]}
    svc = helm_template(own).one("RayService")
    assert _groups(svc)["gpu"]["rayStartParams"]["resources"] == mine
