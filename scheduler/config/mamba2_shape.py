"""A Mamba2 mixer's shape, read from a hybrid checkpoint's config.json (Bamba's and Granite
4's ``mamba_*`` fields, as transformers reads them), and its split over tensor parallelism.

Tensor parallelism splits the heads and the groups: rank r holds heads and groups
``[r * n / tp, (r + 1) * n / tp)``, so a head's group stays on its rank and the gated
norm (one RMS per group) needs no collective. A checkpoint whose ``mamba_n_groups`` (or
heads) the TP size does not divide is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Mamba2Shape:
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    intermediate_size: int  # num_heads * head_dim
    chunk_size: int
    conv_bias: bool
    time_step_limit: tuple[float, float] | None
    norm_eps: float
    # The gated RMS norm: "gate_first" (Bamba, Granite: y * silu(z), then normalised),
    # "norm_first" (Falcon-H1's mamba_rms_norm: normalised, scaled, then gated), "none"
    # (Falcon-H1 without it: y * silu(z) alone)
    gated_norm: str = "gate_first"
    # Falcon-H1's muP: the input scaled, and each of z, x, B, C, dt after in_proj
    in_multiplier: float = 1.0
    zxbcdt_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Mamba2Shape:
        hidden = int(hf["hidden_size"])
        expand = int(hf.get("mamba_expand", 2))
        heads = int(hf.get("mamba_n_heads", 128))
        # Falcon-H1 may give the mixers' width itself (mamba_d_ssm)
        width = int(hf.get("mamba_d_ssm") or expand * hidden)
        head_dim = hf.get("mamba_d_head", "auto")
        head_dim = width // heads if head_dim == "auto" else int(head_dim)
        if heads * head_dim != width:
            raise ValueError(f"mamba_n_heads * mamba_d_head = {heads * head_dim} must equal "
                             f"the Mamba2 width (mamba_d_ssm, or mamba_expand * hidden_size) "
                             f"= {width}.")
        groups = int(hf.get("mamba_n_groups", 1))
        if groups < 1 or heads % groups:
            raise ValueError(f"mamba_n_groups {groups} must divide mamba_n_heads {heads}.")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for Mamba2 layers "
                             "(only 'silu').")
        if hf.get("mamba_proj_bias", False):
            raise ValueError("mamba_proj_bias=True is not supported (the Mamba2 in and out "
                             "projections without biases only).")
        limit = hf.get("time_step_limit", (0.0, float("inf")))
        falcon = "FalconH1ForCausalLM" in (hf.get("architectures") or [])
        norm = "gate_first"
        if falcon:
            norm = (("norm_first" if hf.get("mamba_norm_before_gate", True) else "gate_first")
                    if hf.get("mamba_rms_norm", False) else "none")
        multipliers = tuple(float(m) for m in (hf.get("ssm_multipliers") or [1.0] * 5))
        if len(multipliers) != 5:
            raise ValueError(f"ssm_multipliers must have 5 entries (z, x, B, C, dt), got "
                             f"{list(multipliers)}.")
        return cls(num_heads=heads, head_dim=head_dim, n_groups=groups,
                   d_state=int(hf.get("mamba_d_state", 256)),
                   d_conv=int(hf.get("mamba_d_conv", 4)),
                   intermediate_size=heads * head_dim,
                   chunk_size=int(hf.get("mamba_chunk_size", 256)),
                   conv_bias=bool(hf.get("mamba_conv_bias", True)),
                   time_step_limit=None if limit is None else (_number(limit[0]),
                                                               _number(limit[1])),
                   norm_eps=float(hf.get("rms_norm_eps", 1e-6)), gated_norm=norm,
                   in_multiplier=float(hf.get("ssm_in_multiplier") or 1.0),
                   zxbcdt_multipliers=multipliers)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    def check_tp(self, tp_size: int) -> None:
        for name, n in (("mamba_n_heads", self.num_heads), ("mamba_n_groups", self.n_groups)):
            if n % tp_size:
                raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size="
                                 f"{tp_size}: each rank holds whole Mamba2 heads and groups.")

    def per_rank(self, tp_size: int) -> Mamba2Shape:
        """This shape on one rank of ``tp_size``."""
        self.check_tp(tp_size)
        heads = self.num_heads // tp_size
        return replace(self, num_heads=heads, n_groups=self.n_groups // tp_size,
                       intermediate_size=heads * self.head_dim)


def _number(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as
    ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)
