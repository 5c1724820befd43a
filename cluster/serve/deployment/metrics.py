"""Prometheus metrics of one served model, vLLM's names with the ``raylm:`` prefix.

Each ``ServingMetrics`` owns its ``CollectorRegistry`` (never the process-global one: tests
and several models in one process must not share series). Latency histograms are measured
from the token stream the server sees; gauges and counters of the engine are read from
``EngineClient.get_stats()`` at scrape time. Every series carries ``model_name``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from raylm.cluster.engine.engine_stats import (
    KV_GAUGES,
    LORA_INFO,
    SPEC_COUNTERS,
    SPEC_PER_POS,
    labelled,
)
from raylm.cluster.engine.outputs import RequestOutput
from raylm.scheduler.expert_load_stats import LOAD_IMBALANCE, MOE_DOCS

# The families raylm fills (Metric itself has no add_metric).
MetricFamily = GaugeMetricFamily | CounterMetricFamily

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                300.0, 600.0, 1800.0)

# get_stats() key -> (metric name, help); counters get "_total" appended on exposition.
_GAUGES = {
    "num_requests_running": ("raylm:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("raylm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("raylm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."),
}
_COUNTERS = {
    "prompt_tokens_total": ("raylm:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens_total": ("raylm:generation_tokens", "Generation tokens produced."),
    "num_preemptions_total": ("raylm:num_preemptions", "Cumulative preemptions."),
    "prefix_cache_queries_total": ("raylm:prefix_cache_queries", "Prefix cache tokens queried."),
    "prefix_cache_hits_total": ("raylm:prefix_cache_hits", "Prefix cache tokens hit."),
}
# The engine series a replica reports to the routers (``routing_stats``), so that an
# ingress can show every replica's (``engine_families`` with one label per replica).
ENGINE_SERIES = frozenset(name for name, _ in (*_GAUGES.values(), *_COUNTERS.values()))


def routing_stats(stats: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``get_stats()`` that ``engine_families`` exports."""
    return {key: float(stats.get(key, 0)) for key in (*_GAUGES, *_COUNTERS)}


def engine_stats_of(families: Iterable[Metric]) -> dict[str, float]:
    """The inverse of ``engine_families`` for one engine: its ``get_stats()`` numbers
    read back from a /metrics snapshot (one sample per family)."""
    keys = {name: key for table in (_GAUGES, _COUNTERS) for key, (name, _) in table.items()}
    out = {}
    for family in families:
        key = keys.get(family.name)
        if key is not None:
            value = next((s.value for s in family.samples if not s.name.endswith("_created")),
                         None)
            if value is not None:
                out[key] = float(value)
    return out


def engine_families(model_name: str, per_replica: Mapping[str | None, dict[str, Any]]
                    ) -> list[Metric]:
    """The engine's gauges and counters from ``get_stats()`` dicts: one sample per
    replica, labelled ``replica`` with its id (no such label for the key None: the one
    engine of this process)."""
    labelled = any(rid is not None for rid in per_replica)
    labels = ["model_name", "replica"] if labelled else ["model_name"]
    out: list[Metric] = []
    kinds: tuple[tuple[dict[str, tuple[str, str]], type[MetricFamily]], ...] = (
        (_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily))
    for table, kind in kinds:
        for key, (name, doc) in table.items():
            family = kind(name, doc, labels=labels)
            for rid, stats in sorted(per_replica.items(), key=lambda kv: str(kv[0])):
                values = [model_name, str(rid)] if labelled else [model_name]
                family.add_metric(values, float(stats.get(key, 0)))
            out.append(family)
    return out


