"""Speculative decoding on Ray: TP=2 and PP=2 worker actors, DP=2 engines, ngram and a
draft model. Every rank drafts from its own history and verifies alike, and the tokens
equal transformers, sync and async."""

from __future__ import annotations

import random
import sys

import pytest
from engine_drive import run_until_idle
from engine_idle import idle_metrics
from local_ray import ship_by_value

from raylm.actors.ray_executor import RayExecutor
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    ship_by_value(sys.modules[__name__])
    yield ray_local


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_ngram_greedy_matches_hf(loopy_llama_path, hf_oracle, async_scheduling):
    config = EngineConfig(
        ModelConfig(model=loopy_llama_path), CacheConfig(block_size=8),
        SchedulerConfig(max_num_seqs=8, async_scheduling=async_scheduling),
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray"),
        speculative_config=SpeculativeConfig("ngram", 3))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 12, 30)]
    max_tokens = [40, 33, 24]
    core = EngineCore(config, RayExecutor(config))
    try:
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            core.add_request(Request(
                f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                eos_token_ids=config.model_config.eos_token_ids,
                max_model_len=config.model_config.max_model_len, sampling_seed=i))
        tokens: dict[str, list[int]] = {}
        for out in run_until_idle(core):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        metrics = core.get_metrics()
    finally:
        core.shutdown()
    oracle = hf_oracle(loopy_llama_path)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert tokens[f"r{i}"] == oracle.greedy(p, m), f"request {i} diverged from HF"
    assert metrics["raylm:spec_decode_num_accepted_tokens"] > 0, metrics


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pp2_ngram_greedy_matches_hf(loopy_llama_path, hf_oracle, async_scheduling):
    """Both stages draft from the same history. Sync: the scheduler sends the first stage
    the accepted tokens; async: the last stage broadcasts them and the ring delivers them
    two steps later, before the request's next decode. Chunking and preemption on."""
    from raylm import LLM, SamplingParams

    llm = LLM(loopy_llama_path, pipeline_parallel_size=2, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=24, max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 12, 30, 41, 9)]
        max_tokens = [40, 33, 24, 30, 36]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in max_tokens], use_tqdm=False)
        oracle = hf_oracle(loopy_llama_path)
        for p, m, out in zip(prompts, max_tokens, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, m)
        metrics = idle_metrics(llm)
        assert llm.llm_engine.engine_config.async_scheduling is async_scheduling
        assert metrics["raylm:spec_decode_num_accepted_tokens"] > 0, metrics
        assert metrics["raylm:num_preemptions"] > 0, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()


def test_dp2_ngram_greedy_matches_hf(loopy_llama_path, hf_oracle):
    """data_parallel_size=2: each rank's engine drafts and verifies its own requests (async
    scheduling, the default); the tokens equal transformers (so equal no speculation),
    drafts are accepted, and every block comes back."""
    from raylm import LLM
    from raylm.actors.ray_engine_core_client import RayEngineCoreClient

    llm = LLM(loopy_llama_path, data_parallel_size=2, block_size=8, num_kv_blocks=64,
              max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert isinstance(llm.llm_engine.core, RayEngineCoreClient)
        assert llm.llm_engine.engine_config.async_scheduling
        rng = random.Random(2)
        passages = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 11, 9, 14)]
        prompts = [p * 3 for p in passages]  # lookup finds the passage again
        max_tokens = [28, 21, 34, 17]
        metrics = _greedy_equals_hf(llm, hf_oracle(loopy_llama_path), prompts, max_tokens)
        # Both ranks draft and verify: each got requests. (How many each depends on when
        # a rank's free KV reaches the balancer: [2, 2] and [3, 1] both happen.)
        routed = metrics["dp_routed_requests"]
        assert sum(routed) == 4 and min(routed) >= 1, metrics
        assert metrics["raylm:spec_decode_num_accepted_tokens"] > 0, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()


def _greedy_equals_hf(llm, oracle, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """Greedy generation of each prompt equals transformers'; returns the engine's metrics
    once it is idle."""
    from raylm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                         for m in max_tokens], use_tqdm=False)
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, m)
    return idle_metrics(llm)


