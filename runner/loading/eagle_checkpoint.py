"""Random draft heads for a target checkpoint written here (tests, bench/gpu_check.py):
EAGLE heads in the public layouts (EAGLE-1's ``fc`` + ``layers.0``, EAGLE-3's ``midlayer``
and its own LM head over a draft vocabulary; runner/models/eagle_head.py reads them), and
a DeepSeek-V3 or Qwen3-Next MTP layer appended to the target's own file
(runner/models/mtp_head.py)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

DRAFT_VOCAB = 96  # EAGLE-3 heads here predict over a subset of the target's vocabulary


def aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual (2, L/2, L-3), kept inside a shallow test target."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def write_eagle_head(path: str, target_path: str, method: str, seed: int = 0,
                     scale: float = 0.2) -> str:
    """A random head for the target checkpoint at ``target_path``."""
    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads", heads)
    head_dim = target.get("head_dim") or hidden // heads
    inter, vocab = target["intermediate_size"], target["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    attn_in = hidden if method == "eagle" else 2 * hidden
    prefix = "layers.0." if method == "eagle" else "midlayer."
    tensors = {
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": rand(inter, hidden),
        prefix + "mlp.up_proj.weight": rand(inter, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, inter),
        prefix + "post_attention_layernorm.weight": 1 + rand(hidden),
    }
    config = dict(target, num_hidden_layers=1)
    if method == "eagle":
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        tensors["fc.bias"] = rand(hidden)
    else:
        tensors[prefix + "input_layernorm.weight"] = 1 + rand(hidden)
        tensors[prefix + "hidden_norm.weight"] = 1 + rand(hidden)
        tensors["fc.weight"] = rand(hidden, 3 * hidden)
        tensors["norm.weight"] = 1 + rand(hidden)
        tensors["lm_head.weight"] = rand(DRAFT_VOCAB, hidden) * 5
        chosen = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
        tensors["d2t"] = chosen - torch.arange(DRAFT_VOCAB)  # draft id + d2t = target id
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                      eagle_config={"eagle_aux_hidden_state_layer_ids":
                                    aux_layer_ids(target["num_hidden_layers"])})
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def add_mtp_layer(target_path: str, spec, seed: int = 0, scale: float = 0.2) -> str:
    """Append a random MTP layer to the checkpoint at ``target_path`` (``spec``: its
    CheckpointSpec), in the layout the model's checkpoints use: DeepSeek-V3's layer L =
    num_hidden_layers (``model.layers.L.`` with ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.{norm,head}``), or Qwen3-Next's ``mtp.`` tensors (``fc``,
    ``pre_fc_norm_{embedding,hidden}``, ``layers.0.``, ``norm``; layer L of an (L + 1)-layer
    model must be full attention). Returns the path of an (L + 1)-layer checkpoint whose
    layer L is that decoder layer (a reference for tests)."""
    import dataclasses
    import tempfile

    from safetensors.torch import load_file

    from raylm.runner.loading.checkpoint import write_random_checkpoint

    layer = spec.num_hidden_layers
    wider = write_random_checkpoint(tempfile.mkdtemp(prefix="mtp-"), dataclasses.replace(
        spec, num_hidden_layers=layer + 1, seed=spec.seed + 1000 + seed))
    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    layer_tensors = {k.removeprefix(f"model.layers.{layer}."): v for k, v in
                     load_file(os.path.join(wider, "model.safetensors")).items()
                     if k.startswith(f"model.layers.{layer}.")}
    if spec.architecture == "Qwen3NextForCausalLM":
        extra = {f"mtp.layers.0.{k}": v for k, v in layer_tensors.items()}
        extra.update({"mtp.fc.weight": rand(hidden, 2 * hidden),
                      "mtp.pre_fc_norm_embedding.weight": rand(hidden),
                      "mtp.pre_fc_norm_hidden.weight": rand(hidden),
                      "mtp.norm.weight": rand(hidden)})  # Qwen3-Next norms: 1 + weight
    else:
        prefix = f"model.layers.{layer}."
        extra = {prefix + k: v for k, v in layer_tensors.items()}
        extra.update({prefix + "enorm.weight": 1 + rand(hidden),
                      prefix + "hnorm.weight": 1 + rand(hidden),
                      prefix + "eh_proj.weight": rand(hidden, 2 * hidden),
                      prefix + "shared_head.norm.weight": 1 + rand(hidden),
                      prefix + "shared_head.head.weight": rand(vocab, hidden)})
        config["num_nextn_predict_layers"] = 1
    file = os.path.join(target_path, "model.safetensors")
    weights = load_file(file)
    weights.update(extra)
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(target_path, "config.json"), "w") as f:
        json.dump(config, f)
    return wider
