"""Bad values must stop `helm template` with a message that names the value."""

from __future__ import annotations

import pytest

GPU_GROUP = {"name": "g", "minReplicas": 0, "maxReplicas": 2, "gpus": 1}

CASES = {
    "min_replicas_above_max": (
        {"llmConfig": {"deployment_config": {"autoscaling_config": {
            "min_replicas": 5, "max_replicas": 2, "target_ongoing_requests": 16}}}},
        "autoscaling_config.min_replicas (5) must not exceed max_replicas (2)"),
    "negative_tp": (
        {"llmConfig": {"engine_kwargs": {"tensor_parallel_size": -2}}},
        "/llmConfig/engine_kwargs/tensor_parallel_size': minimum: got -2, want 1"),
    "unknown_engine_kwarg": (
        {"llmConfig": {"engine_kwargs": {"tensor_parallel_sise": 2}}},
        "additional properties 'tensor_parallel_sise' not allowed"),
    "string_replicas": (
        {"workerGroups": [dict(GPU_GROUP, maxReplicas="two")]},
        "/workerGroups/0/maxReplicas"),
    "group_min_above_max": (
        {"workerGroups": [dict(GPU_GROUP, minReplicas=3)]},
        "workerGroups[0] (g): minReplicas (3) must not exceed maxReplicas (2)"),
    "group_replicas_out_of_range": (
        {"workerGroups": [dict(GPU_GROUP, replicas=7)]},
        "workerGroups[0] (g): replicas (7) must lie between minReplicas (0) and maxReplicas (2)"),
    "duplicate_group_names": (
        {"workerGroups": [GPU_GROUP, GPU_GROUP]},
        'workerGroups[1].name "g" is used twice'),
    "bad_group_name": (
        {"workerGroups": [dict(GPU_GROUP, name="GPU_Group")]},
        "/workerGroups/0/name"),
    "target_above_max_ongoing": (
        {"llmConfig": {"deployment_config": {"max_ongoing_requests": 8}}},
        "target_ongoing_requests (96) exceeds max_ongoing_requests (8)"),
    "tp_group_larger_than_a_pod": (
        {"llmConfig": {"engine_kwargs": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
         "workerGroups": [GPU_GROUP]},
        "tensor_parallel_size (4) x llmConfig.num_gpus_per_worker (1) = 4 GPUs form one "
        "tensor-parallel group"),
    "gpus_do_not_fit": (
        {"llmConfig": {"engine_kwargs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                         "data_parallel_size": 2}},
         "workerGroups": [dict(GPU_GROUP, gpus=2)]},
        "1 Serve replica(s) x pipeline_parallel_size (2) x data_parallel_size (2) need 4 "
        "tensor-parallel groups of 2 GPUs (tensor_parallel_size 2 x num_gpus_per_worker 1), "
        "each inside one pod, but the worker groups hold at most 2"),
    "accelerator_without_gpus": (
        {"llmConfig": {"accelerator_type": "H100"}, "workerGroups": [dict(GPU_GROUP, gpus=0)]},
        'llmConfig.accelerator_type is "H100" but no worker group has gpus > 0'),
    "grace_shorter_than_drain": (
        {"drain": {"terminationGracePeriodSeconds": 30, "preStopSleepSeconds": 60}},
        "drain.terminationGracePeriodSeconds (30) must be at least drain.preStopSleepSeconds (60) + 10"),
    "batch_without_paths": (
        {"batch": {"enabled": True}},
        "batch.enabled needs batch.input and batch.output"),
    "bad_upscaling_mode": (
        {"autoscaler": {"upscalingMode": "Eager"}},
        "/autoscaler/upscalingMode"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_values_fail_with_clear_message(helm_template, case):
    values, message = CASES[case]
    out = helm_template(values)
    assert out.returncode != 0, f"{case}: helm template accepted bad values:\n{out.stdout[:500]}"
    assert message in out.stderr, f"{case}: expected {message!r} in:\n{out.stderr}"


def test_good_variants_of_the_bad_values_pass(helm_template):
    """The same knobs set to sane values render: the failures above come from the bad values."""
    ok = {
        "llmConfig": {"engine_kwargs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1},
                      "deployment_config": {"max_ongoing_requests": 16, "autoscaling_config": {
                          "min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 16}}},
        "workerGroups": [dict(GPU_GROUP, replicas=2, maxReplicas=4, gpus=2)],
        "drain": {"terminationGracePeriodSeconds": 70, "preStopSleepSeconds": 60},
    }
    out = helm_template(ok)
    assert out.returncode == 0, out.stderr
    assert out.one("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2
