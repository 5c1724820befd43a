"""Pipeline (and tensor) parallelism end to end on Ray (docs/architecture.md §4): ``raylm.LLM`` with PP=2,
TP=2 x PP=2 and PP=3, async scheduling on and off, greedy output equal to transformers and to the
single-process engine, under forced preemption (20 KV blocks of 4 tokens) and chunked
prefill (a 16-token budget). Hidden states travel over gloo between the worker actors;
under async scheduling the last stage's sampled ids come back to stage 0 through the
broadcast group and the ring (checked on the workers themselves)."""

from __future__ import annotations

import json
import random

import pytest
import ray
from engine_idle import idle_metrics

from raylm import LLM, SamplingParams
from raylm.runner.models.decoder_config import DecoderConfig

pytestmark = pytest.mark.ray

ENGINE = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=6,
              enable_prefix_caching=False)
PROMPT_LENGTHS = [3, 21, 9, 30, 14, 6]
MAX_TOKENS = [18, 12, 24, 10, 20, 16]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    # TP2 x PP2: 4 one-CPU worker bundles + the EngineCore actor's.
    yield ray_local


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(llama_path, hf_oracle) -> list[list[int]]:
    """transformers' greedy tokens, checked equal to the single-process engine's."""
    expected = [hf_oracle(llama_path).greedy(p, m) for p, m in zip(_prompts(), MAX_TOKENS,
                                                                    strict=True)]
    single = LLM(llama_path, distributed_executor_backend="uni", **ENGINE)
    try:
        assert _generate(single) == expected
    finally:
        single.shutdown()
    return expected


def _worker_pp_stats(llm: LLM) -> list[dict[str, int]]:
    core = llm.llm_engine.core  # RayEngineCoreClient, d = 1
    workers = ray.get(core.ranks[0].worker_handles.remote(), timeout=30)
    return ray.get([w.call.remote("pp_stats") for w in workers], timeout=30)


