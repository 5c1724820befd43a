"""The real engine on Ray: TP=2 worker actors running the Llama model, against
transformers and the single-process engine; EngineCore actor + RayEngineCoreClient; a
worker or EngineCore actor killed mid-generation; placement that cannot succeed."""

from __future__ import annotations

import random
import sys
import time

import pytest
import ray
from engine_drive import run_until_idle
from local_ray import ship_by_value

from raylm.actors.placement import PlacementGroupError
from raylm.actors.ray_engine_core_client import RayEngineCoreClient
from raylm.actors.ray_executor import RayExecutor
from raylm.cluster.engine.engine_args import EngineArgs
from raylm.runner.uniproc_executor import UniProcExecutor
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import FinishReason
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.ray

MAX_TOKENS = [12, 7, 16, 5]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    ship_by_value(sys.modules[__name__])
    yield ray_local


def _config(model: str, tp: int, backend: str, async_scheduling: bool | None = None,
            **cache) -> EngineConfig:
    return EngineArgs(model=model, block_size=8, max_num_seqs=16,
                      async_scheduling=async_scheduling, tensor_parallel_size=tp,
                      distributed_executor_backend=backend, **cache).create_engine_config()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _requests(config: EngineConfig, prompts, max_tokens, prefix: str = "r") -> list[Request]:
    return [Request(f"{prefix}{i}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                    eos_token_ids=config.model_config.eos_token_ids,
                    max_model_len=config.model_config.max_model_len, sampling_seed=i)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]


def _run_engine(config: EngineConfig, executor, prompts, max_tokens) -> dict[str, list[int]]:
    core = EngineCore(config, executor)
    try:
        for r in _requests(config, prompts, max_tokens):
            core.add_request(r)
        tokens: dict[str, list[int]] = {}
        for out in run_until_idle(core):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_greedy_matches_single_process_and_hf(llama_path, hf_oracle, async_scheduling):
    prompts = _prompts(4)
    uni_cfg = _config(llama_path, 1, "uni", async_scheduling)
    single = _run_engine(uni_cfg, UniProcExecutor(uni_cfg),
                         prompts, MAX_TOKENS)
    ray_cfg = _config(llama_path, 2, "ray", async_scheduling)
    tp2 = _run_engine(ray_cfg, RayExecutor(ray_cfg), prompts, MAX_TOKENS)
    oracle = hf_oracle(llama_path)
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        expected = oracle.greedy(p, m)
        assert tp2[f"r{i}"] == expected, f"TP=2 request {i} diverged from HF"
        assert single[f"r{i}"] == expected


def _collect(client, n_requests: int, timeout_s: float = 120) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(finished) < n_requests:
        assert time.monotonic() < deadline, f"only {len(finished)} of {n_requests} finished"
        batch = client.get_output(timeout=1.0)
        for out in batch.outputs if batch else []:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH
                finished.add(out.request_id)
    return tokens


def _o_proj_shape(actor) -> tuple[int, tuple[int, ...]]:
    params = dict(actor.worker.model_runner.model.named_parameters())
    return actor.worker.ctx.tp_rank, tuple(params["model.layers.0.self_attn.o_proj.weight"].shape)


def test_ray_engine_core_client_tp2(llama_path, hf_oracle):
    config = _config(llama_path, 2, "ray")
    client = RayEngineCoreClient(config)
    try:
        assert client.info["async_scheduling"] is True
        assert client.info["max_concurrent_batches"] == 2
        workers = ray.get(client.ranks[0].worker_handles.remote())
        shards = ray.get([w.__ray_call__.remote(_o_proj_shape) for w in workers])
        assert shards == [(0, (64, 32)), (1, (64, 32))]  # each rank holds half of o_proj
        prompts = _prompts(4, seed=1)
        reqs = _requests(config, prompts, MAX_TOKENS)
        for r in reqs:
            client.add_request(r)
        with pytest.raises(ValueError, match="already in use"):
            client.add_request(_requests(config, prompts[:1], [3])[0])
        tokens = _collect(client, len(reqs))
        oracle = hf_oracle(llama_path)
        for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
            assert tokens[f"r{i}"] == oracle.greedy(p, m)
        # an abort mid-generation: exactly one final output, with ABORT
        long = _requests(config, prompts[:1], [400], prefix="long")[0]
        client.add_request(long)
        assert client.get_output(timeout=30) is not None
        client.abort_requests([long.request_id])
        deadline = time.monotonic() + 30
        reason = None
        while reason is None and time.monotonic() < deadline:
            batch = client.get_output(timeout=1.0)
            for out in batch.outputs if batch else []:
                reason = out.finish_reason or reason
        assert reason == FinishReason.ABORT
        metrics = client.get_metrics()
        assert metrics["raylm:request_success"] >= 4
        client.check_health()
    finally:
        client.shutdown()


def _wait_dead(client, timeout_s: float = 30.0) -> tuple[EngineDeadError, list]:
    finals = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            batch = client.get_output(timeout=1.0)
        except EngineDeadError as e:
            return e, finals
        for out in batch.outputs if batch else []:
            if out.finished:
                finals.append(out)
    raise AssertionError(f"no EngineDeadError within {timeout_s}s")


def test_killed_worker_makes_engine_dead_without_hang(llama_path):
    config = _config(llama_path, 2, "ray")
    client = RayEngineCoreClient(config)
    try:
        reqs = _requests(config, _prompts(4, seed=2), [600] * 4)
        for r in reqs:
            client.add_request(r)
        assert client.get_output(timeout=30) is not None  # generation is under way
        workers = ray.get(client.ranks[0].worker_handles.remote())
        start = time.monotonic()
        ray.kill(workers[1])
        error, finals = _wait_dead(client)
        assert time.monotonic() - start < 30
        assert "worker rank 1" in str(error) and "ray.kill" in str(error), str(error)
        # every request still running was finished (ABORT) before the death was reported
        assert sorted(o.request_id for o in finals) == sorted(r.request_id for r in reqs)
        assert all(o.finish_reason == FinishReason.ABORT for o in finals)
        with pytest.raises(EngineDeadError):
            client.check_health()
        with pytest.raises(EngineDeadError):
            client.add_request(_requests(config, _prompts(1), [4], prefix="late")[0])
        with pytest.raises(EngineDeadError):  # the error stays for every later reader
            client.get_output(timeout=0.1)
    finally:
        client.shutdown()


def test_killed_engine_core_actor_makes_engine_dead(llama_path):
    config = _config(llama_path, 1, "ray")
    client = RayEngineCoreClient(config)
    try:
        client.add_request(_requests(config, _prompts(1), [600])[0])
        assert client.get_output(timeout=30) is not None
        ray.kill(client.ranks[0])
        error, _ = _wait_dead(client)
        assert "EngineCore actor" in str(error), str(error)
        with pytest.raises(EngineDeadError):
            client.check_health()
    finally:
        client.shutdown()


def test_client_placement_on_missing_gpus_fails_fast(llama_path):
    start = time.monotonic()
    with pytest.raises(PlacementGroupError, match=r"GPU: requested 2"):
        RayEngineCoreClient(_config(llama_path, 2, "ray"), resource="GPU", placement_timeout_s=2)
    assert time.monotonic() - start < 30
