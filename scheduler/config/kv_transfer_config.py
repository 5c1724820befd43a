"""KVTransferConfig: vLLM's ``kv_transfer_config`` dict, validated and frozen.

Connectors (``kv_connector``):
- ``"OffloadingConnector"``: blocks evicted from the device pool are kept in a host pool
  (LRU, ``kv_connector_extra_config["num_cpu_blocks"]`` blocks) and loaded back on a
  prefix hit instead of being recomputed.
- ``"RayKVConnector"``: prefill/decode disaggregation over Ray; a ``kv_producer`` engine
  keeps a finished prompt's blocks until a ``kv_consumer`` engine has pulled them,
  through Ray's object store or Ray Direct Transport
  (``kv_connector_extra_config["transport"]``, the consumer's choice).
``kv_connector_extra_config["fault_injection"]`` wraps either in a fault injector (tests,
drills): loads fail for a random share of blocks, or all, or complete late.
Pure Python (read by the scheduler and the runner alike).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from raylm.scheduler.config.validation import check_config_dict

KV_CONNECTORS = ("OffloadingConnector", "RayKVConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_FAULT_KEYS = {"fail_prob", "fail_all", "delay_steps", "seed"}
_OFFLOAD_KEYS = {"num_cpu_blocks", "load_async"}
_PD_KEYS = {"abort_timeout_s", "fetch_timeout_s", "transport"}
OBJECT_STORE, RDT = "object_store", "rdt"
PD_TRANSPORTS = (OBJECT_STORE, RDT)
# The object store by default: on one node it was faster than RDT's Gloo pair at every
# measured size (bench/kv_transport.py; figures in docs/performance.md, KV transport). RDT
# is there for CUDA KV, which NCCL keeps on the devices.
DEFAULT_PD_TRANSPORT = OBJECT_STORE


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"kv_transfer_config.{name} {why}, got {value!r}.")


@dataclass(frozen=True)
class FaultInjection:
    """Which loads the injector spoils: each loaded block fails with ``fail_prob`` (all
    with ``fail_all``); an asynchronous load completes ``delay_steps`` steps late."""

    fail_prob: float = 0.0
    fail_all: bool = False
    delay_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_prob <= 1.0:
            raise _bad("kv_connector_extra_config.fault_injection.fail_prob", self.fail_prob,
                       "must be in [0, 1]")
        if isinstance(self.delay_steps, bool) or not isinstance(self.delay_steps, int) \
                or self.delay_steps < 0:
            raise _bad("kv_connector_extra_config.fault_injection.delay_steps",
                       self.delay_steps, "must be a non-negative integer")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    # Names this engine to its peers (a decode engine pulls from the prefill engine with
    # this id); None: a fresh one per engine, so Serve replicas of one config differ.
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise _bad("kv_connector", self.kv_connector, f"must be one of {list(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise _bad("kv_role", self.kv_role, f"must be one of {list(KV_ROLES)}")
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", uuid.uuid4().hex[:12])
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise _bad("kv_connector_extra_config", extra, "must be a dict")
        known = {"fault_injection"} | (_OFFLOAD_KEYS if self.is_offloading else _PD_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise _bad("kv_connector_extra_config", unknown,
                       f"has unknown key(s) for {self.kv_connector}; known: {sorted(known)}")
        if self.is_offloading:
            n = extra.get("num_cpu_blocks")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise _bad("kv_connector_extra_config.num_cpu_blocks", n,
                           "must be an integer of at least 1 (or set kv_offloading_size)")
        for key in ("abort_timeout_s", "fetch_timeout_s"):
            value = extra.get(key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise _bad(f"kv_connector_extra_config.{key}", value, "must be positive")
        transport = extra.get("transport")
        if transport is not None and transport not in PD_TRANSPORTS:
            raise _bad("kv_connector_extra_config.transport", transport,
                       f"must be one of {list(PD_TRANSPORTS)}")
        self.fault_injection  # noqa: B018 - validates the sub-dict

    @classmethod
    def from_dict(cls, config: dict[str, Any] | KVTransferConfig | None
                  ) -> KVTransferConfig | None:
        """vLLM's dict -> config; unknown keys are refused by name."""
        if config is None or isinstance(config, KVTransferConfig):
            return config
        check_config_dict("kv_transfer_config", config, cls, ("kv_connector",))
        return cls(**config)

    @property
    def is_offloading(self) -> bool:
        return self.kv_connector == "OffloadingConnector"

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.kv_connector_extra_config.get("num_cpu_blocks", 0))

    @property
    def pd_transport(self) -> str:
        """How a consumer pulls the KV (RayKVConnector)."""
        return str(self.kv_connector_extra_config.get("transport", DEFAULT_PD_TRANSPORT))

    @property
    def fault_injection(self) -> FaultInjection | None:
        spec = self.kv_connector_extra_config.get("fault_injection")
        if spec is None:
            return None
        if not isinstance(spec, dict) or set(spec) - _FAULT_KEYS:
            raise _bad("kv_connector_extra_config.fault_injection", spec,
                       f"must be a dict with keys among {sorted(_FAULT_KEYS)}")
        return FaultInjection(**spec)

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
