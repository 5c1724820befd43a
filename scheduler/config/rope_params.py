"""A config's RoPE parameters as one dict, whichever way the checkpoint spells them (read
by the runner's rotary embedding and by config parsing that must not import torch)."""

from __future__ import annotations

from typing import Any


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers >= 5) or the older ``rope_scaling``/``rope_theta``."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(hf_config.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params
