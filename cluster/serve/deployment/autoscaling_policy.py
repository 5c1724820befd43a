"""Replica autoscaling on what the engines report (``autoscaling_config.scale_on:
engine_signals``; docs/architecture.md §14): Ray Serve's custom autoscaling policy API.

Each LLMServer replica reports, every ``look_back_period_s / 5``, its engine's waiting
and running requests and KV usage (``LLMServer.record_autoscaling_stats``); Serve averages
them per replica over ``look_back_period_s`` and calls the policy on its control loop. The
policy asks for::

    base = max(ongoing / target_ongoing_requests,       Serve's own signal
               sum(kv_cache_usage) / target_kv_cache_usage)  KV in use, in replicas
    waiting per replica w > target_num_requests_waiting:  max(base, n * w / target)
    0 < w <= target:                                      max(base, n)   (hold)
    w = 0:                                                base

Waiting requests mean the engines are full (batch or KV): add replicas in proportion. While
any wait the count never shrinks: waiting is what a scale-down would bring back. With none
waiting the count follows the running load and the KV it holds. Serve then applies the
deployment's bounds, delays and scaling factors, as for its default policy.
"""

from __future__ import annotations

from typing import Any

# The names LLMServer.record_autoscaling_stats reports (per replica).
WAITING = "raylm_num_requests_waiting"
RUNNING = "raylm_num_requests_running"
KV_USAGE = "raylm_kv_cache_usage_perc"


def autoscaling_stats(stats: dict[str, Any]) -> dict[str, float]:
    """A replica's report, from its engine's ``get_stats()``."""
    return {WAITING: float(stats.get("num_requests_waiting", 0)),
            RUNNING: float(stats.get("num_requests_running", 0)),
            KV_USAGE: float(stats.get("kv_cache_usage_perc", 0.0))}


class EngineSignalPolicy:
    """Serve instantiates it once per deployment (``policy_kwargs``) and calls it with an
    ``AutoscalingContext`` every control-loop tick."""

    def __init__(self, target_num_requests_waiting: float = 4.0,
                 target_kv_cache_usage: float = 0.9) -> None:
        if target_num_requests_waiting <= 0:
            raise ValueError("target_num_requests_waiting must be positive, got "
                             f"{target_num_requests_waiting!r}.")
        if not 0 < target_kv_cache_usage <= 1:
            raise ValueError("target_kv_cache_usage must be in (0, 1], got "
                             f"{target_kv_cache_usage!r}.")
        self.target_num_requests_waiting = target_num_requests_waiting
        self.target_kv_cache_usage = target_kv_cache_usage

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        n = ctx.current_num_replicas
        if n == 0:
            return ctx.target_num_replicas, {}
        metrics = ctx.aggregated_metrics or {}
        waiting = sum(metrics.get(WAITING, {}).values())
        kv = sum(metrics.get(KV_USAGE, {}).values())
        base = max(ctx.total_num_requests / ctx.config.get_target_ongoing_requests(),
                   kv / self.target_kv_cache_usage)
        per_replica = waiting / n
        if per_replica > self.target_num_requests_waiting:
            desired = max(base, n * per_replica / self.target_num_requests_waiting)
        elif waiting > 0:
            desired = max(base, float(n))
        else:
            desired = base
        state = {"waiting": waiting, "kv_cache_usage": kv, "desired": desired}
        return desired, state
