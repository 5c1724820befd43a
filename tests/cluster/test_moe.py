"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): the sparse expert MLP
(softmax router, top-k renormalised or not, experts run grouped by expert, Qwen2-MoE's gated
shared expert) against a per-token reference, and each whole model against transformers,
token for token, sync and async, with chunked prefill, prefix hits, preemption and ngram
speculation, dense and sparse layers mixed."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from family_check import assert_greedy_equals_transformers

from raylm import LLM, SamplingParams
from raylm.parallel.context import ParallelContext
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.models.moe import SparseMoeBlock, expert_range


def _block(num_experts: int, top_k: int, norm: bool, shared: int = 0) -> SparseMoeBlock:
    torch.manual_seed(num_experts * 10 + top_k)
    block = SparseMoeBlock(16, 12, num_experts, top_k, norm, ParallelContext.single(),
                           torch.float32, shared)
    block.gate.weight.data.normal_()
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        block.shared_expert.gate_up_proj.weight.data.normal_()
        block.shared_expert.down_proj.weight.data.normal_()
        block.shared_expert_gate.weight.data.normal_()
    for e in range(num_experts):
        block.load_expert_weight(e, "gate_proj", torch.randn(12, 16))
        block.load_expert_weight(e, "up_proj", torch.randn(12, 16))
        block.load_expert_weight(e, "down_proj", torch.randn(16, 12))
    return block


@pytest.mark.parametrize(("num_experts", "top_k", "norm", "shared"),
                         [(8, 2, True, 0), (4, 1, False, 0), (6, 6, True, 0), (4, 2, False, 10)])
def test_grouped_experts_equal_a_per_token_reference(num_experts, top_k, norm, shared):
    block = _block(num_experts, top_k, norm, shared)
    x = torch.randn(11, 16)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, ids = probs[t].topk(top_k)
        if norm:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist(), strict=True):
            gate, up = (block.w13[e] @ x[t]).chunk(2)
            want[t] += weight * (block.w2[e] @ (F.silu(gate) * up))
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            gate, up = (block.shared_expert.gate_up_proj.weight @ x[t]).chunk(2)
            dense = block.shared_expert.down_proj.weight @ (F.silu(gate) * up)
            want[t] += torch.sigmoid(block.shared_expert_gate.weight @ x[t]) * dense
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


def test_a_missing_or_unknown_expert_weight_is_named():
    block = SparseMoeBlock(16, 12, 2, 1, True, ParallelContext.single(), torch.float32)
    block.load_expert_weight(0, "gate_proj", torch.randn(12, 16))
    assert block.missing_expert_weights() == [
        "experts.0.up_proj", "experts.0.down_proj", "experts.1.gate_proj",
        "experts.1.up_proj", "experts.1.down_proj"]
    with pytest.raises(ValueError, match="expert 2 out of range"):
        block.load_expert_weight(2, "gate_proj", torch.randn(12, 16))
    with pytest.raises(ValueError, match="expert 0 down_proj: checkpoint shard has shape"):
        block.load_expert_weight(0, "down_proj", torch.randn(12, 16))


# Each family's traits: Qwen3-MoE (q/k norm per head, a dense layer between sparse ones),
# Qwen2-MoE (qkv bias, a gated shared expert, top-k not renormalised), Mixtral (its own
# weight names, top-k renormalised), OLMoE (q/k norm over the whole projection).
FAMILIES = {
    "qwen3-moe": CheckpointSpec(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3,
                                head_dim=32, mlp_only_layers=(1,), seed=31),
    "qwen2-moe": CheckpointSpec(architecture="Qwen2MoeForCausalLM", num_hidden_layers=3,
                                mlp_only_layers=(2,), norm_topk_prob=False, seed=34),
    "mixtral": CheckpointSpec(architecture="MixtralForCausalLM", num_experts=4, seed=35),
    "olmoe": CheckpointSpec(architecture="OlmoeForCausalLM", norm_topk_prob=False, seed=36),
}
SPARSE_BLOCKS = {
    "qwen3-moe": ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"],
    "qwen2-moe": ["Qwen2MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"],
    "mixtral": ["MixtralSparseMoeBlock"] * 2,
    "olmoe": ["OlmoeSparseMoeBlock"] * 2,
}


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict[str, str]:
    return {name: write_random_checkpoint(str(tmp_path_factory.mktemp(name)), spec)
            for name, spec in FAMILIES.items()}


