"""GPU bookkeeping, checked on CPU with fake GPUs: whatever runs the model asks Ray for
exactly one whole GPU per rank and sees that GPU inside; a rank given a GPU whose torch
has no CUDA fails at start, naming the cause, instead of running on CPU beside it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from raylm.actors.gpu_assignment import check_whole_gpus, local_device_index
from raylm.cluster.serve.deployment.app import llm_server_options
from raylm.cluster.serve.deployment.config import LLMConfig

MINIMAL = {"model_loading_config": {"model_id": "m", "model_source": "/models/m"}}


def test_replica_that_runs_the_model_holds_its_gpu():
    """TP = PP = DP = 1: the replica runs the model in process, so its own bundle and its
    actor options carry the GPU; no other bundle reserves one to sit idle."""
    cfg = LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 1})
    opts = llm_server_options(cfg)
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert opts["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}]
    typed = llm_server_options(LLMConfig.model_validate({**MINIMAL, "accelerator_type": "H100"}))
    assert typed["ray_actor_options"]["num_gpus"] == 1
    assert typed["ray_actor_options"]["resources"] == {"accelerator_type:H100": 0.001}
    cpu = llm_server_options(LLMConfig.model_validate(MINIMAL))
    assert cpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0}
    assert cpu["placement_group_bundles"] == [{"CPU": 1.0}]


def test_replica_of_a_sharded_model_leaves_the_gpus_to_its_workers():
    cfg = LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 1,
                                    "engine_kwargs": {"tensor_parallel_size": 2}})
    opts = llm_server_options(cfg)
    assert opts["ray_actor_options"]["num_gpus"] == 0
    # One bundle for the stage's TP group: both GPUs on one node.
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}, {"GPU": 2.0}]
    # The Ray backend at TP = 1: a worker actor runs the model, not the replica.
    ray_tp1 = LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 1, "engine_kwargs": {
        "distributed_executor_backend": "ray"}})
    assert llm_server_options(ray_tp1)["placement_group_bundles"] == [{"CPU": 1.0}, {"GPU": 1.0}]


def test_fractional_gpus_per_rank_are_refused():
    with pytest.raises(ValidationError, match="num_gpus_per_worker must be a whole number.*0.5"):
        LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 0.5})
    with pytest.raises(ValueError, match="num_gpus=0.5: a fraction of a GPU"):
        check_whole_gpus(0.5, "worker rank 1")
    check_whole_gpus(1.0, "worker rank 1")


def test_noset_cuda_visible_devices_picks_the_assigned_gpu():
    # Ray narrowed CUDA_VISIBLE_DEVICES: the one visible device is ours.
    assert local_device_index(["3"], noset=False, visible="3") == 0
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU stays visible; pick by id.
    assert local_device_index(["3"], noset=True, visible=None) == 3
    assert local_device_index(["3"], noset=True, visible="2,3") == 1
    with pytest.raises(RuntimeError, match="hides it"):
        local_device_index(["3"], noset=True, visible="0,1")


@pytest.fixture(scope="module")
def fake_gpu_ray(ray_gpu_node):
    """A local Ray whose one node claims 2 GPUs (this machine has none)."""
    import ray

    yield ray


@pytest.mark.ray
@pytest.mark.slow
def test_cuda_less_torch_on_a_gpu_rank_fails_at_start(fake_gpu_ray, llama_path):
    from raylm import LLM

    with pytest.raises(Exception, match=r"given a GPU but cannot use it: torch .* without "
                                        r"CUDA") as info:
        LLM(llama_path, tensor_parallel_size=2, num_kv_blocks=16)
    assert "worker" in str(info.value) or "rank" in str(info.value)
    groups = fake_gpu_ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups), groups  # nothing left behind


@pytest.mark.ray
@pytest.mark.slow
def test_each_worker_rank_holds_exactly_one_gpu(fake_gpu_ray, llama_path, monkeypatch):
    """With the CPU fallback allowed (how GPU placement is tested without GPUs), the
    engine runs; each worker actor asked for one GPU and Ray gave it a different one."""
    from raylm import LLM, SamplingParams

    monkeypatch.setenv("RAYLM_ALLOW_CPU_FALLBACK", "1")
    with LLM(llama_path, tensor_parallel_size=2, num_kv_blocks=16) as llm:
        infos = llm.llm_engine.core.info["worker_infos"]
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 3
    assert sorted(g for info in infos for g in info["gpu_ids"]) == ["0", "1"]
    assert all(len(info["gpu_ids"]) == 1 for info in infos), infos
    assert all(info["assigned_resources"].get("GPU") == 1.0 for info in infos), infos
