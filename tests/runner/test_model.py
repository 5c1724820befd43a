"""The Llama-family model against transformers: full prefill, chunked prefill, decodes and
mixed batches through the paged KV cache; pipeline stages; loading errors; RoPE types."""

from __future__ import annotations

import pytest
import torch
import transformers
from paged import PagedSequences

from raylm.parallel.context import ParallelContext
from raylm.runner.loading.model_loader import cpu_has_fast_bfloat16, get_model, resolve_dtype
from raylm.runner.models.decoder_config import DecoderConfig
from raylm.runner.rotary import RotaryEmbedding
from raylm.scheduler.config.engine_config import ModelConfig

CPU = ParallelContext.single("cpu")


def _hf(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens(lengths: dict[str, int], vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, vocab, (n,), generator=g) for k, n in lengths.items()}


# Step plan: chunked prefill (with and without earlier context), a decode next to a
# prefill, an all-decode step, then a reordered batch.
LENGTHS = {"a": 12, "b": 12, "c": 8}
PLAN = [
    [("a", 0, 4), ("b", 0, 9)],
    [("a", 4, 10), ("b", 9, 10), ("c", 0, 6)],
    [("a", 10, 11), ("b", 10, 11), ("c", 6, 7)],
    [("c", 7, 8), ("b", 11, 12), ("a", 11, 12)],
]


@torch.inference_mode()
def test_forward_matches_transformers_through_paged_kv(any_model_path):
    model = get_model(ModelConfig(model=any_model_path), CPU)
    hf = _hf(any_model_path)
    tokens = _tokens(LENGTHS, model.config.vocab_size)
    ref = {k: hf(t[None]).logits[0] for k, t in tokens.items()}
    paged = PagedSequences([model], LENGTHS)
    for chunks in PLAN:
        ids, pos, meta = paged.step(tokens, chunks)
        logits = model.compute_logits(model(ids, pos, meta))
        offset = 0
        for name, start, end in chunks:
            got = logits[offset:offset + end - start]
            torch.testing.assert_close(got, ref[name][start:end], atol=1e-4, rtol=0)
            offset += end - start


@torch.inference_mode()
def test_full_prefill_matches_transformers(any_model_path):
    model = get_model(ModelConfig(model=any_model_path), CPU)
    tokens = _tokens({"x": 37}, model.config.vocab_size, seed=5)
    paged = PagedSequences([model], {"x": 37})
    ids, pos, meta = paged.step(tokens, [("x", 0, 37)])
    logits = model.compute_logits(model(ids, pos, meta))
    ref = _hf(any_model_path)(tokens["x"][None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_pipeline_stages_compose_to_the_full_model(any_model_path):
    mc = ModelConfig(model=any_model_path)
    full = get_model(mc, CPU)
    stages = [get_model(mc, ParallelContext(tp_rank=0, tp_size=1, pp_rank=r, pp_size=2,
                                            dp_rank=0, device=torch.device("cpu")))
              for r in range(2)]
    assert [(s.model.start_layer, s.model.end_layer) for s in stages] == [(0, 1), (1, 2)]
    assert len(stages[0].attention_layers) == len(stages[1].attention_layers) == 1
    tokens = _tokens(LENGTHS, full.config.vocab_size, seed=1)
    paged = PagedSequences([full, *stages], LENGTHS)
    for chunks in PLAN:
        ids, pos, meta = paged.step(tokens, chunks)
        expected = full.compute_logits(full(ids, pos, meta))
        intermediate = stages[0](ids, pos, meta)
        assert intermediate.hidden_states.shape == intermediate.residual.shape
        hidden = stages[1](None, pos, meta, intermediate_tensors=intermediate)
        torch.testing.assert_close(stages[1].compute_logits(hidden), expected, atol=1e-5, rtol=0)


def test_unsupported_architecture_is_named():
    hf = {"architectures": ["GPT2LMHeadModel"], "hidden_size": 8, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        DecoderConfig.from_hf(hf)


def test_bad_activation_is_named(llama_path):
    hf = dict(ModelConfig(model=llama_path).hf_config, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        DecoderConfig.from_hf(hf)


def test_dtype_resolution(tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, fast_cpu_bfloat16=False) == torch.float32
    # A float32 checkpoint runs in bf16 where bf16 is native; others keep their dtype.
    assert resolve_dtype("auto", cpu, {"dtype": "float32"}, True) == torch.bfloat16
    assert resolve_dtype("auto", cpu, {"torch_dtype": "bfloat16"}, False) == torch.bfloat16
    assert resolve_dtype("auto", cpu, {"dtype": "float16"}, True) == torch.float16
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float32", cpu, {"dtype": "bfloat16"}, True) == torch.float32
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    assert cpu_has_fast_bfloat16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f\n")
    assert not cpu_has_fast_bfloat16(str(info))
    assert resolve_dtype("float64", torch.device("cpu")) == torch.float64
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", torch.device("cpu"))


@torch.inference_mode()
def test_bfloat16_model_is_close_to_float32(llama_path):
    model = get_model(ModelConfig(model=llama_path, dtype="bfloat16"), CPU)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = get_model(ModelConfig(model=llama_path), CPU)
    tokens = _tokens({"x": 9}, ref.config.vocab_size, seed=2)
    paged = PagedSequences([ref, model], {"x": 9})
    ids, pos, meta = paged.step(tokens, [("x", 0, 9)])
    expected = ref.compute_logits(ref(ids, pos, meta))
    for attn in model.attention_layers:
        attn.kv_cache = tuple(c.to(torch.bfloat16) for c in attn.kv_cache)
    got = model.compute_logits(model(ids, pos, meta))
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()


def test_unexpected_checkpoint_tensor_raises(llama_path):
    model = get_model(ModelConfig(model=llama_path), CPU)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])


def test_missing_checkpoint_tensor_raises(llama_path):
    model = get_model(ModelConfig(model=llama_path), CPU)
    from raylm.runner.loading.model_loader import iterate_weights

    weights = [(n, t) for n, t in iterate_weights(llama_path) if "post_attention" not in n]
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        model.load_weights(weights)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_rope_scaling_matches_transformers(rope):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=1024,
                                      rope_scaling=dict(rope, rope_theta=10000.0))
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 300, 1000]])
    cos_ref, sin_ref = hf_rope(torch.zeros(1, 5, 16), positions)
    ours = RotaryEmbedding(config.to_dict(), 16, 1024, torch.float32, torch.device("cpu"))
    cos, sin = ours.cos_sin(positions[0])
    torch.testing.assert_close(cos[:, 0], cos_ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], sin_ref[0], atol=1e-6, rtol=0)


