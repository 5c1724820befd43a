"""The engine's statistics as ``get_stats()`` gives them to the server: counters and gauges
parsed from the EngineCore's ``get_metrics()`` names (the Prometheus exposition of them is
the server's, cluster/serve/deployment/metrics.py)."""

from __future__ import annotations

import re
from typing import Any

from raylm.scheduler.expert_load_stats import expert_load_series
from raylm.scheduler.scheduler_stats import parse_device_info

# Speculative decoding (only when the engine reports them: speculation is configured).
SPEC_COUNTERS = {
    "spec_decode_num_drafts_total": ("raylm:spec_decode_num_drafts",
                                     "Steps of a request that verified drafts."),
    "spec_decode_num_draft_tokens_total": ("raylm:spec_decode_num_draft_tokens",
                                           "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens_total": ("raylm:spec_decode_num_accepted_tokens",
                                              "Draft tokens accepted."),
}
SPEC_PER_POS = ("raylm:spec_decode_num_accepted_tokens_per_pos",
                 "Draft tokens accepted, per draft position.")


# KV connectors (only with one configured): the engine's own names, gauges among them.
KV_PREFIXES = ("raylm:external_prefix_cache_", "raylm:kv_offload_", "raylm:kv_transfer_",
                "raylm:kv_connector_", "raylm:num_requests_waiting_for_remote_kvs")
KV_GAUGES = ("raylm:kv_offload_cpu_cache_usage_perc", "raylm:num_requests_waiting_for_remote_kvs")


def kv_connector_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    """get_metrics() -> the get_stats() key ``kv_connector``: every KV-connector series
    by its full name (labels included); none without a connector."""
    kv = {k: v for k, v in metrics.items() if k.startswith(KV_PREFIXES)}
    return {"kv_connector": kv} if kv else {}


LORA_INFO = "raylm:lora_requests_info"


def lora_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    """get_metrics() -> the get_stats() key ``lora_requests_info``: (labels, value) of
    each reading (scheduler/lora.py; its label values hold commas, so parsed by quotes);
    none without LoRA."""
    out = [(dict(re.findall(r'(\w+)="([^"]*)"', key)), float(value))
           for key, value in metrics.items() if key.startswith(LORA_INFO + "{")]
    return {"lora_requests_info": out} if out else {}


def moe_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    """get_metrics() -> the get_stats() key ``moe_experts``: tokens per expert and each
    layer's imbalance by their full names (labels included); none for a dense model."""
    series = expert_load_series(metrics)
    return {"moe_experts": series} if series else {}


def labelled(key: str) -> tuple[str, dict[str, str]]:
    """'name{a="x"}' -> ('name', {'a': 'x'})."""
    name, _, rest = key.partition("{")
    labels = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair)
    return name, {k: v.strip('"') for k, v in labels.items()}


def spec_decode_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    """get_metrics() -> the get_stats() keys of speculative decoding (none when off)."""
    if "raylm:spec_decode_num_drafts" not in metrics:
        return {}
    stats: dict[str, Any] = {key: metrics[name] for key, (name, _) in SPEC_COUNTERS.items()}
    prefix = SPEC_PER_POS[0] + '{position="'
    per_pos = {int(k[len(prefix):-2]): v for k, v in metrics.items() if k.startswith(prefix)}
    stats["spec_decode_num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return stats


def engine_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    """get_metrics() -> get_stats(): the serving gauges and counters, and the speculation,
    KV-connector and LoRA keys where the engine reports them."""
    m = metrics
    return {
        "num_requests_running": m.get("raylm:num_requests_running", 0),
        "num_requests_waiting": m.get("raylm:num_requests_waiting", 0),
        "kv_cache_usage_perc": m.get("raylm:kv_cache_usage_perc", 0.0),
        "num_preemptions_total": m.get("raylm:num_preemptions", 0),
        "prompt_tokens_total": m.get("raylm:prompt_tokens", 0),
        "generation_tokens_total": m.get("raylm:generation_tokens", 0),
        "prefix_cache_queries_total": m.get("raylm:prefix_cache_queries", 0),
        "prefix_cache_hits_total": m.get("raylm:prefix_cache_hits", 0),
        "devices": parse_device_info(m),
        **spec_decode_stats(m),
        **kv_connector_stats(m),
        **lora_stats(m),
        **moe_stats(m),
    }
