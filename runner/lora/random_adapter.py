"""Write random-weight LoRA adapters in PEFT's format, for the tests and the benchmark
(nothing downloaded; PEFT itself is not needed to write one, only to check one)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from raylm.runner.lora.peft import CONFIG_FILE, WEIGHTS_FILE, projection_shapes

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, base_model: str, r: int, lora_alpha: float | None = None,
                         target_modules: Sequence[str] = ALL_TARGETS,
                         use_rslora: bool = False, std: float = 0.1, seed: int = 0) -> str:
    """A PEFT LoRA adapter of rank ``r`` for the checkpoint folder ``base_model`` into
    ``path``: A and B both random (PEFT starts B at zero, which would change nothing),
    normal with ``std``; ``lora_alpha`` defaults to 2r."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base_model, "config.json")) as f:
        hf_config = json.load(f)
    shapes = projection_shapes(hf_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(hf_config["num_hidden_layers"])):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in ALL_TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": r, "lora_alpha": 2 * r if lora_alpha is None else lora_alpha,
              "lora_dropout": 0.0, "target_modules": list(target_modules), "bias": "none",
              "use_rslora": use_rslora, "use_dora": False, "fan_in_fan_out": False,
              "inference_mode": True, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return path
