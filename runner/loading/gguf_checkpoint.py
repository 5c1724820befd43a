"""GGUF checkpoints (llama.cpp's format): the decoder config from the file's metadata and the
weights dequantized to Hugging Face names, one tensor at a time.

The file is memory-mapped (``gguf_file.GGUFFile``), so a rank that skips a tensor (another
pipeline stage's layer) never reads its bytes. The tokenizer and chat template come from
the same metadata through ``transformers`` (``AutoTokenizer.from_pretrained(gguf_file=)``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

from raylm.runner.loading.gguf_file import GGUFFile, open_gguf

# GGUF architecture -> Hugging Face architecture raylm's models implement.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# Tensor types dequantized with the gguf package's numpy kernels.
SUPPORTED_GGUF_TYPES = frozenset({
    "F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})
# GGUF per-layer tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms: one after attention, the pre-MLP norm llama.cpp calls ffn_norm, one after
# the MLP. llama.cpp stores every Gemma norm weight plus one (its norms scale by the weight).
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def find_gguf_file(model: str) -> str | None:
    """The .gguf file ``model`` names: the file itself, or the only .gguf in a folder that
    has no config.json. None when ``model`` is not a GGUF checkpoint."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        files = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if len(files) > 1:
            raise ValueError(f"model folder {model!r} holds {len(files)} .gguf files "
                             f"({[os.path.basename(f) for f in files]}); name one of them.")
        if files:
            return files[0]
    return None


def _reader(path: str) -> GGUFFile:
    return open_gguf(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def read_gguf_config(path: str) -> dict[str, Any]:
    """A Hugging Face config.json dict built from the GGUF metadata; ValueError naming an
    architecture or tensor type raylm cannot load."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {path!r} is not supported; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}.")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - SUPPORTED_GGUF_TYPES)
    if bad:
        raise ValueError(f"GGUF tensor type(s) {bad} of {path!r} are not supported; "
                         f"supported: {sorted(SUPPORTED_GGUF_TYPES)}.")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or _field(reader, f"{arch}.rope.scaling.type") not in (
            None, "none"):
        raise ValueError(f"GGUF rope scaling of {path!r} is not supported.")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"GGUF file {path!r} has neither {arch}.vocab_size nor tokens.")
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    config["attention_bias"] = arch != "qwen2" and "blk.0.attn_q.bias" in names
    if arch == "gemma3":
        # What transformers' GGUF loader builds: the file's window and RoPE base, the rest
        # Gemma3TextConfig's defaults (llama.cpp's too: every sixth layer global, a local
        # RoPE base of 10000, query_pre_attn_scalar 256).
        config.update(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
                      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                      sliding_window=int(_field(reader, "gemma3.attention.sliding_window",
                                                4096)),
                      sliding_window_pattern=6, rope_local_base_freq=10000.0)
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def _hf_name(name: str, gemma3: bool = False) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _GEMMA3_LAYER_NAMES if gemma3 else _LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation (it stores each head's rotary halves
    interleaved, the GPT-J layout; raylm's rotary, like transformers', uses NeoX halves)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iterate_gguf_weights(path: str, hf_config: dict[str, Any],
                         wanted: Callable[[str], bool] | None = None,
                         keep_quantized: bool = False, read_counter: list[int] | None = None
                         ) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 tensor) for each tensor ``wanted`` accepts; the others are
    neither read nor dequantized. With ``keep_quantized``, a 2-D tensor in a group format
    (runner/quantization/gguf_blocks.py) comes unread, as a LazyGGUFBlocks: the loaders
    narrow it, and only their part is read (``read_counter[0]`` adds the bytes)."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    from raylm.runner.quantization.gguf_blocks import GROUP_FORMATS, lazy_tensor

    reader = _reader(path)
    llama = hf_config.get("model_type") == "llama"
    gemma3 = hf_config.get("model_type") == "gemma3_text"
    for t in reader.tensors:
        name = _hf_name(t.name, gemma3)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} of {path!r} matches no "
                             f"{hf_config['architectures'][0]} weight.")
        if wanted is not None and not wanted(name):
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if keep_quantized and len(shape) == 2 and t.tensor_type.name in GROUP_FORMATS:
            q = lazy_tensor(t, read_counter)
            heads = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}.get(
                name.split(".")[-2]) if llama else None
            if heads is not None:  # the same row permutation, applied to whole rows
                rows = np.arange(shape[0]).reshape(shape[0], 1)
                q = q.select_rows(torch.from_numpy(
                    np.ascontiguousarray(_unpermute(rows, hf_config[heads])[:, 0])))
            yield name, q
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if llama and name.endswith("q_proj.weight"):
            w = _unpermute(w, hf_config["num_attention_heads"])
        elif llama and name.endswith("k_proj.weight"):
            w = _unpermute(w, hf_config["num_key_value_heads"])
        elif gemma3 and name.endswith("norm.weight"):
            w = w - 1.0
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32 tensors map the file
            w = np.array(w, copy=True)
        yield name, torch.from_numpy(w)


def load_gguf_tokenizer(path: str) -> Any:
    """The transformers tokenizer (with the chat template) stored in the GGUF metadata.
    Its class is named by the model type raylm read from the file where transformers maps
    that type to one (Gemma 3, Qwen): AutoTokenizer would first rebuild the model config
    with transformers' per-item GGUF reader (27 s for Gemma 3 270M's 262k-token vocabulary)
    only to find that class. Other types (llama: no class of its own) take AutoTokenizer's
    own path."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    model_type = read_gguf_config(path)["model_type"]
    named = {"tokenizer_type": model_type} if model_type in TOKENIZER_MAPPING_NAMES else {}
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path), **named)


def convert_gguf_to_hf(path: str, out_dir: str) -> str:
    """Write ``path`` as a float32 Hugging Face folder (config.json, model.safetensors,
    tokenizer files with the chat template) that loads without dequantizing."""
    import json

    from safetensors.torch import save_file

    config = read_gguf_config(path)
    os.makedirs(out_dir, exist_ok=True)
    load_gguf_tokenizer(path).save_pretrained(out_dir)
    save_file(dict(iterate_gguf_weights(path, config)),
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:  # last: marks it complete
        json.dump(config, f, indent=2)
    return out_dir
