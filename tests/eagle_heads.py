"""EAGLE heads for the tests: random ones (runner/loading/eagle_checkpoint.py), one built
from a target's own layers that agrees with it, and a plain-torch reference of a head's
drafts, recomputed from a whole history with transformers' hidden states (no cache), to
check what the engine's head proposes."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from raylm.runner.loading.eagle_checkpoint import write_eagle_head

__all__ = ["ReferenceHead", "record_drafts", "with_unit_final_norm", "write_eagle_head",
           "write_target_copy_head"]

class ReferenceHead:
    """The head's drafts after a history, from transformers' target (hidden states of the
    whole history at once) and the head's weights applied in plain torch."""

    def __init__(self, head_path: str, target_model, method: str) -> None:
        from safetensors.torch import load_file

        self.w = load_file(os.path.join(head_path, "model.safetensors"))
        self.method = method
        with open(os.path.join(head_path, "config.json")) as f:
            eagle_config = json.load(f).get("eagle_config") or {}
        self.aux_layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        self.target = target_model
        cfg = target_model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(cfg)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _layer(self, x_attn: torch.Tensor, residual: torch.Tensor, prefix: str) -> torch.Tensor:
        w, T = self.w, x_attn.shape[0]
        q = (x_attn @ w[prefix + "self_attn.q_proj.weight"].T).view(T, self.heads, -1)
        k = (x_attn @ w[prefix + "self_attn.k_proj.weight"].T).view(T, self.kv_heads, -1)
        v = (x_attn @ w[prefix + "self_attn.v_proj.weight"].T).view(T, self.kv_heads, -1)
        cos, sin = self.rotary(v.transpose(0, 1)[None], torch.arange(T)[None])
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.transpose(0, 1)[None].repeat_interleave(rep, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = attn[0].transpose(0, 1).reshape(T, -1) @ w[prefix + "self_attn.o_proj.weight"].T
        h = residual + attn
        m = self._norm(h, w[prefix + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(m @ w[prefix + "mlp.gate_proj.weight"].T)
             * (m @ w[prefix + "mlp.up_proj.weight"].T)) @ w[prefix + "mlp.down_proj.weight"].T
        return h + m

    def _head(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head over pairs (tokens[i], features[i]) at positions 0..T-1: its outputs."""
        w = self.w
        embeds = self.target.model.embed_tokens(tokens)
        if self.method == "eagle":
            x = torch.cat((embeds, features), -1) @ w["fc.weight"].T + w["fc.bias"]
            return self._layer(x, x, "layers.0.")
        x = torch.cat((self._norm(embeds, w["midlayer.input_layernorm.weight"]),
                       self._norm(features, w["midlayer.hidden_norm.weight"])), -1)
        return self._layer(x, features, "midlayer.")

    def _next(self, out: torch.Tensor) -> int:
        if self.method == "eagle":
            return int(self.target.lm_head(out).argmax())
        w = self.w
        draft = int((self._norm(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        return draft + int(w["d2t"][draft])

    @torch.inference_mode()
    def drafts(self, history: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after ``history`` (prompt + output so far)."""
        out = self.target.model(torch.tensor([history]), output_hidden_states=True)
        if self.method == "eagle":
            feats = out.last_hidden_state[0]
        else:
            hs = out.hidden_states  # hs[i]: the input of layer i
            feats = torch.cat([hs[i][0] for i in self.aux_layers], -1) @ self.w["fc.weight"].T
        tokens = list(history[1:])
        features = feats[:len(history) - 1]
        drafts = []
        for _ in range(k):
            outs = self._head(torch.tensor(tokens), features)
            drafts.append(self._next(outs[-1]))
            tokens.append(drafts[-1])
            features = torch.cat((features, outs[-1:]), 0)
        return drafts


def write_target_copy_head(path: str, target_path: str) -> str:
    """An EAGLE-1 head that is the target's own layers with attention cut (o_proj zero) and
    ``fc`` passing the embedding through: on a target whose attention barely matters (the
    loopy checkpoint) it predicts the target's next token most of the time, so drafts get
    accepted. Its output skips the target's final norm, so the target's must have unit
    weights (``with_unit_final_norm``): then the norm only scales a row, never its argmax."""
    from safetensors.torch import load_file

    with open(os.path.join(target_path, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(target_path, "model.safetensors"))
    hidden = config["hidden_size"]
    tensors = {}
    for name, tensor in weights.items():
        if not name.startswith("model.layers."):
            continue
        short = name.removeprefix("model.")
        if short == "layers.0.input_layernorm.weight":
            continue  # EAGLE-1's first layer has no input norm
        tensors[short] = (torch.zeros_like(tensor) if short.endswith("o_proj.weight")
                          else tensor.clone())
    tensors["fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    assert torch.equal(weights["model.norm.weight"], torch.ones(hidden)), (
        "the target's final norm must have unit weights (with_unit_final_norm)")
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def with_unit_final_norm(src: str, dst: str) -> str:
    """A copy of the checkpoint at ``src`` whose final norm weights are all one."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    weights = load_file(file)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, file, metadata={"format": "pt"})
    return dst


def record_drafts(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every proposal the head makes: (the history it followed, its drafts)."""
    seen: list[tuple[list[int], list[int]]] = []
    from raylm.runner.spec_decode import eagle_proposer

    step = eagle_proposer.EagleProposer.step

    def recording(self, batch, hidden, sampling, wanted):
        drafts = step(self, batch, hidden, sampling, wanted)
        host = drafts.cpu().tolist()
        for i, r in enumerate(wanted):
            seen.append((self.input_batch.token_ids[r.row, :r.num_tokens].tolist(),
                         host[i][:r.max_drafts]))
        return drafts

    monkeypatch.setattr(eagle_proposer.EagleProposer, "step", recording)
    return seen