@pytest.fixture(scope="module")
def moe_path(family_paths) -> str:
    return family_paths["qwen3-moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sparse_layers_are_those_transformers_builds(family_paths, family, hf_oracle):
    path = family_paths[family]
    with open(f"{path}/config.json") as f:
        cfg = DecoderConfig.from_hf(json.load(f))
    hf = hf_oracle(path).model.model.layers
    blocks = [type(getattr(layer, "mlp", None) or layer.block_sparse_moe).__name__
              for layer in hf]
    assert blocks == SPARSE_BLOCKS[family]
    assert cfg.moe_layers == tuple(b.endswith("SparseMoeBlock") for b in blocks)
    assert cfg.num_experts == FAMILIES[family].num_experts


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_equals_transformers(family_paths, family, async_scheduling, hf_oracle):
    path = family_paths[family]
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared + [7, 8], shared + [rng.randrange(3, 512) for _ in range(25)],
               [rng.randrange(3, 512) for _ in range(33)], [5, 6]]
    assert_greedy_equals_transformers(
        path, hf_oracle(path), prompts, [14, 9, 16, 20],
        async_scheduling=async_scheduling, block_size=4, num_kv_blocks=28,
        max_num_batched_tokens=16, max_num_seqs=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_with_ngram_speculation_equals_transformers(family_paths, family,
                                                               hf_oracle):
    """Prompts that repeat, so prompt lookup proposes and some proposals are accepted."""
    path = family_paths[family]
    phrase = [11, 12, 13, 14, 15, 16]
    prompts = [phrase * 4, [40, 41] + phrase * 3]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    with LLM(path, async_scheduling=True, speculative_config=spec, block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        metrics = llm.get_metrics()
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_oracle(path).greedy(p, 16)
    assert metrics["raylm:spec_decode_num_draft_tokens"] > 0


def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


PROMPT = list(range(40, 72))  # 32 tokens: far beyond a 5-token window


@pytest.mark.parametrize(("family", "fields"), [
    ("mixtral", {"sliding_window": 5}),  # every layer
    # A hub Qwen2-MoE config (no layer_types): transformers 5 windows the even layers
    # below max_window_layers, here layer 0 of 3.
    ("qwen2-moe", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                   "layer_types": None}),
])
def test_a_moe_familys_sliding_window_is_honoured(family_paths, family, fields, tmp_path,
                                                  hf_oracle):
    path = _with_config(family_paths[family], tmp_path / "windowed", **fields)
    want = hf_oracle(path).greedy(PROMPT, 12)
    assert want != hf_oracle(family_paths[family]).greedy(PROMPT, 12)  # the window matters
    with LLM(path, block_size=4) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


@pytest.mark.parametrize(("family", "fields", "message"), [
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv=8\.0 is not supported for OLMoE"),
    ("olmoe", {"sliding_window": 16}, r"sliding_window=16 is not supported for OLMoE"),
    ("qwen2-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok must be in \[1, "
                                            r"num_experts=4\], got 5"),
])
def test_a_moe_field_raylm_cannot_honour_is_refused_by_name(family_paths, family, fields,
                                                            message, tmp_path):
    path = _with_config(family_paths[family], tmp_path / "refused", **fields)
    with pytest.raises(ValueError, match=message):
        LLM(path)


@pytest.mark.parametrize(("num_experts", "size", "ranges"), [
    (8, 2, [(0, 4), (4, 4)]), (5, 2, [(0, 3), (3, 2)]), (7, 4, [(0, 2), (2, 2), (4, 2), (6, 1)])])
def test_expert_ranges_cover_every_expert_once(num_experts, size, ranges):
    assert [expert_range(num_experts, r, size) for r in range(size)] == ranges


def test_expert_parallel_ranks_hold_and_read_only_their_experts(family_paths):
    """Qwen2-MoE at TP=2 with expert parallelism (loading only: no collective runs): rank r
    holds experts 4r..4r+3 whole, equal to the TP=1 model's, asks the lazy reader for only
    their tensors, and still splits the shared expert's intermediate dimension."""
    from raylm.runner.loading.model_loader import get_model, iterate_weights
    from raylm.scheduler.config.engine_config import ModelConfig

    path = family_paths["qwen2-moe"]
    config = ModelConfig(model=path, dtype="float32")
    full = get_model(config, ParallelContext.single()).model.layers[0].mlp
    names = [name for name, _ in iterate_weights(path) if ".mlp.experts." in name]
    for rank in range(2):
        ctx = ParallelContext(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0,
                              device=torch.device("cpu"), tp_group=object(),
                              expert_parallel=True)
        model = get_model(config, ctx)
        block = model.model.layers[0].mlp
        assert block.local_experts == range(4 * rank, 4 * rank + 4)
        assert torch.equal(block.w13, full.w13[4 * rank:4 * rank + 4])
        assert torch.equal(block.w2, full.w2[4 * rank:4 * rank + 4])
        wanted = {name.split(".")[5] for name in names if model.needs_weight(name)}
        assert wanted == {str(e) for e in block.local_experts}
        shared = block.shared_expert.down_proj.weight
        assert torch.equal(shared, full.shared_expert.down_proj.weight.chunk(2, dim=1)[rank])


@pytest.mark.parametrize(("family", "engine", "message"), [
    ("dense", {"enable_expert_parallel": True},
     "enable_expert_parallel=True needs a mixture-of-experts model; LlamaForCausalLM"),
    ("mixtral", {"enable_expert_parallel": True, "tensor_parallel_size": 8},
     r"num_experts=4 cannot give each of tensor_parallel_size=8 ranks an expert"),
    ("mixtral", {"enable_expert_parallel": True, "data_parallel_size": 2,
                 "tensor_parallel_size": 4},
     r"num_experts=4 cannot give each of data_parallel_size x tensor_parallel_size=8 ranks"),
    ("mixtral", {"enable_expert_parallel": True, "data_parallel_size": 8},
     r"num_experts=4 cannot give each of data_parallel_size x tensor_parallel_size=8 ranks"),
    ("mixtral", {"enable_expert_parallel": True, "data_parallel_size": 2,
                 "speculative_config": {"method": "draft_model", "model": "DRAFT",
                                        "num_speculative_tokens": 2}},
     "does not run a draft model"),
])
def test_expert_parallel_it_cannot_run_is_refused_by_name(family_paths, llama_path, family,
                                                          engine, message):
    from raylm.cluster.engine.engine_args import EngineArgs

    path = llama_path if family == "dense" else family_paths[family]
    spec = engine.get("speculative_config")
    if spec is not None:  # a draft of the same vocabulary: the target itself
        engine = {**engine, "speculative_config": {**spec, "model": path}}
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path, **engine).create_engine_config()


