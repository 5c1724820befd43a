"""The argument checks every layer repeats, worded once: a ``ValueError`` that names the
argument and prints the value it got."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def check_at_least(name: str, value: float | None, minimum: float = 1) -> None:
    """``value >= minimum``; None passes (an optional argument left unset)."""
    if value is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}.")


def check_rank(name: str, rank: int, size: int) -> None:
    """``0 <= rank < size`` (``name``: the rank's name, e.g. ``dp_rank``)."""
    if not 0 <= rank < size:
        raise ValueError(f"{name} must be in [0, {size}), got {rank!r}.")


def check_config_dict(name: str, config: Any, cls: type, required: tuple[str, ...]) -> None:
    """A vLLM-style config dict for dataclass ``cls``: a dict, no unknown key (each is
    named), the ``required`` keys present."""
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a dict, got {config!r}.")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; known: {sorted(known)}.")
    for key in required:
        if key not in config:
            raise ValueError(f"{name}.{key} is required.")
