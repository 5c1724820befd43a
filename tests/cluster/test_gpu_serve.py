"""`raylm serve`'s app on a Ray node that declares GPUs (none here; the ranks run on CPU
with RAYLM_ALLOW_CPU_FALLBACK=1): by default every rank holds a GPU, as Ray's actor and
placement-group table and per-group resources show, and /metrics says what the ranks run on; 0 GPUs per worker
keeps them on CPU."""

from __future__ import annotations

import httpx
import openai
import pytest

from raylm.cluster.cli import build_llm_config, build_parser
from raylm.cluster.serve.deployment.config import LLMConfig

MINIMAL = {"model_loading_config": {"model_id": "m", "model_source": "/models/m"}}


def test_ranks_take_a_gpu_by_default_only_on_a_cluster_that_has_gpus():
    cfg = LLMConfig.model_validate({**MINIMAL, "engine_kwargs": {"tensor_parallel_size": 2}})
    assert cfg.with_default_devices(0) is cfg and not cfg.use_gpu
    gpu = cfg.with_default_devices(8)
    assert gpu.num_gpus_per_worker == 1 and gpu.use_gpu
    assert gpu.get_placement_group().bundles == [{"CPU": 1.0}, {"GPU": 2.0}]
    forced_cpu = LLMConfig.model_validate({**MINIMAL, "num_gpus_per_worker": 0})
    assert forced_cpu.with_default_devices(8) is forced_cpu
    typed = LLMConfig.model_validate({**MINIMAL, "accelerator_type": "H100"})
    assert typed.with_default_devices(8) is typed and typed.gpus_per_worker == 1


def test_serve_flags_for_devices(llama_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    parse = build_parser().parse_args
    cpu = build_llm_config(parse(["serve", llama_path, "--num-gpus-per-worker", "0"]))
    assert cpu.num_gpus_per_worker == 0 and cpu.with_default_devices(4) is cpu
    typed = build_llm_config(parse(["serve", llama_path, "--accelerator-type", "A100", "-tp",
                                    "2"]))
    assert typed.accelerator_type == "A100"
    assert typed.get_placement_group().bundles == [
        {"CPU": 1.0}, {"GPU": 2.0, "accelerator_type:A100": 0.002}]
    assert build_llm_config(parse(["serve", llama_path])).num_gpus_per_worker is None


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_a_gpu_node_puts_each_rank_on_a_gpu(ray_gpu_node, llama_path, monkeypatch):
    import ray
    from serve_helpers import running_serve_app

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = build_llm_config(build_parser().parse_args(
        ["serve", llama_path, "--served-model-name", "gpu", "-tp", "2", "--num-kv-blocks",
         "32", "--max-num-seqs", "4"]))
    # The Ray instance is shared and started without the CPU fallback: the replica gets it
    # through its runtime environment, as a user's deployment would.
    llm = {**cfg.model_dump(exclude_unset=True),
           "runtime_env": {"env_vars": {"RAYLM_ALLOW_CPU_FALLBACK": "1"}}}
    app = {"llm_configs": [llm], "ingress_in_replica": True}
    with running_serve_app(ray_gpu_node, app, "gpu") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        out = client.completions.create(model="gpu", prompt="hello world", max_tokens=3,
                                        temperature=0)
        assert out.usage.completion_tokens == 3
        # The replica's group: its stage bundle holds both GPUs, and actors placed in
        # it hold them (Ray's per-group GPU resource is fully taken).
        (group_id,) = [gid for gid, g in ray.util.placement_group_table().items()
                       if g["state"] == "CREATED" and {"GPU": 2.0} in g["bundles"].values()]
        assert ray.cluster_resources().get(f"GPU_group_{group_id}") == 2.0
        assert ray.available_resources().get(f"GPU_group_{group_id}", 0.0) == 0.0
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        device = [line for line in metrics.splitlines()
                  if line.startswith("raylm:device_info{")]
        # Both ranks report the device they run on (the CPU here: the fallback is on).
        assert len(device) == 1 and 'device_kind="cpu"' in device[0], device
        assert float(device[0].split()[-1]) == 2.0
