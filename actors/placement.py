"""Placement groups for one engine: a bundle per pipeline stage (its TP group), an optional
one for the EngineCore.

A placement group that cannot be placed is reported within a bounded wait with the
resources that are missing, never left pending forever.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections import Counter

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import PLACEMENT_STRATEGIES, stage_bundles

logger = logging.getLogger(__name__)

DEFAULT_PLACEMENT_TIMEOUT_S = 1800.0  # ParallelConfig.placement_timeout_s's default
PLACEMENT_LOG_INTERVAL_S = 30.0  # while waiting, say what is missing this often
# Logical CPUs of a local Ray instance raylm starts, at the least: enough for the engines
# one process may build one after another (TP=2 x PP=2 x DP=2 with its EngineCores needs
# 10). Bundles reserve one logical CPU per rank; the ranks then share the real cores, and
# each sizes its torch threads from its own bundle, not from this number.
LOCAL_RAY_MIN_CPUS = 16


class PlacementGroupError(RuntimeError):
    """The cluster cannot (or not in time) hold the bundles an engine asked for."""


def local_ray_num_cpus(min_cpus: float = 0.0) -> int:
    """Logical CPUs of a local instance: RAYLM_LOCAL_RAY_CPUS, else enough for any engine
    this machine can run (not just the first one: a local Ray cannot grow later)."""
    override = envs.local_ray_num_cpus()
    if override is not None:
        return max(override, math.ceil(min_cpus))
    return max(os.cpu_count() or 1, LOCAL_RAY_MIN_CPUS, math.ceil(min_cpus))


def ensure_ray_initialized(min_cpus: float = 0.0) -> None:
    """Library code joins the configured cluster, or starts a local one, only if needed.

    A local instance declares ``local_ray_num_cpus(min_cpus)`` logical CPUs: every engine's
    placement group (EngineCore + one CPU per worker) must fit, later and larger ones too,
    even on a 2-core machine where the ranks then share the cores.
    """
    if ray.is_initialized():
        return
    address = envs.ray_address()
    if address is not None:
        ray.init(address=address, include_dashboard=False)
        return
    num_cpus = local_ray_num_cpus(min_cpus)
    if num_cpus > (os.cpu_count() or 1):
        logger.info("Starting a local Ray instance with %d logical CPUs on %d cores "
                    "(RAYLM_LOCAL_RAY_CPUS sets it).", num_cpus, os.cpu_count())
    # address="local": never join a cluster some earlier `ray start` left running.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


def get_within(refs: list, timeout_s: float, what: str, on: str) -> list:
    """``ray.get`` of setup calls, bounded: a TimeoutError says which step hung and on
    which actors (``on``), rather than a bare GetTimeoutError or a wait forever."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what} took longer than {timeout_s:g}s on {on}.") from e


def default_worker_resource() -> str:
    """``GPU`` when the cluster has GPUs, else ``CPU``."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


def threads_for_cpus(cpus: float) -> int:
    """Torch intra-op threads of a rank that reserved ``cpus`` CPUs: RAYLM_NUM_THREADS if
    set, else the whole CPUs reserved, at least one."""
    return envs.num_threads_override() or max(1, int(cpus))


def worker_bundle(resource: str, cpus_per_worker: float = 1.0) -> dict:
    """What one TP x PP rank reserves: ``{"GPU": 1}`` on GPU clusters, ``{"CPU": n}``
    otherwise."""
    if resource not in ("CPU", "GPU"):
        raise ValueError(f"resource must be 'CPU' or 'GPU', got {resource!r}.")
    if not cpus_per_worker > 0:
        raise ValueError(f"cpus_per_worker must be positive, got {cpus_per_worker}.")
    return {"GPU": 1.0} if resource == "GPU" else {"CPU": float(cpus_per_worker)}


def worker_bundles(tensor_parallel_size: int, pipeline_parallel_size: int, resource: str,
                   cpus_per_worker: float = 1.0) -> list[dict]:
    """The workers' bundles: one per pipeline stage, holding its TP group (stage_bundles)."""
    return stage_bundles(tensor_parallel_size, pipeline_parallel_size,
                         worker_bundle(resource, cpus_per_worker))


def rank_resources(bundle: dict, ranks_in_bundle: int) -> tuple[float, float]:
    """(CPUs, GPUs) one rank takes from a bundle shared by ``ranks_in_bundle`` ranks."""
    return bundle.get("CPU", 0.0) / ranks_in_bundle, bundle.get("GPU", 0.0) / ranks_in_bundle


def create_placement_group(bundles: list[dict], strategy: str = "PACK",
                           timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
                           name: str | None = None) -> PlacementGroup:
    """Create and wait for a placement group; raise PlacementGroupError after ``timeout_s``."""
    if not bundles:
        raise ValueError("bundles must not be empty.")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    ensure_ray_initialized(sum(b.get("CPU", 0.0) for b in bundles))
    pg = placement_group(bundles, strategy=strategy,
                         name=name or f"raylm-{uuid.uuid4().hex[:8]}")
    ready_ref = pg.ready()
    deadline = time.monotonic() + timeout_s
    ready: list = []
    while not ready:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _ = ray.wait([ready_ref], timeout=min(left, PLACEMENT_LOG_INTERVAL_S))
        if not ready and deadline - time.monotonic() > 0:
            logger.info("waiting %.0fs more for the placement group %s: %s",
                        deadline - time.monotonic(), _summarize(bundles),
                        describe_missing_resources(bundles, strategy))
    if not ready:
        why = describe_missing_resources(bundles, strategy)
        remove_placement_group(pg)
        raise PlacementGroupError(
            f"placement group of {len(bundles)} bundles {_summarize(bundles)} "
            f"(strategy {strategy}) could not be placed within {timeout_s:g}s: {why}")
    return pg


def _summarize(bundles: list[dict]) -> str:
    counts = Counter(tuple(sorted(b.items())) for b in bundles)
    return " + ".join(f"{n} x {dict(k)}" for k, n in counts.items())


def describe_missing_resources(bundles: list[dict], strategy: str) -> str:
    """Compare what the bundles need with what the cluster has (in total, free, per node)."""
    requested: Counter = Counter()
    for b in bundles:
        requested.update(b)
    total = ray.cluster_resources()
    available = ray.available_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    problems = []
    for res, need in sorted(requested.items()):
        have_total, have_free = total.get(res, 0.0), available.get(res, 0.0)
        if need > have_free:
            problems.append(f"{res}: requested {need:g}, available {have_free:g} of "
                            f"{have_total:g} in the cluster (missing {need - have_free:g})")
    for b in bundles:
        if not any(all(node.get(r, 0.0) >= q for r, q in b.items()) for node in nodes):
            problems.append(f"bundle {b} fits on no node")
            break
    if strategy == "STRICT_PACK":
        if not any(all(node.get(r, 0.0) >= q for r, q in requested.items()) for node in nodes):
            problems.append(f"STRICT_PACK needs {dict(requested)} on one node; no node has it")
    if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        problems.append(f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}")
    if not problems:
        problems.append(f"the cluster has enough in total ({dict(available)} free); other "
                        "placement groups or actors may hold it (an engine not shut down: "
                        "call llm.shutdown() or del it), or nodes are still starting")
    elif len(nodes) == 1 and envs.ray_address() is None:
        problems.append("on a single-node Ray started in this process, start it larger "
                        "before the first engine (ray.init(num_cpus=N), or set "
                        "RAYLM_LOCAL_RAY_CPUS=N when raylm starts it), or join a cluster "
                        "with RAY_ADDRESS")
    return "; ".join(problems) + "."