class _EngineStatsCollector:
    """Reads the engine's gauges and counters when Prometheus scrapes."""

    def __init__(self, model_name: str, stats_fn: Callable[[], dict[str, Any]]):
        self._model_name = model_name
        self._stats_fn = stats_fn

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn() or {}
        except Exception as e:  # a dead engine must not break the scrape of the rest
            logger.warning("get_stats() failed during a metrics scrape: %s", e)
            return
        yield from engine_families(self._model_name, {None: stats})
        family: MetricFamily
        if stats.get("devices"):
            family = GaugeMetricFamily(
                "raylm:device_info", "Engine ranks by the device they run on (cuda, cpu).",
                labels=["model_name", "device_kind", "device_name"])
            for kind, name, count in stats["devices"]:
                family.add_metric([self._model_name, kind, name], float(count))
            yield family
        if "spec_decode_num_drafts_total" in stats:
            for key, (name, doc) in SPEC_COUNTERS.items():
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self._model_name], float(stats[key]))
                yield family
            family = CounterMetricFamily(*SPEC_PER_POS, labels=["model_name", "position"])
            for pos, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
                family.add_metric([self._model_name, str(pos)], float(n))
            yield family
        yield from _labelled_families(
            self._model_name, stats.get("kv_connector") or {}, KV_GAUGES,
            lambda name: "KV connector: " + name.split(":", 1)[1].replace("_", " "))
        yield from _labelled_families(self._model_name, stats.get("moe_experts") or {},
                                      (LOAD_IMBALANCE,), MOE_DOCS.__getitem__)
        if stats.get("lora_requests_info"):
            names = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
            family = GaugeMetricFamily(
                LORA_INFO, "LoRA adapters of running and waiting requests (labels); the "
                "value is the time of the reading.", labels=["model_name", *names])
            for labels, value in stats["lora_requests_info"]:
                family.add_metric([self._model_name, *(labels.get(n, "") for n in names)],
                                  value)
            yield family


def _labelled_families(model_name: str, series: dict[str, float], gauges: Collection[str],
                       doc: Callable[[str], str]) -> Iterable[Metric]:
    """Families from 'name{label="v",...}' keys: gauges where named, else counters."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for key, value in series.items():
        name, labels = labelled(key)
        by_name.setdefault(name, []).append((labels, float(value)))
    for name, samples in sorted(by_name.items()):
        label_names = ["model_name", *sorted(samples[0][0])]
        kind = GaugeMetricFamily if name in gauges else CounterMetricFamily
        family = kind(name, doc(name), labels=label_names)
        for labels, value in samples:
            family.add_metric([model_name, *(labels[k] for k in label_names[1:])], value)
        yield family


class RequestTimer:
    """Turns one request's stream of cumulative outputs into latency observations."""

    def __init__(self, metrics: ServingMetrics):
        self._m = metrics
        self._arrival = time.perf_counter()
        self._last_token: float | None = None
        self._num_tokens = 0
        self._done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > self._num_tokens:
            if self._last_token is None:
                self._m.ttft.observe(now - self._arrival)
            else:
                self._m.itl.observe(now - self._last_token)
            self._last_token = now
            self._num_tokens = num_tokens
        if output.finished and not self._done:
            self._done = True
            self._m.e2e.observe(now - self._arrival)
            for c in output.outputs:
                self._m.request_success.labels(self._m.model_name, c.finish_reason or "abort").inc()


    def on_abort(self) -> None:
        """The stream ended before the request finished (client gone, engine failure)."""
        if not self._done:
            self._done = True
            self._m.request_success.labels(self._m.model_name, "abort").inc()


class ServingMetrics:
    def __init__(self, model_name: str, stats_fn: Callable[[], dict[str, Any]]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, label = self.registry, ["model_name"]
        self.ttft = Histogram("raylm:time_to_first_token_seconds", "Time to first token.",
                              label, registry=reg, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("raylm:inter_token_latency_seconds", "Time between output tokens.",
                             label, registry=reg, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("raylm:e2e_request_latency_seconds", "Request latency, end to end.",
                             label, registry=reg, buckets=_E2E_BUCKETS).labels(model_name)
        self.request_success = Counter("raylm:request_success", "Finished requests, by reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        reg.register(_EngineStatsCollector(model_name, stats_fn))

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def families(self) -> list[Metric]:
        """A picklable snapshot (a replica sends it to the HTTP ingress)."""
        return list(self.registry.collect())


class _Snapshot:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render(groups: Iterable[list[Metric]]) -> bytes:
    """Prometheus text for several models' snapshots: one family per name, all samples."""
    merged: dict[str, Metric] = {}
    for families in groups:
        for fam in families:
            target = merged.get(fam.name)
            if target is None:
                target = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            # "_created" timestamps are prometheus_client noise that vLLM's names don't have.
            target.samples.extend(s for s in fam.samples if not s.name.endswith("_created"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(list(merged.values())))
    return generate_latest(registry)
