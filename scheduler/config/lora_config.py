"""LoRA serving limits (vLLM's names): device slots, their rank, the host cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters one step may use (each rank's device slots);
    ``max_lora_rank``: the largest rank a slot holds (adapters of lower rank are padded
    with zeros); ``max_cpu_loras``: adapters each rank keeps loaded in host memory (an
    LRU; default ``max_loras``), so a swapped-out adapter comes back without a read."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int of at least 1, got {value!r}.")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int of at least max_loras="
                             f"{self.max_loras}, got {cpu!r}.")

    @property
    def cpu_loras(self) -> int:
        assert self.max_cpu_loras is not None, "resolved in __post_init__"
        return self.max_cpu_loras