@pytest.mark.parametrize(("tp", "async_scheduling"), [
    pytest.param(1, False, id="pp2-sync"),
    pytest.param(1, None, id="pp2-async-by-default"),
    pytest.param(2, False, id="tp2xpp2-sync"),
    pytest.param(2, True, id="tp2xpp2-async"),
])
def test_pipeline_parallel_greedy_matches_hf(llama_path, reference, tp, async_scheduling):
    llm = LLM(llama_path, pipeline_parallel_size=2, tensor_parallel_size=tp,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        assert llm.llm_engine.engine_config.parallel_config.distributed_executor_backend == "ray"
        assert _generate(llm) == reference
        metrics = idle_metrics(llm)
        assert metrics["raylm:num_preemptions"] > 0, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
        stats = _worker_pp_stats(llm)
        assert [s["pp_rank"] for s in stats] == [r // tp for r in range(2 * tp)]
        first_stage = [s for s in stats if s["pp_rank"] == 0]
        if async_scheduling is False:
            # Sync: inputs come from the scheduler's new_token_ids; no ring, no broadcast.
            assert all(s["ring_steps"] == 0 for s in first_stage), stats
        else:
            # Async (the default with PP): every stage-0 rank took the broadcast ids out
            # of its ring and wrote them into its inputs on the device.
            for s in first_stage:
                assert s["ring_steps"] > 0 and s["ring_delivered"] > 0, stats
                assert s["slice_copy"] + s["scatter"] > 0, stats
            assert len({(s["ring_steps"], s["ring_delivered"]) for s in first_stage}) == 1
        # A second batch on the same engine (rings, groups and rows carry over).
        assert _generate(llm) == reference
    finally:
        llm.shutdown()


def test_three_stages_async(tmp_path_factory, hf_oracle):
    """A middle stage: it takes hidden states in and out and joins every broadcast of
    sampled ids (three ranks in the group) without using them."""
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path_factory.mktemp("llama3l")),
                                   CheckpointSpec(num_hidden_layers=3, seed=4))
    expected = [hf_oracle(path).greedy(p, m) for p, m in zip(_prompts(), MAX_TOKENS, strict=True)]
    llm = LLM(path, pipeline_parallel_size=3, async_scheduling=True, **ENGINE)
    try:
        assert _generate(llm) == expected
        assert llm.get_metrics()["raylm:num_preemptions"] > 0
        stats = _worker_pp_stats(llm)
        assert [s["pp_rank"] for s in stats] == [0, 1, 2]
        assert stats[0]["ring_delivered"] == stats[1]["ring_delivered"] > 0, stats
        assert stats[0]["slice_copy"] + stats[0]["scatter"] > 0, stats
        assert stats[1]["slice_copy"] + stats[1]["scatter"] == 0, stats  # no token inputs
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("spec", "engine"), [
    # A Qwen2 whose second layer attends through a 5-token window: the window lives on
    # stage 1, each TP rank's heads apply it.
    pytest.param(dict(architecture="Qwen2ForCausalLM", sliding_window=5, max_window_layers=1,
                      seed=23), {},
                 id="qwen2-sliding-window"),
    # Mistral: the window on every layer, so every stage frees the blocks behind it (18
    # blocks: what a request may hold with 4 steps of 16 tokens unsettled). Whether the
    # pool then runs short depends on timing: no preemption is asserted for it.
    pytest.param(dict(architecture="MistralForCausalLM", sliding_window=5, seed=21),
                 {"num_kv_blocks": 18}, id="mistral-sliding-window"),
    # Sparse expert MLPs with TP inside the experts (each rank every expert's slice of the
    # intermediate dimension, one all-reduce per layer), a dense layer between.
    pytest.param(dict(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, head_dim=32,
                      mlp_only_layers=(1,), seed=32), {},
                 id="qwen3-moe"),
    # Qwen2-MoE with expert parallelism: each TP rank runs 4 of the 8 experts whole and
    # its slice of the gated shared expert, all summed by one all-reduce.
    pytest.param(dict(architecture="Qwen2MoeForCausalLM", num_hidden_layers=3,
                      mlp_only_layers=(1,), norm_topk_prob=False, num_experts=8, seed=34),
                 {"enable_expert_parallel": True}, id="qwen2-moe-ep"),
    # DeepSeek-V3: each TP rank its two heads' absorbed latent attention over the whole
    # latent cache, and 4 of the 8 experts whole beside its slice of the shared expert;
    # layer 0 dense, the grouped sigmoid router on layers 1 and 2.
    pytest.param(dict(architecture="DeepseekV3ForCausalLM", num_hidden_layers=3, seed=44),
                 {"enable_expert_parallel": True}, id="deepseek-v3-ep"),
    # Mixtral's weight names read per stage; OLMoE's q/k norm over the whole projection,
    # its mean square summed over the TP ranks' heads.
    pytest.param(dict(architecture="MixtralForCausalLM", num_experts=4, seed=35), {},
                 id="mixtral"),
    pytest.param(dict(architecture="OlmoeForCausalLM", norm_topk_prob=False, seed=36), {},
                 id="olmoe"),
    # Gemma 2: soft-capped attention scores on every rank's heads, sliding layers 0 and 2.
    # Gemma 2 and 3 here: three KV cache groups of one layer each, so a block is one
    # layer's page (30 of them: less memory than the others' 20 blocks of three layers).
    pytest.param(dict(architecture="Gemma2ForCausalLM", num_hidden_layers=3, sliding_window=5,
                      head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=0.5,
                      seed=38), {"num_kv_blocks": 30},
                 id="gemma2"),
    # Gemma 3: two sliding layers on stage 0 with their RoPE base, the global one on stage 1;
    # the scaled embedding on the first stage, the soft-capped logits on the last.
    pytest.param(dict(architecture="Gemma3ForCausalLM", num_hidden_layers=3, sliding_window=5,
                      sliding_window_pattern=3, head_dim=16, final_logit_softcapping=30.0,
                      seed=33), {"num_kv_blocks": 30},
                 id="gemma3"),
    # Bamba: Mamba2 layers 0 and 2 around attention layer 1, so stage 1 holds a state
    # layer alone (no KV); each TP rank scans its heads and groups, its state in its slots.
    pytest.param(dict(architecture="BambaForCausalLM", num_hidden_layers=3,
                      attn_layer_indices=(1,), seed=39), {},
                 id="bamba"),
    # Granite 4: experts split whole over the TP ranks (expert parallelism) beside the
    # ungated shared MLP split like a dense one; its multipliers on every stage.
    pytest.param(dict(architecture="GraniteMoeHybridForCausalLM", num_hidden_layers=3,
                      layer_types=("mamba", "attention", "mamba"), num_experts=4, seed=47,
                      config_overrides=(("embedding_multiplier", 3.0),
                                        ("residual_multiplier", 0.5),
                                        ("attention_multiplier", 0.3),
                                        ("logits_scaling", 2.0),
                                        ("position_embedding_type", "rope"))),
                 {"enable_expert_parallel": True}, id="granite-hybrid-ep"),
    # Qwen3-Next: gated delta layers 0-2 (each TP rank one key head and its two value
    # heads), gated attention at 3 on stage 1 (with biases: each rank's heads' query and
    # gate biases split from q_proj's), experts with a gated shared expert.
    pytest.param(dict(architecture="Qwen3NextForCausalLM", num_hidden_layers=4, head_dim=16,
                      num_experts=4, mlp_only_layers=(1,), seed=52,
                      config_overrides=(("attention_bias", True),)), {},
                 id="qwen3-next"),
    # Falcon-H1: a Mamba2 mixer beside attention in every layer, each rank with its heads
    # of both, and its multipliers on every stage.
    pytest.param(dict(architecture="FalconH1ForCausalLM", num_hidden_layers=3, seed=62,
                      config_overrides=(("mamba_rms_norm", True), ("key_multiplier", 0.7),
                                        ("ssm_multipliers", [1.1, 0.9, 1.2, 0.8, 1.3]),
                                        ("mlp_multipliers", [0.9, 1.1]))), {},
                 id="falcon-h1"),
])
def test_other_families_tp2xpp2_async(tmp_path_factory, hf_oracle, spec, engine):
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path_factory.mktemp("family")), CheckpointSpec(**spec))
    expected = [hf_oracle(path).greedy(p, m) for p, m in zip(_prompts(), MAX_TOKENS, strict=True)]
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, async_scheduling=True,
              **{**ENGINE, **engine})
    try:
        assert _generate(llm) == expected
        metrics = llm.get_metrics()
        if spec["architecture"] != "MistralForCausalLM":
            assert metrics["raylm:num_preemptions"] > 0
        if engine.get("enable_expert_parallel"):
            _assert_experts_split_over_tp_ranks(llm, metrics, path)
    finally:
        llm.shutdown()


