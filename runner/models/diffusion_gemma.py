"""DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``, text only): block
diffusion over raylm's paged KV cache (docs/architecture.md §23).

Two passes share every layer's weights and KV cache tensors:

- ``encode(input_ids [T], positions [T], meta)``: committed tokens (the prompt, then each
  committed canvas) run causally and write their KV into their slots, as any prefill or
  chunk does; nothing is sampled from it.
- ``denoise(canvas_ids [T], positions [T], meta, ...)``: each request's canvas of
  ``canvas_length`` tokens at the positions after its committed tokens. ``meta`` comes
  from attention/bidirectional.py: every canvas token sees the request's cached prefix and
  the whole canvas. The canvas's KV is written into its own slots (the slots its tokens
  will hold once committed, which the encoder then overwrites), so the kernels read one
  cache. The previous step's logits condition the canvas embeddings (self-conditioning).
  Returns float32 logits for every canvas position.

Rows of many requests, with any prefix lengths, run in one call of either pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from raylm.parallel.context import ParallelContext
from raylm.parallel.layers import Weight, replicated_weight_loader
from raylm.runner.attention.paged_attention import Attention, AttentionMetadata
from raylm.runner.models.diffusion_gemma_config import DiffusionGemmaConfig
from raylm.runner.models.diffusion_gemma_layers import (
    DiffusionLayer,
    DiffusionRMSNorm,
    Linear,
    SelfConditioning,
)

_DECODER = "model.decoder."
_ENCODER = "model.encoder.language_model."
# The vision tower and its projection: raylm serves the text model only.
_NOT_LOADED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


class RopeTables(nn.Module):
    """cos and sin per layer type (the sliding layers' default RoPE, the global layers'
    proportional one), computed as transformers does: float32 angles, scaled, then cast."""

    def __init__(self, cfg: DiffusionGemmaConfig, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        self.types = sorted({layer.layer_type for layer in cfg.layers})
        for layer_type in self.types:
            inv_freq, scaling = cfg.rope_inv_freq(layer_type)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            for name, table in (("cos", emb.cos()), ("sin", emb.sin())):
                self.register_buffer(f"{layer_type}_{name}",
                                     (table * scaling).to(dtype=dtype, device=device),
                                     persistent=False)

    def lookup(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type: cos and sin [T, 1, D], looked up once per forward."""
        return {t: tuple(getattr(self, f"{t}_{n}").index_select(0, positions).unsqueeze(1)
                         for n in ("cos", "sin"))  # type: ignore[misc]
                for t in self.types}


class DiffusionGemmaForBlockDiffusion(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, ctx: ParallelContext, dtype: torch.dtype,
                 max_position: int | None = None) -> None:
        super().__init__()
        if ctx.tp_size != 1 or ctx.pp_size != 1:
            raise ValueError(f"{cfg.architecture} runs on one rank (tp_size=1, pp_size=1), "
                             f"got tp_size={ctx.tp_size}, pp_size={ctx.pp_size}.")
        self.config = cfg
        self.ctx = ctx
        device = ctx.device
        hidden = cfg.hidden_size
        # [vocab, hidden], as a linear's weight: the LM head reads it when tied.
        self.embed_tokens = Linear(hidden, cfg.vocab_size, dtype, device)
        # transformers keeps the scale as a float32 buffer and casts it to the weights'
        # dtype at each use (sqrt(3072) becomes 55.5 in bfloat16, as there).
        self.embed_scale = float(torch.tensor(hidden ** 0.5).to(dtype))
        self.layers = nn.ModuleList(DiffusionLayer(cfg, i, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = DiffusionRMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
        self.self_conditioning = SelfConditioning(cfg, dtype, device)
        self.lm_head: Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(hidden, cfg.vocab_size, dtype, device)
        self.rope = RopeTables(cfg, max_position or cfg.max_position_embeddings, dtype,
                               device)

    def _layers(self) -> list[DiffusionLayer]:
        return [cast(DiffusionLayer, layer) for layer in self.layers]

    @property
    def attention_layers(self) -> list[Attention]:
        """One per layer, in layer order (the KV cache binds to them; both passes use
        them). The global layers' head size and KV heads differ from the sliding ones'."""
        return [layer.self_attn.attn for layer in self._layers()]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens.weight) * self.embed_scale

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    encoder: bool) -> torch.Tensor:
        cos_sin = self.rope.lookup(positions)
        for layer in self._layers():
            x = layer(cos_sin[layer.layer_type], x, meta, encoder)
        return x

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """Write the KV of committed tokens (causal ``meta``); their outputs are unused."""
        if not meta.causal:
            raise ValueError("the encoder pass takes causal attention metadata.")
        self._run_layers(self._embed(input_ids), positions, meta, encoder=True)

    def denoise(self, canvas_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata,
                self_conditioning_logits: torch.Tensor | None = None,
                self_conditioning_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [T, vocab] of the canvas tokens. ``self_conditioning_logits``
        [T, vocab]: the previous step's (temperature-scaled) logits; a token whose
        ``self_conditioning_mask`` [T] is False (a canvas's first step) gets none, as
        transformers' first step does."""
        if meta.causal:
            raise ValueError("the decoder pass takes bidirectional metadata "
                             "(attention/bidirectional.py).")
        embeds = self._embed(canvas_ids)
        weight = self.embed_tokens.weight
        if self_conditioning_logits is None:
            soft = torch.zeros_like(embeds)
        else:
            probs = self_conditioning_logits.softmax(dim=-1, dtype=torch.float32)
            soft = torch.matmul(probs.to(weight.dtype), weight) * self.embed_scale
            if self_conditioning_mask is not None:
                soft = soft * self_conditioning_mask.to(soft.dtype)[:, None]
        x = self.self_conditioning.condition(embeds, soft)
        x = self._run_layers(x, positions, meta, encoder=False)
        return self.compute_logits(self.norm(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _param_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills, or None when none reads it. The
        encoder's text weights are the decoder's (tied); its layer scalars are its own."""
        if name.startswith(_NOT_LOADED) or "rotary_emb" in name:
            return None
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else name
        if name.startswith(_DECODER):
            return name.removeprefix(_DECODER)
        if name.startswith(_ENCODER):
            rest = name.removeprefix(_ENCODER)
            if rest.endswith(".layer_scalar"):
                return rest.replace(".layer_scalar", ".encoder_layer_scalar")
            return rest
        return name

    def needs_weight(self, name: str) -> bool:
        return self._param_name(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """HF-named tensors (real or lazy); ValueError on an unknown name or a parameter
        the checkpoint left unset."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._param_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                                 f"{self.config.architecture}.")
            replicated_weight_loader(params[target], tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"parameters missing from the checkpoint: {missing}.")