def test_expert_load_counts_every_routed_token_and_reaches_prometheus(moe_path):
    """One request, nothing cached or preempted: each sparse layer (0 and 2) routes every
    forward token (the prompt and each generated token but the last) to top_k=2 experts;
    the counters and each layer's imbalance reach the /metrics exposition."""
    from prometheus_client import generate_latest

    from raylm.cluster.engine.engine_stats import engine_stats
    from raylm.cluster.serve.deployment.metrics import ServingMetrics

    prompt, n = list(range(40, 61)), 9
    with LLM(moe_path, async_scheduling=False) as llm:
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        metrics = llm.get_metrics()
    tokens: dict[tuple[int, int], float] = {}
    for key, value in metrics.items():
        if key.startswith("raylm:moe_expert_tokens{"):
            layer, expert = (int(v) for v in re.findall(r'"(\d+)"', key))
            tokens[layer, expert] = value
    assert {layer for layer, _ in tokens} == {0, 2}
    for layer in (0, 2):
        per_expert = [tokens[layer, e] for e in range(8)]
        assert sum(per_expert) == 2 * (len(prompt) + n - 1)
    text = generate_latest(ServingMetrics("m", lambda: engine_stats(metrics)).registry).decode()
    assert f'raylm:moe_expert_tokens_total{{expert="3",layer="2",model_name="m"}} ' \
           f'{tokens[2, 3]}' in text
    busiest = max(tokens[0, e] for e in range(8)) / (2 * (len(prompt) + n - 1) / 8)
    assert f'raylm:moe_expert_load_imbalance{{layer="0",model_name="m"}} {busiest}' in text
    assert "# TYPE raylm:moe_expert_load_imbalance gauge" in text


def test_lora_on_a_moe_model_is_refused_by_name(moe_path):
    with pytest.raises(ValueError, match="enable_lora is not supported for Qwen3MoeForCausalLM"):
        LLM(moe_path, enable_lora=True)


def test_a_checkpoint_missing_an_expert_is_refused(moe_path, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(moe_path, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.2\.mlp\.w13"):
        LLM(str(broken))
