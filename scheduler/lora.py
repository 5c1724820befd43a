"""LoRA adapters on the scheduler's side (docs/architecture.md, "LoRA adapters"): the adapter a request
names, the per-step limit on distinct adapters, and the ``lora_requests_info`` metric.

Pure Python like the rest of the scheduler: a ``LoRARequest`` is only a name, an id and a
path here; the workers load the weights (``raylm.runner.lora``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: ``lora_int_id`` (at least
    1) identifies the adapter everywhere (device slots, host cache, prefix-cache keys), so
    one id must always name the same weights; ``lora_path`` is a PEFT folder
    (``adapter_config.json`` and ``adapter_model.safetensors``) every worker can read."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int of at least 1, got "
                             f"{self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path, got "
                             f"{self.lora_path!r}.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_id(request: Any) -> int:
    """The request's adapter id, 0 for the base model."""
    lora = request.lora_request
    return 0 if lora is None else lora.lora_int_id


def active_adapters(requests: Iterable[Any]) -> set[int]:
    """The adapter ids among ``requests`` (base-model requests add none)."""
    return {i for i in map(lora_id, requests) if i}


# Steps a request may be passed over for want of a device slot before no other adapter's
# request passes it: requests of the adapters in use would otherwise keep them in use.
MAX_LORA_SKIPS = 16


class LoRAAdmission:
    """One step's admission of waiting requests under ``max_loras`` distinct adapters (the
    workers' device slots): a request whose adapter would not fit waits, in order, nothing
    dropped; base-model requests never wait for a slot. A request passed over more than
    MAX_LORA_SKIPS steps holds every later adapter request back until the adapters in use
    drain and its own gets a slot."""

    def __init__(self, running: Iterable[Any], max_loras: int) -> None:
        self.active = active_adapters(running)
        self.max_loras = max_loras
        self.holding = False

    def admits(self, request: Any) -> bool:
        i = lora_id(request)
        if i == 0:
            return True
        if not self.holding and (i in self.active or len(self.active) < self.max_loras):
            return True
        if not self.holding:
            request.num_lora_skips += 1
            self.holding = request.num_lora_skips > MAX_LORA_SKIPS
        return False

    def admitted(self, request: Any) -> None:
        if lora_id(request):
            self.active.add(lora_id(request))


def _names(requests: Iterable[Any]) -> str:
    return ",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))


def lora_requests_info(running: Iterable[Any], waiting: Iterable[Any],
                       max_loras: int) -> dict[str, float]:
    """vLLM's ``lora_requests_info`` gauge: the adapters of running and of waiting
    requests as labels (names, comma separated, sorted), its value the time of the
    reading (as vLLM's, so a dashboard takes the newest label set)."""
    labels = (f'running_lora_adapters="{_names(running)}",'
              f'waiting_lora_adapters="{_names(waiting)}",max_lora="{max_loras}"')
    return {f"raylm:lora_requests_info{{{labels}}}": time.time()}
