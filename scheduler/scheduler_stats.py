"""Scheduler counters, exported with vLLM's Prometheus names under the ``raylm:`` prefix.

Counters are cumulative and never reset (Prometheus computes rates); ``SchedulerStats``
carries per-update deltas and the gauges.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompts of requests that produced their first token
    generation_tokens: int = 0  # output tokens delivered
    num_requests_finished: int = 0
    num_steps: int = 0  # scheduled steps, empty ones included


def metrics_dict(counters: SchedulerCounters, *, prefix_cache_queries: int,
                 prefix_cache_hits: int, num_running: int, num_waiting: int,
                 kv_cache_usage: float) -> dict[str, float]:
    """Prefix-cache counters (in tokens) come from the KVCacheManager, which owns them."""
    return {
        "raylm:num_preemptions": counters.num_preemptions,
        "raylm:prompt_tokens": counters.prompt_tokens,
        "raylm:generation_tokens": counters.generation_tokens,
        "raylm:prefix_cache_queries": prefix_cache_queries,
        "raylm:prefix_cache_hits": prefix_cache_hits,
        "raylm:request_success": counters.num_requests_finished,
        "raylm:num_scheduler_steps": counters.num_steps,
        "raylm:num_requests_running": num_running,
        "raylm:num_requests_waiting": num_waiting,
        "raylm:kv_cache_usage_perc": kv_cache_usage,
    }


DEVICE_INFO = "raylm:device_info"
_DEVICE_LABELS = ('{device_kind="', '",device_name="', '"}')


def device_info_key(info: dict) -> str:
    """The metrics key saying what the ranks run on (its value: how many ranks)."""
    kind = str(info.get("kind", "unknown")).replace('"', "'")
    name = str(info.get("name", "unknown")).replace('"', "'")
    return f"{DEVICE_INFO}{_DEVICE_LABELS[0]}{kind}{_DEVICE_LABELS[1]}{name}{_DEVICE_LABELS[2]}"


def parse_device_info(metrics: dict) -> list[tuple[str, str, float]]:
    """(device kind, device name, ranks) for each device_info key of ``metrics``."""
    out = []
    for key, value in metrics.items():
        if key.startswith(DEVICE_INFO + _DEVICE_LABELS[0]) and key.endswith(_DEVICE_LABELS[2]):
            body = key[len(DEVICE_INFO + _DEVICE_LABELS[0]):-len(_DEVICE_LABELS[2])]
            kind, _, name = body.partition(_DEVICE_LABELS[1])
            out.append((kind, name, float(value)))
    return out
