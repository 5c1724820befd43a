"""Multi-head latent attention's shape (DeepSeek-V3), read from config.json as transformers'
DeepseekV3Config reads it.

Each token's keys and values come from one compressed latent of ``kv_lora_rank`` channels
plus one rotated key of ``qk_rope_head_dim`` channels shared by every head; those two are
all the KV cache holds per token and layer (docs/architecture.md §22). The query comes
straight from the hidden state (``q_lora_rank`` null) or through its own low-rank pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raylm.scheduler.config.rope_params import rope_parameters


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotated channels as pairs (x0, x1), (x2, x3), ...
    scale: float  # the softmax scale, YaRN's mscale_all_dim folded in as transformers does

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Channels the KV cache holds per token and layer: the latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAShape:
        q_rank = hf.get("q_lora_rank")
        dims = {name: int(hf[name]) for name in ("kv_lora_rank", "qk_nope_head_dim",
                                                  "qk_rope_head_dim", "v_head_dim")}
        for name, value in dims.items():
            if value < 1 and name != "qk_nope_head_dim":
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if dims["qk_rope_head_dim"] % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {dims['qk_rope_head_dim']}.")
        scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
        params = rope_parameters(hf)
        mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
        factor = float(params.get("factor") or 1.0)
        if params["rope_type"] != "default" and mscale_all_dim and factor > 1.0:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return cls(q_lora_rank=None if q_rank is None else int(q_rank),
                   rope_interleave=bool(hf.get("rope_interleave", True)), scale=scale, **dims)