@pytest.mark.parametrize("draft", ["target", "near"])
def test_pp2_draft_model_greedy_matches_hf(llama_path, hf_oracle, tmp_path, draft):
    """A draft model with PP=2 (async scheduling, the default): every stage runs the whole
    draft model from the same history, so both stages propose the same drafts. The draft equal to the
    target has every draft accepted; a near copy of it (attention output halved) has part
    of its drafts accepted, so each stage must roll its draft KV back to the accepted
    tokens, or the first stage would run other drafts than the last one verifies. The
    tokens equal transformers."""
    import shutil

    from raylm import LLM
    from raylm.runner.loading.checkpoint import scale_attention_output

    model = llama_path
    if draft == "near":
        model = str(tmp_path / "near")
        shutil.copytree(llama_path, model)
        scale_attention_output(model, 0.5)
    # Near: positions priced high, so the gate closes after rejections and probes later
    # (the draft KV past the accepted tokens must not be reused after such a pause).
    overhead = 24.0 if draft == "target" else 0.2
    llm = LLM(llama_path, pipeline_parallel_size=2, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=8, speculative_config={
                  "method": "draft_model", "model": model, "num_speculative_tokens": 3,
                  "draft_step_overhead_tokens": overhead})
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33, 9)]
        max_tokens = [20, 13, 16, 24]
        metrics = _greedy_equals_hf(llm, hf_oracle(llama_path), prompts, max_tokens)
        drafted = metrics["raylm:spec_decode_num_draft_tokens"]
        accepted = metrics["raylm:spec_decode_num_accepted_tokens"]
        if draft == "target":
            assert accepted == drafted > 0, metrics
        else:
            assert 0 < accepted < drafted, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_draft_model_greedy_matches_hf(llama_path, hf_oracle, tmp_path, async_scheduling):
    """A draft model on TP=2 worker actors: without PP each rank drafts the next step
    right after its verification, into KV slots the scheduler books ahead, and places
    the drafts on its device in the next step. A near copy of the target (attention
    output halved) has part of its drafts accepted, so the ranks roll back alike. The
    tokens equal transformers."""
    import shutil

    from raylm import LLM
    from raylm.runner.loading.checkpoint import scale_attention_output

    near = str(tmp_path / "near")
    shutil.copytree(llama_path, near)
    scale_attention_output(near, 0.5)
    llm = LLM(llama_path, tensor_parallel_size=2, async_scheduling=async_scheduling,
              block_size=4, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=8,
              speculative_config={"method": "draft_model", "model": near,
                                  "num_speculative_tokens": 3})
    try:
        assert llm.llm_engine.engine_config.num_lookahead_tokens == 3
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 19, 31, 10)]
        max_tokens = [22, 15, 18, 25]
        metrics = _greedy_equals_hf(llm, hf_oracle(llama_path), prompts, max_tokens)
        drafted = metrics["raylm:spec_decode_num_draft_tokens"]
        assert 0 < metrics["raylm:spec_decode_num_accepted_tokens"] < drafted, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method, async_scheduling", [("eagle", True), ("eagle3", False)],
                         ids=["eagle-async", "eagle3-sync"])
def test_tp2_eagle_greedy_matches_hf(loopy_llama_path, hf_oracle, tmp_path, method,
                                     async_scheduling):
    """An EAGLE head on TP=2 worker actors (its layers sharded like the target's, fc and
    d2t whole on every rank): each rank runs the head after its verification and drafts
    alike. EAGLE-1: a head of the target's own layers, mostly accepted; EAGLE-3: a random
    head over a draft vocabulary, mostly rejected. The tokens equal transformers."""
    from eagle_heads import with_unit_final_norm, write_eagle_head, write_target_copy_head

    from raylm import LLM

    target = with_unit_final_norm(loopy_llama_path, str(tmp_path / "target"))
    head = (write_target_copy_head(str(tmp_path / "head"), target) if method == "eagle"
            else write_eagle_head(str(tmp_path / "head"), target, "eagle3"))
    llm = LLM(target, tensor_parallel_size=2, async_scheduling=async_scheduling,
              block_size=4, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=8,
              speculative_config={"method": method, "model": head,
                                  "num_speculative_tokens": 3})
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (6, 19, 31, 10)]
        metrics = _greedy_equals_hf(llm, hf_oracle(target), prompts, [22, 15, 18, 25])
        drafted = metrics["raylm:spec_decode_num_draft_tokens"]
        accepted = metrics["raylm:spec_decode_num_accepted_tokens"]
        assert drafted > 0 and (accepted > 0.5 * drafted if method == "eagle" else True), metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_pp2_head_greedy_matches_hf(loopy_llama_path, hf_oracle, tmp_path, method):
    """A draft head with PP=2 (async scheduling; EAGLE-3 sync): the last stage runs the
    head after its verification and its drafts reach the first stage with the accepted
    runs through the ring, so both stages place the same drafts (a mismatch would change the step's query
    lengths between the stages); the last stage's head embeds with its own copy of the
    target's embedding. EAGLE-1: a head of the target's own layers, mostly accepted;
    EAGLE-3, under sync scheduling (the drafts still come back by broadcast): a random
    head reading layer 0's input from the first stage over gloo beside the hidden states; MTP: DeepSeek-V3's layer (random, mostly rejected). The tokens
    equal transformers."""
    from eagle_heads import with_unit_final_norm, write_target_copy_head

    from raylm import LLM
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
    from raylm.runner.loading.eagle_checkpoint import add_mtp_layer, write_eagle_head

    if method == "eagle":
        target = with_unit_final_norm(loopy_llama_path, str(tmp_path / "target"))
        spec = {"method": "eagle", "model": write_target_copy_head(str(tmp_path / "head"),
                                                                   target)}
    elif method == "eagle3":
        target = loopy_llama_path
        spec = {"method": "eagle3", "model": write_eagle_head(str(tmp_path / "head"), target,
                                                              "eagle3")}
    else:
        ds = CheckpointSpec(architecture="DeepseekV3ForCausalLM", num_hidden_layers=2, seed=43)
        target = write_random_checkpoint(str(tmp_path / "ds"), ds)
        add_mtp_layer(target, ds)
        spec = {"method": "mtp"}
    llm = LLM(target, pipeline_parallel_size=2, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=8,
              async_scheduling=method != "eagle3",
              speculative_config={**spec, "num_speculative_tokens": 3,
                                  "draft_step_overhead_tokens": 1e6})
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33, 9)]
        metrics = _greedy_equals_hf(llm, hf_oracle(target), prompts, [20, 13, 16, 24])
        drafted = metrics["raylm:spec_decode_num_draft_tokens"]
        accepted = metrics["raylm:spec_decode_num_accepted_tokens"]
        assert drafted > 0 and (accepted > 0.5 * drafted if method == "eagle" else True), metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()
