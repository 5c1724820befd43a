"""What a process's request routers know, for its ``/metrics``: the routers' decisions and
each replica's engine stats as the replicas last reported them (``record_routing_stats``,
every ``request_router.stats_period_s``).

Serve builds a deployment's router inside whichever process holds a handle to it (the
ingress replica) and gives the app no reference to it, so each router publishes to the
view of its deployment here, and the ingress's ``/metrics`` reads the same view. One view
per (app, deployment) in the process; a lock, because the router runs on Serve's router
event loop and scrapes on the replica's.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from raylm.cluster.serve.deployment.metrics import (
    ENGINE_SERIES,
    MetricFamily,
    engine_families,
    engine_stats_of,
)

_DECISION_HELP = ("Model requests the router sent to a replica, by what decided: "
                  "prefix_match, least_loaded (loads too uneven), adapter_match (a replica "
                  "holding the LoRA adapter), most_free_kv (no match), no_prompt, pow2.")


class RouterView:
    """One deployment's router, seen from its process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, dict[str, Any]] = {}
        self._decisions: dict[str, int] = {}
        self._prompt_tokens = 0
        self._matched_tokens = 0

    def set_replicas(self, stats: dict[str, dict[str, Any]]) -> None:
        """The replicas now routable (replica id -> its last routing stats, possibly {})."""
        with self._lock:
            self._replicas = {rid: dict(s) for rid, s in stats.items()}

    def drop_replica(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)

    def count(self, decision: str, prompt_tokens: int = 0, matched_tokens: int = 0) -> None:
        """A request routed: what decided, its prompt's full-block tokens and how many of
        them the router expected the chosen replica to hold."""
        with self._lock:
            self._decisions[decision] = self._decisions.get(decision, 0) + 1
            self._prompt_tokens += prompt_tokens
            self._matched_tokens += matched_tokens

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {rid: dict(s) for rid, s in self._replicas.items()}

    def decisions(self) -> dict[str, int]:
        with self._lock:
            return dict(self._decisions)

    def families(self, model_name: str, fresh: tuple[str, dict[str, Any]] | None = None
                 ) -> list[Metric]:
        """The router's own series, and every reporting replica's engine series labelled
        ``replica`` (the same names as one replica's; see ``engine_families``). ``fresh``:
        (replica id, its stats now) of the replica that answered this scrape, which
        replaces what that replica last reported."""
        with self._lock:
            replicas = {rid: dict(s) for rid, s in self._replicas.items()}
            decisions = dict(self._decisions)
            prompt, matched = self._prompt_tokens, self._matched_tokens
        labels = ["model_name"]
        out: list[Metric] = []
        family: MetricFamily = GaugeMetricFamily("raylm:router_num_replicas",
                                                 "Replicas the router can send requests to.",
                                                 labels=labels)
        family.add_metric([model_name], float(len(replicas)))
        out.append(family)
        family = CounterMetricFamily("raylm:router_requests", _DECISION_HELP,
                                     labels=labels + ["decision"])
        for decision, n in sorted(decisions.items()):
            family.add_metric([model_name, decision], float(n))
        out.append(family)
        for name, value, doc in (
                ("raylm:router_prompt_tokens", prompt,
                 "Prompt tokens (in full KV blocks) of the requests the router sent."),
                ("raylm:router_matched_tokens", matched,
                 "Of those, the tokens the router expected the chosen replica to hold cached.")):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([model_name], float(value))
            out.append(family)
        reporting: dict[str | None, dict[str, Any]] = {
            rid: s for rid, s in replicas.items() if s}
        if reporting and fresh is not None:
            reporting[fresh[0]] = fresh[1]
        if reporting:
            out.extend(engine_families(model_name, reporting))
        return out


_VIEWS: dict[tuple[str, str], RouterView] = {}
_VIEWS_LOCK = threading.Lock()


def router_view(app_name: str, deployment_name: str) -> RouterView:
    """This process's view of the deployment's router (created empty on first use)."""
    with _VIEWS_LOCK:
        return _VIEWS.setdefault((app_name, deployment_name), RouterView())


def find_router_view(app_name: str, deployment_name: str) -> RouterView | None:
    with _VIEWS_LOCK:
        return _VIEWS.get((app_name, deployment_name))


def with_router_view(families: list[Metric], view: RouterView, model_name: str,
                     replica_id: str | None) -> list[Metric]:
    """A replica's /metrics snapshot (``replica_id`` answered it) with the router's series
    added. Once the replicas report, the engine series are every replica's, labelled
    ``replica``: the answering one's from this snapshot, the others' as last reported (a
    sum over ``replica`` is then the model's total, where one replica's numbers were a
    random part of it)."""
    fresh = None if replica_id is None else (replica_id, engine_stats_of(families))
    extra = view.families(model_name, fresh)
    if any(f.name in ENGINE_SERIES for f in extra):
        families = [f for f in families if f.name not in ENGINE_SERIES]
    return [*families, *extra]
