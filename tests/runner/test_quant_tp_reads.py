"""TP-sliced loading of quantized tensors: at TP=2 each rank reads only its shard of the packed
data (GPTQ and AWQ qweight / qzeros / scales / g_idx, FP8 weights and their scales, GGUF
blocks) and packs exactly its slice of the whole-tensor load.

Tiny checkpoints in each format are written by the test (the GPTQ/AWQ and FP8 writers of
test_gptq_awq.py and test_quant_fp8.py; GGUF by runner/loading/gguf_writer.py); both ranks
are built in-process with stand-in groups (no collective runs while loading). Per rank:
every packed layer decodes to its slice of the TP=1 layer's weight, a column-parallel
layer's output is its slice of the TP=1 output and the row-parallel ranks' outputs sum to
it; the bytes read from the checkpoint's quantized linears are at most 0.6x (in fact about
half) of what TP=1 reads, and the whole load's at most 0.6x too. A split that cuts a
quantization group or block where the format cannot take it is refused by name."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gptq_awq import GROUP, _pack, _quantize
from test_gptq_awq import _write as write_gptq_awq
from test_quant_fp8 import _write as write_fp8
from test_quantized_linear import _ctx

from raylm.parallel.layers import QuantizableWeight
from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.loading.gguf_checkpoint import read_gguf_config
from raylm.runner.loading.gguf_file import open_gguf
from raylm.runner.loading.gguf_writer import write_gguf_from_hf
from raylm.runner.loading.model_loader import LazyTensor, WeightReadStats, get_model
from raylm.scheduler.config.engine_config import ModelConfig

# A format's quantized-linear tensors in a safetensors checkpoint (the rest: embedding, LM
# head, norms, kept dense and sliced as before).
_QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("gptq", "gptq-act-order", "awq", "fp8-block", "ct-channel", "fp8-tensor",
           "gguf-Q4_0", "gguf-Q8_0")


@pytest.fixture(scope="module")
def base_llama(tmp_path_factory) -> str:
    """hidden 256, intermediate 512: at TP=2 every row-parallel rank holds whole FP8
    blocks of 128 and whole GPTQ/AWQ groups of 128."""
    spec = CheckpointSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, seed=23)
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tp-reads-base")), spec)


def _write_act_order(base: str, folder: str) -> str:
    """Act-order GPTQ (desc_act) with one random feature order per input, as GPTQ orders
    features by the input's Hessian: q/k/v share one, gate/up another (test_gptq_awq's
    writer draws one per linear, which its hidden size of one group never exposes)."""
    tensors = load_file(os.path.join(base, "model.safetensors"))
    gen = torch.Generator().manual_seed(8)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    out = {}
    for name, w in tensors.items():
        prefix, _, _ = name.rpartition(".")
        linear = prefix.split(".")[-1]
        if not (name.endswith(".weight") and linear in _LINEARS):
            out[name] = w
            continue
        shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        key = (prefix.rsplit(".", 1)[0] + shared.get(linear, linear), w.shape[1])
        perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=gen))
        codes, zero, scale, _ = _quantize(w.float(), symmetric=True, perm=perm)
        out[f"{prefix}.qweight"] = _pack(codes.t().numpy(), axis=0)
        out[f"{prefix}.qzeros"] = _pack((zero - 1).numpy(), axis=1)
        out[f"{prefix}.g_idx"] = (torch.argsort(perm) // GROUP).int()
        out[f"{prefix}.scales"] = scale
    shutil.copytree(base, folder)
    save_file({k: v.contiguous() for k, v in out.items()},
              os.path.join(folder, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                     "desc_act": True, "sym": True,
                                     "checkpoint_format": "gptq"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.fixture(scope="module")
def checkpoints(base_llama, tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("tp-reads"))
    out = {"gptq": write_gptq_awq(base_llama, os.path.join(root, "gptq"), "gptq")[0],
           "gptq-act-order": _write_act_order(base_llama, os.path.join(root, "act")),
           "awq": write_gptq_awq(base_llama, os.path.join(root, "awq"), "awq")[0]}
    for name in ("fp8-block", "ct-channel", "fp8-tensor"):
        out[name] = write_fp8(base_llama, root, name)[0]
    for qtype in ("Q4_0", "Q8_0"):
        out[f"gguf-{qtype}"] = write_gguf_from_hf(base_llama,
                                                  os.path.join(root, f"tiny.{qtype}.gguf"), qtype)
    return out


@pytest.fixture
def reads_by_tensor(monkeypatch) -> Counter[str]:
    """Bytes read from the safetensors files, by tensor name (a counting wrapper around
    what WeightReadStats counts)."""
    counts: Counter[str] = Counter()
    original = LazyTensor._count

    def count(self: LazyTensor, t: torch.Tensor) -> torch.Tensor:
        counts[self.name] += t.numel() * t.element_size()
        return original(self, t)

    monkeypatch.setattr(LazyTensor, "_count", count)
    return counts


def _config(path: str, quantization: str | None = None) -> ModelConfig:
    hf_config = read_gguf_config(path) if path.endswith(".gguf") else None
    return ModelConfig(model=path, dtype="float32", hf_config=hf_config,
                       quantization=quantization)  # type: ignore[arg-type]


def _load(path: str, rank: int, tp: int, counts: Counter[str]
          ) -> tuple[dict[str, QuantizableWeight], WeightReadStats, int]:
    """(packed layers by name, the load's stats, bytes read of quantized-linear tensors)."""
    counts.clear()
    stats = WeightReadStats()
    model = get_model(_config(path), _ctx(rank, tp), stats)
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, QuantizableWeight) and m.quantized is not None}
    if path.endswith(".gguf"):  # every 2-D tensor is quantized; the norms (F32) read whole
        norms = sum(t.data.nbytes for t in open_gguf(path).tensors
                    if t.tensor_type.name == "F32")
        quantized = stats.bytes_read - norms
    else:
        quantized = sum(n for name, n in counts.items()
                        if name.rpartition(".")[2] in _QUANTIZED_PARTS
                        or (name.endswith(".weight") and name.split(".")[-2] in _LINEARS))
    return layers, stats, quantized