def _assert_experts_split_over_tp_ranks(llm: LLM, metrics: dict, path: str) -> None:
    """TP rank t of each stage ran the t-th half of the experts of its stage's sparse
    layers only (Qwen2-MoE: 8 experts, layers 0 and 2, one per stage; Granite: 4 experts,
    layers 0 and 1 on stage 0, 2 on stage 1; DeepSeek-V3: 8 experts, layers 1 and 2); the
    engine's counters cover every expert of every sparse layer."""
    with open(f"{path}/config.json") as f:
        cfg = DecoderConfig.from_hf(json.load(f))
    experts = cfg.num_experts
    half = experts // 2
    sparse = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    stage_layers = ([i for i in sparse if i < 2], [i for i in sparse if i >= 2])
    core = llm.llm_engine.core
    workers = ray.get(core.ranks[0].worker_handles.remote(), timeout=30)
    loads = ray.get([w.call.remote("expert_load") for w in workers], timeout=30)
    assert [{layer: sorted(e) for layer, e in load.items()} for load in loads] == [
        {layer: list(range(t * half, (t + 1) * half)) for layer in stage_layers[stage]}
        for stage in (0, 1) for t in (0, 1)]
    assert all(sum(load[layer].values()) > 0 for load in loads for layer in load)
    counted = sorted(key for key in metrics if key.startswith("raylm:moe_expert_tokens{"))
    assert counted == sorted(f'raylm:moe_expert_tokens{{layer="{layer}",expert="{e}"}}'
                             for layer in sparse for e in range(experts))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tensor_parallel_under_preemption_and_chunking_matches_hf(llama_path, reference,
                                                                   async_scheduling):
    """TP=2 alone (no PP) under the same forced preemption and chunked prefill."""
    llm = LLM(llama_path, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE)
    try:
        assert _generate(llm) == reference
        metrics = idle_metrics(llm)
        assert metrics["raylm:num_preemptions"] > 0, metrics
        assert metrics["raylm:kv_cache_usage_perc"] == 0.0, metrics
    finally:
        llm.shutdown()
