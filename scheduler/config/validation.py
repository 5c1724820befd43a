"""The argument checks every layer repeats, worded once: a ``ValueError`` that names the
argument and prints the value it got."""

from __future__ import annotations


def check_at_least(name: str, value: float | None, minimum: float = 1) -> None:
    """``value >= minimum``; None passes (an optional argument left unset)."""
    if value is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}.")


def check_rank(name: str, rank: int, size: int) -> None:
    """``0 <= rank < size`` (``name``: the rank's name, e.g. ``dp_rank``)."""
    if not 0 <= rank < size:
        raise ValueError(f"{name} must be in [0, {size}), got {rank!r}.")
