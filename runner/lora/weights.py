"""Read a PEFT adapter's tensors into this rank's parts: its stage's layers, its TP shard,
the scale folded into B (PEFT adds ``lora_B(lora_A(x)) * scaling``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from safetensors.torch import load_file

from raylm.runner.lora.lora_linear import LoRALinear, SliceLoRA
from raylm.runner.lora.peft import TARGETS, WEIGHTS_FILE, adapter_folder, check_adapter

# (layer index, raylm's fused module) -> that module's slices of the adapter
HostAdapter = dict[tuple[int, str], list[SliceLoRA | None]]


@dataclass(frozen=True)
class LoadedAdapter:
    path: str
    parts: HostAdapter


def _peft_module(layer: int, module: str) -> str:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def load_adapter(path: str, hooks: dict[tuple[int, str], LoRALinear],
                 hf_config: dict, max_lora_rank: int) -> LoadedAdapter:
    """The adapter at ``path`` (a folder or a URI: ``peft.adapter_folder``) cut for the
    linears in ``hooks`` (this rank's), on the host. The files are checked first
    (``peft.check_adapter``)."""
    config, tensors = check_adapter(path, hf_config, max_lora_rank)
    state = load_file(os.path.join(adapter_folder(path), WEIGHTS_FILE))
    parts: HostAdapter = {}
    for t in tensors:
        if t.which != "A":
            continue
        fused, index = TARGETS[t.module]
        hook = hooks.get((t.layer, fused))
        if hook is None:
            continue  # another pipeline stage's layer
        a = state[t.key].float()
        b = state[t.key[:-len("lora_A.weight")] + "lora_B.weight"].float()
        b = b * config.scaling(_peft_module(t.layer, t.module), a.shape[0])
        slices = parts.setdefault((t.layer, fused), [None] * hook.num_slices)
        slices[index] = hook.shard(index, a, b)
    return LoadedAdapter(path, parts)