def test_sharded_checkpoint_loads_through_its_index(llama_path, tmp_path):
    hf = _hf(llama_path)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    from raylm.runner.loading.model_loader import safetensors_files

    files = safetensors_files(str(tmp_path))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index")  # never read
    sharded = get_model(ModelConfig(model=str(tmp_path)), CPU)
    single = get_model(ModelConfig(model=llama_path), CPU)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@torch.inference_mode()
def test_cpu_linears_run_packed_and_match_the_dense_product(llama_path, monkeypatch):
    """On CPU every linear (qkv, o, gate_up, down, the LM head) gets a oneDNN-packed weight
    after loading and its forward reads it; the logits equal the dense (MKL) model's up to
    rounding. RAYLM_CPU_PACK_LINEARS=0 leaves the linears dense."""
    packed = get_model(ModelConfig(model=llama_path), CPU)
    monkeypatch.setenv("RAYLM_CPU_PACK_LINEARS", "0")
    dense = get_model(ModelConfig(model=llama_path), CPU)
    layer = packed.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj, packed.lm_head]
    assert all(m.packed_weight is not None and m.packed_weight.is_mkldnn for m in linears)
    assert all(m.packed_weight is None for m in dense.modules() if hasattr(m, "packed_weight"))
    # The forward reads the packed copy: zeroing it (the dense weight untouched) zeroes
    # the projection's output.
    x = torch.randn(5, layer.self_attn.o_proj.weight.shape[1])
    saved = layer.self_attn.o_proj.packed_weight
    layer.self_attn.o_proj.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
        torch.zeros_like(layer.self_attn.o_proj.weight))
    assert layer.self_attn.o_proj(x).abs().max().item() == 0.0
    layer.self_attn.o_proj.packed_weight = saved
    tokens = _tokens({"x": 37}, packed.config.vocab_size, seed=5)
    logits = {}
    for name, model in (("packed", packed), ("dense", dense)):
        paged = PagedSequences([model], {"x": 37})
        ids, pos, meta = paged.step(tokens, [("x", 0, 37)])
        logits[name] = model.compute_logits(model(ids, pos, meta))
    torch.testing.assert_close(logits["packed"], logits["dense"], atol=1e-4, rtol=0)
    assert logits["packed"].argmax(-1).tolist() == logits["dense"].argmax(-1).tolist()


def test_partial_rotary_matches_transformers():
    """Bamba rotates the first half of each head and passes the rest through."""
    from transformers.models.bamba import modeling_bamba

    from raylm.runner.models.fused_ops import rotary

    config = transformers.BambaConfig(hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=1024)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    positions = torch.tensor([[0, 1, 7, 300, 1000]])
    cos_ref, sin_ref = modeling_bamba.BambaRotaryEmbedding(config)(torch.zeros(1, 5, 16),
                                                                  positions)
    ours = RotaryEmbedding(config.to_dict(), 16, 1024, torch.float32, torch.device("cpu"))
    cos, sin = ours.cos_sin(positions[0])
    assert cos.shape == (5, 1, 8)
    torch.testing.assert_close(cos[:, 0], cos_ref[0], atol=1e-6, rtol=0)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    q_ref, k_ref = modeling_bamba.apply_rotary_pos_emb(q.transpose(0, 1)[None],
                                                       k.transpose(0, 1)[None], cos_ref, sin_ref)
    q_out, k_out = rotary(cos, sin, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.equal(q_out[..., 8:], q[..., 8:])
