"""Each TP rank reads only its slice of the safetensors checkpoint: the lazy tensors of
runner/model_loader.iterate_weights hand the loaders (parallel/layers.py) just the range
they narrow out. Per rank, the loaded parameters equal the matching slices of a TP=1 load,
and the bytes read are exactly the rank's share (1/TP of each sharded tensor, the
replicated norms whole), which a loader that read whole tensors would exceed."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from raylm.parallel.context import ParallelContext
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.loading.model_loader import (
    LazyTensor,
    WeightReadStats,
    get_model,
    iterate_weights,
    safetensors_files,
)
from raylm.scheduler.config.engine_config import ModelConfig

CPU = ParallelContext.single("cpu")


def _ctx(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> ParallelContext:
    # Loading only: stand-in group objects (no collective runs while building or loading).
    return ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                           dp_rank=0, device=torch.device("cpu"),
                           tp_group=object() if tp_size > 1 else None,
                           pp_group=object() if pp_size > 1 else None)


def _headers(path: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, whole size in bytes) of every tensor in the checkpoint, from the
    headers alone."""
    out = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = LazyTensor(f.get_slice(name), name)
                out[name] = (tuple(t.shape), t.nbytes)
    return out


def _share(name: str, hf_config: dict, tp: int) -> float:
    """The fraction of checkpoint tensor ``name`` one TP rank reads: norms whole, a KV
    projection its ranks' KV heads (one head when tp > num_kv_heads: replicated), every
    other tensor (q/o/gate/up/down, their biases, embedding, LM head) 1/tp."""
    if "norm." in name:
        return 1.0
    if ".k_proj." in name or ".v_proj." in name:
        kv = hf_config["num_key_value_heads"]
        return max(1, kv // tp) / kv
    return 1 / tp


def _expected_bytes(model, path: str, hf_config: dict, tp: int) -> tuple[int, int]:
    """(bytes a rank of ``model``'s stage reads, whole bytes of the tensors it loads)."""
    headers = _headers(path)
    wanted = [name for name in headers if model.needs_weight(name)]
    share = sum(headers[n][1] * _share(n, hf_config, tp) for n in wanted)
    assert share == int(share), "every shape divides by tp in these checkpoints"
    return int(share), sum(headers[n][1] for n in wanted)


def _expected_param(name: str, ref: dict[str, torch.Tensor], model, rank: int, tp: int
                    ) -> torch.Tensor:
    """The slice of the TP=1 model's parameter ``name`` that TP rank ``rank`` holds."""
    full = ref[name]
    cfg = model.config
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        q, k, v = full.split([q_size, kv_size, kv_size])
        kv_parts = min(tp, cfg.num_key_value_heads)  # tp > kv heads: each head replicated
        kv_index = rank * kv_parts // tp
        return torch.cat([q.chunk(tp)[rank], k.chunk(kv_parts)[kv_index],
                          v.chunk(kv_parts)[kv_index]])
    if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, dim=1)[rank]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return full.chunk(tp)[rank]  # vocab divisible by tp here: no padding rows
    return full  # norms, row-parallel biases: replicated


def _check_rank(model, ref: dict[str, torch.Tensor], rank: int, tp: int) -> None:
    params = dict(model.named_parameters())
    assert params, "nothing loaded"
    for name, param in params.items():
        expected = _expected_param(name, ref, model, rank, tp)
        assert param.shape == expected.shape, (name, rank)
        assert torch.equal(param, expected), (name, rank)


def _load(path: str, ctx: ParallelContext, dtype: str = "float32"
          ) -> tuple[torch.nn.Module, WeightReadStats]:
    stats = WeightReadStats()
    return get_model(ModelConfig(model=path, dtype=dtype), ctx, stats=stats), stats


@pytest.fixture(scope="module")
def mqa_path(tmp_path_factory) -> str:
    """One KV head: at TP=2 both ranks hold (and read) the same, whole, k and v."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("mqa")), CheckpointSpec(
        num_attention_heads=4, num_key_value_heads=1, seed=7))


@pytest.fixture(params=["llama", "llama_mha_tied", "qwen2", "qwen3", "mqa"])
def sliced_model_path(request) -> str:
    return request.getfixturevalue(f"{request.param}_path")


def test_tp2_ranks_load_their_slices_and_read_half(sliced_model_path):
    """GQA, MHA with tied embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms, one KV head
    (replicated over both ranks): each rank's parameters are its slices of the TP=1
    model's, and it reads exactly its share of the checkpoint, about half."""
    path = sliced_model_path
    hf_config = ModelConfig(model=path).hf_config
    full, full_stats = _load(path, CPU)
    ref = {name: p.detach().clone() for name, p in full.named_parameters()}
    checkpoint_bytes = sum(size for _, size in _headers(path).values())
    # TP=1 reads everything it loads, once (a tied checkpoint has no lm_head tensor).
    assert full_stats.bytes_read == full_stats.bytes_loaded == checkpoint_bytes
    loaded = []
    for rank in range(2):
        model, stats = _load(path, _ctx(rank, 2))
        _check_rank(model, ref, rank, 2)
        loaded.append(model)
        share, whole = _expected_bytes(model, path, hf_config, 2)
        assert stats.bytes_loaded == whole == checkpoint_bytes
        assert stats.bytes_read == share, (rank, stats, share)
        assert stats.bytes_read <= 0.6 * checkpoint_bytes, (rank, stats, checkpoint_bytes)
    # The two ranks hold different halves (the comparison above is not vacuous).
    a, b = (m.model.layers[0].mlp.down_proj.weight for m in loaded)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("tp", [4])
