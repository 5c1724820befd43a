"""Write a small Hugging Face Llama or Gemma 3 checkpoint as a GGUF file, laid out as
llama.cpp's converter lays it out (Llama's q/k rows permuted, Gemma's norm weights plus one,
names ``blk.N.*``, a byte-level BPE tokenizer and the chat template in the metadata). Tests
build GGUF files with it on the fly."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from raylm.runner.loading.gguf_checkpoint import _GEMMA3_LAYER_NAMES, _GLOBAL_NAMES, _LAYER_NAMES

if TYPE_CHECKING:
    import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of gguf_checkpoint._unpermute)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf_from_hf(hf_dir: str, out_path: str, qtype: str = "Q8_0") -> str:
    """Write ``hf_dir``'s Llama or Gemma 3 weights to ``out_path``: 2-D weights quantized to
    ``qtype`` (norms stay F32), tokenizer and chat template from the folder's tokenizer
    files."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    gemma3 = cfg["architectures"] == ["Gemma3ForCausalLM"]
    if cfg["architectures"] != ["LlamaForCausalLM"] and not gemma3:
        raise ValueError("only LlamaForCausalLM and Gemma3ForCausalLM are written as GGUF, "
                         f"got {cfg['architectures']}.")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, "gemma3" if gemma3 else "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if gemma3:  # the global layers' base; the sliding ones' is llama.cpp's fixed 10000
        w.add_rope_freq_base(float(cfg["rope_parameters"]["full_attention"]["rope_theta"]))
        w.add_sliding_window(int(cfg["sliding_window"]))
        w.add_key_length(int(cfg["head_dim"]))
        w.add_value_length(int(cfg["head_dim"]))
    else:
        w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, AutoTokenizer.from_pretrained(hf_dir), hf_dir)

    quant = gguf.GGMLQuantizationType[qtype]
    inverse = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_inverse = {v: k for k, v in (_GEMMA3_LAYER_NAMES if gemma3 else _LAYER_NAMES).items()}
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, t in sorted(tensors.items()):
        if name.startswith("model.layers."):
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{layer_inverse['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = inverse[name]
        t = t.astype(np.float32)
        if gemma3:
            if name.endswith("norm.weight"):
                t = t + 1.0
        elif name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif name.endswith("k_proj.weight"):
            t = _permute(t, kv_heads)
        if t.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _add_tokenizer(w: Any, tokenizer: Any, hf_dir: str) -> None:  # gguf.GGUFWriter, HF's
    import gguf

    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        model = json.load(f)["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([tok for tok, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
