"""PEFT LoRA adapters as files: ``adapter_config.json`` and ``adapter_model.safetensors``.

A folder may be a URI (``s3://...``): it is copied once per node into raylm's cache
(``adapter_folder``). Pure Python (json and the safetensors header, no torch), so the
intake checks an adapter
before any request of it reaches the engine: a refusal names what is wrong (a rank over
``max_lora_rank``, a module raylm does not adapt, a shape that is not the model's) instead
of failing a worker mid-step. ``raylm.runner.lora.weights`` reads the tensors themselves.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from raylm.runner.loading.remote_files import fetch_folder

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections raylm adapts: HF module name -> (raylm's fused module, its slice).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of PEFT's ``LoraConfig`` that change the product."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def scaling(self, module: str, rank: int) -> float:
        """PEFT's scale of ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) of rank
        ``rank``: alpha / r, or alpha / sqrt(r) with rsLoRA; ``alpha_pattern`` matched
        as PEFT matches it (the first key that names a suffix of the module)."""
        alpha = self.lora_alpha
        for key, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass(frozen=True)
class AdapterTensor:
    """One LoRA matrix of the file: layer, HF module, A or B, its shape."""

    key: str
    layer: int
    module: str
    which: str  # "A" [r, in] or "B" [out, r]
    shape: tuple[int, ...]


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter at {path!r}: {why}")


def read_adapter_config(path: str) -> AdapterConfig:
    """The adapter's config, refused (ValueError) where it asks for what raylm does not
    run: another PEFT method, DoRA, LoRA biases, extra trainable modules."""
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            raw: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise _refuse(path, f"no {CONFIG_FILE} (a PEFT adapter folder holds "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE}).") from None
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(raw, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object.")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {raw.get('peft_type')!r} is not LORA.")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("lora_bias", False)):
        if raw.get(key, off) not in (off, None):
            raise _refuse(path, f"{key}={raw[key]!r} is not supported.")
    if raw.get("bias", "none") not in ("none", None):
        raise _refuse(path, f"bias={raw['bias']!r} is not supported (only 'none').")
    for key in ("modules_to_save", "layer_replication", "target_parameters",
                "trainable_token_indices"):
        if raw.get(key):
            raise _refuse(path, f"{key}={raw[key]!r} is not supported (raylm adapts "
                                f"{', '.join(TARGETS)} only).")
    try:
        r = int(raw["r"])
        alpha = float(raw.get("lora_alpha", 8))
        alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise _refuse(path, f"bad r / lora_alpha / alpha_pattern in {CONFIG_FILE}: {e!r}") \
            from None
    if r < 1:
        raise _refuse(path, f"r={r} must be at least 1.")
    return AdapterConfig(r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora")),
                         alpha_pattern=alpha_pattern)


def read_tensor_index(path: str) -> list[AdapterTensor]:
    """The LoRA matrices of ``adapter_model.safetensors`` from its header (no tensor is
    read); a tensor of any other module is refused."""
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise _refuse(path, f"no {WEIGHTS_FILE}.") from None
    except (OSError, struct.error, ValueError) as e:
        raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file: {e!r}") from None
    tensors = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise _refuse(path, f"tensor {key!r} adapts a module raylm does not (only "
                                f"{', '.join(TARGETS)} of the decoder layers).")
        tensors.append(AdapterTensor(key, int(match.group(1)), match.group(2),
                                     match.group(3), tuple(info["shape"])))
    if not tensors:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA tensors.")
    return tensors


def projection_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection of the model."""
    heads = int(hf_config["num_attention_heads"])
    hidden = int(hf_config["hidden_size"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def adapter_folder(path: str) -> str:
    """The local folder of the adapter at ``path`` (a path, or a URI fetched into this
    node's cache once)."""
    try:
        return fetch_folder(path, (CONFIG_FILE, WEIGHTS_FILE), "lora")
    except ValueError as e:
        raise _refuse(path, str(e)) from None


def check_adapter(path: str, hf_config: dict[str, Any], max_lora_rank: int
                  ) -> tuple[AdapterConfig, list[AdapterTensor]]:
    """The adapter's config and tensors, each checked against the model (layers, shapes,
    A and B in pairs) and ``max_lora_rank``; ValueError naming the first problem."""
    path = adapter_folder(path)
    if not os.path.isdir(path):
        raise _refuse(path, "not a folder.")
    config = read_adapter_config(path)
    tensors = read_tensor_index(path)
    shapes = projection_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    ranks: dict[tuple[int, str], dict[str, int]] = {}
    for t in tensors:
        if not 0 <= t.layer < num_layers:
            raise _refuse(path, f"tensor {t.key!r} is for layer {t.layer}; the model has "
                                f"{num_layers}.")
        fan_in, fan_out = shapes[t.module]
        if len(t.shape) != 2:
            raise _refuse(path, f"tensor {t.key!r} has shape {list(t.shape)}, not a matrix.")
        rank, features = (t.shape[0], t.shape[1]) if t.which == "A" else (t.shape[1], t.shape[0])
        expected = fan_in if t.which == "A" else fan_out
        if features != expected:
            raise _refuse(path, f"tensor {t.key!r} has shape {list(t.shape)}: the model's "
                                f"{t.module} has {fan_in} inputs and {fan_out} outputs (an "
                                "adapter for another base model?).")
        if rank > max_lora_rank:
            raise _refuse(path, f"{t.module} of layer {t.layer} has rank {rank}, more than "
                                f"max_lora_rank={max_lora_rank}.")
        ranks.setdefault((t.layer, t.module), {})[t.which] = rank
    for (layer, module), pair in ranks.items():
        if set(pair) != {"A", "B"} or pair["A"] != pair["B"]:
            raise _refuse(path, f"{module} of layer {layer} needs lora_A and lora_B of one "
                                f"rank, found {pair}.")
    return config, tensors