def _slice(name: str, full: torch.Tensor, rank: int, heads: tuple[int, int, int]
           ) -> torch.Tensor:
    """TP rank ``rank`` of 2's part of the TP=1 layer ``name``'s weight (or output rows)."""
    if name.endswith(("o_proj", "down_proj")):  # row parallel: input features
        return full.chunk(2, dim=1)[rank]
    if name.endswith("qkv_proj"):
        q, k, v = full.split(list(heads))
        return torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
    if name.endswith("gate_up_proj"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
    return full.chunk(2)[rank]  # vocabulary-parallel embedding and LM head


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_rank_reads_half_and_packs_its_slice(fmt, checkpoints, reads_by_tensor):
    path = checkpoints[fmt]
    whole, whole_stats, whole_quantized = _load(path, 0, 1, reads_by_tensor)
    assert whole_quantized > 0 and len(whole) >= 8  # 4 linears x 2 layers kept quantized
    head_dim = 256 // 4
    heads = (4 * head_dim, 2 * head_dim, 2 * head_dim)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    row_sums: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        layers, stats, quantized = _load(path, rank, 2, reads_by_tensor)
        assert set(layers) == set(whole), fmt
        for name, layer in layers.items():
            full = whole[name].quantized
            got = layer.quantized
            assert torch.equal(got.dequantize(), _slice(name, full.dequantize(), rank, heads)), \
                (fmt, name, rank)
            if name.endswith(("o_proj", "down_proj")):
                xs = x[:, :full.in_features]
                part = got(xs.chunk(2, dim=1)[rank])
                row_sums[name] = row_sums.get(name, 0) + part.double()
            elif name.endswith(("qkv_proj", "gate_up_proj")):
                xs = x[:, :full.in_features]
                want = _slice(name, full(xs).t(), rank, heads).t()
                torch.testing.assert_close(got(xs), want, rtol=0,
                                           atol=2e-6 * float(want.abs().max()))
        # The numbers the issue asks for: about half of the packed data, per rank.
        assert quantized <= 0.6 * whole_quantized, (fmt, rank, quantized, whole_quantized)
        assert stats.bytes_read <= 0.6 * whole_stats.bytes_read, (fmt, rank, stats,
                                                                    whole_stats)
    for name, total in row_sums.items():
        full = whole[name].quantized
        want = full(x[:, :full.in_features]).double()
        torch.testing.assert_close(total, want, rtol=0, atol=4e-6 * float(want.abs().max()))


def test_act_order_layers_stay_in_act_order(checkpoints, reads_by_tensor):
    """The act-order checkpoint above is not trivially ordered: every packed layer gathers
    its input features (so the slices compared there are act-order slices)."""
    layers, _, _ = _load(checkpoints["gptq-act-order"], 1, 2, reads_by_tensor)
    linears = [m for name, m in layers.items() if "layers." in name]
    assert linears and all(m.quantized.input_order is not None for m in linears)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8-block", "gguf-Q4_0"])
def test_dequantized_loads_read_half_too(fmt, checkpoints, reads_by_tensor):
    """quantization="none": each rank dequantizes only the part it reads, its parameters
    the slices of the TP=1 dense load (for GGUF: equal to the gguf package's
    dequantization of the whole file)."""
    config = _config(checkpoints[fmt], quantization="none")
    whole_stats = WeightReadStats()
    whole = dict(get_model(config, _ctx(0, 1), whole_stats).named_parameters())
    heads = (256, 128, 128)
    for rank in (0, 1):
        stats = WeightReadStats()
        params = dict(get_model(config, _ctx(rank, 2), stats).named_parameters())
        assert stats.bytes_read <= 0.6 * whole_stats.bytes_read, (fmt, rank, stats)
        for name in ("model.layers.0.self_attn.qkv_proj.weight",
                     "model.layers.1.self_attn.o_proj.weight",
                     "model.layers.0.mlp.gate_up_proj.weight",
                     "model.layers.1.mlp.down_proj.weight"):
            module = name.rpartition(".")[0]
            assert torch.equal(params[name], _slice(module, whole[name], rank, heads)), name
    if fmt.startswith("gguf"):
        from raylm.runner.loading.gguf_checkpoint import iterate_gguf_weights

        dense = dict(iterate_gguf_weights(checkpoints[fmt], config.hf_config))
        q, k, v = (dense[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
        assert torch.equal(whole["model.layers.0.self_attn.qkv_proj.weight"],
                           torch.cat([q, k, v]))
        assert torch.equal(whole["model.embed_tokens.weight"],
                           dense["model.embed_tokens.weight"])


def _fp8_shard(n: int, k: int):
    from raylm.runner.quantization.fp8_shard import Fp8Shard

    gen = torch.Generator().manual_seed(4)
    codes = (torch.randn(n, k, generator=gen) * 60).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.01
    return Fp8Shard("w.weight", codes, scale, (128, 128))


def _gptq_shard(n: int, k: int):
    from raylm.runner.quantization.gptq_awq_shard import GptqAwqShard

    gen = torch.Generator().manual_seed(4)
    parts = {"qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen,
                                      dtype=torch.int32),
             "qzeros": torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), generator=gen,
                                     dtype=torch.int32),
             "scales": torch.rand(k // 128, n, generator=gen).half()}
    return GptqAwqShard("w.weight", "gptq", parts, 128, v1_zeros=True)


@pytest.mark.parametrize("make, cut, match", [
    (_fp8_shard, (96, 96), r"w\.weight: the FP8 weight scales its input features in blocks of "
                           r"128; input features \[96, 192\) cut one"),
    (_gptq_shard, (16, 32), r"w\.weight: the GPTQ weight splits its input features in the "
                            r"kernels' groups of 32; input features \[16, 48\) cut one"),
])
def test_a_split_that_cuts_a_block_is_refused_by_name(make, cut, match):
    """Refused when the loader narrows (nothing read yet); the dense path takes the same
    split, reading the whole blocks it touches."""
    from raylm.runner.quantization.lazy_shard import Dequantizing

    shard = make(64, 256)
    with pytest.raises(ValueError, match=match):
        shard.narrow(1, *cut)
    start, length = cut
    dense = Dequantizing(shard).narrow(1, start, length)
    assert torch.equal(dense, shard.dequantize()[:, start:start + length])


@pytest.mark.parametrize("make", [_fp8_shard, _gptq_shard])
def test_rows_may_start_anywhere(make):
    """Column-parallel rows that cut an FP8 block row or a packed int32 of qzeros: the
    covering blocks are read and cut."""
    shard = make(160, 256)
    for start, length in ((0, 160), (3, 50), (133, 27)):
        got = shard.narrow(0, start, length).narrow(1, 128, 128).dequantize()
        assert torch.equal(got, shard.dequantize()[start:start + length, 128:]), (start, length)