def test_kv_heads_replicated_over_ranks_read_one_head(llama_path, tp):
    """TP=4 over 2 KV heads: rank r holds KV head r // 2 and reads only that head's rows
    of k and v (a quarter of every other sharded tensor)."""
    hf_config = ModelConfig(model=llama_path).hf_config
    full, _ = _load(llama_path, CPU)
    ref = {name: p.detach().clone() for name, p in full.named_parameters()}
    for rank in range(tp):
        model, stats = _load(llama_path, _ctx(rank, tp))
        assert model.model.layers[0].self_attn.qkv_proj.num_kv_head_replicas == 2
        _check_rank(model, ref, rank, tp)
        share, _ = _expected_bytes(model, llama_path, hf_config, tp)
        assert stats.bytes_read == share, (rank, stats, share)


def test_tied_lm_head_on_the_last_stage_reads_its_vocab_shard(llama_mha_tied_path):
    """TP=2 x PP=2 with tied embeddings: the last stage has no embedding, and its LM head
    reads its own vocab shard of ``model.embed_tokens.weight``; each stage reads its
    layers' share and nothing of the other stage's."""
    path = llama_mha_tied_path
    hf_config = ModelConfig(model=path).hf_config
    full, _ = _load(path, CPU)
    ref = {name: p.detach().clone() for name, p in full.named_parameters()}
    embed = ref["model.embed_tokens.weight"]
    for pp_rank in range(2):
        for tp_rank in range(2):
            model, stats = _load(path, _ctx(tp_rank, 2, pp_rank, 2))
            share, whole = _expected_bytes(model, path, hf_config, 2)
            assert stats.bytes_read == share, (pp_rank, tp_rank, stats, share)
            assert stats.bytes_loaded == whole
            for name, param in model.named_parameters():
                source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
                expected = _expected_param(name, {name: ref[source]}, model, tp_rank, 2)
                assert torch.equal(param, expected), (pp_rank, tp_rank, name)
            if pp_rank == 1:
                assert torch.equal(model.lm_head.weight, embed.chunk(2)[tp_rank])
                assert "model.embed_tokens.weight" not in dict(model.named_parameters())


def test_loading_converts_the_dtype_of_the_slices(llama_path, monkeypatch):
    """A float32 checkpoint loaded in bfloat16 at TP=2: each rank's slice is the TP=1
    bfloat16 model's (the copy into the parameter converts, as for whole tensors)."""
    # Loading only: no oneDNN packing (bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    monkeypatch.setenv("RAYLM_CPU_PACK_LINEARS", "0")
    full, _ = _load(llama_path, CPU, dtype="bfloat16")
    ref = {name: p.detach().clone() for name, p in full.named_parameters()}
    for rank in range(2):
        model, _ = _load(llama_path, _ctx(rank, 2), dtype="bfloat16")
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
        _check_rank(model, ref, rank, 2)


def test_lazy_tensor_reads_and_counts_only_the_range(tmp_path):
    from safetensors.torch import save_file

    w = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    h = torch.arange(10, dtype=torch.bfloat16)
    save_file({"w": w, "h": h}, str(tmp_path / "model.safetensors"))
    stats = WeightReadStats()
    tensors = dict(iterate_weights(str(tmp_path), stats=stats))
    assert stats.tensors == 2 and stats.bytes_loaded == w.nbytes + h.nbytes
    assert stats.bytes_read == 0  # nothing read until a loader asks
    lw, lh = tensors["w"], tensors["h"]
    assert lw.shape == w.shape and lw.dim() == 2 and lw.dtype == torch.float32
    rows = lw.narrow(0, 2, 3)
    cols = lw.narrow(1, 4, 4)
    assert torch.equal(rows, w.narrow(0, 2, 3)) and rows.is_contiguous()
    assert torch.equal(cols, w.narrow(1, 4, 4)) and cols.is_contiguous()
    assert torch.equal(lw.narrow(-1, 0, 2), w[:, :2])
    assert stats.bytes_read == (3 * 8 + 6 * 4 + 6 * 2) * 4
    part = lh.narrow(0, 5, 5)
    assert part.dtype == torch.bfloat16 and torch.equal(part, h[5:])
    assert torch.equal(lw.read(), w)
    assert stats.bytes_read == (3 * 8 + 6 * 4 + 6 * 2) * 4 + 5 * 2 + w.nbytes
    with pytest.raises(ValueError, match="outside its shape"):
        lw.narrow(0, 4, 3)
    with pytest.raises(IndexError, match="out of range"):
        lw.narrow(2, 0, 1)
