"""The order the suite runs in, and how two pytest-xdist workers share it.

Ray-free modules, modules that start a Ray of their own (``raylm`` subprocesses, marked
``ray``), then the modules grouped by the shared Ray topology they ask for (a fixture of
tests/conftest.py), so that each shared instance starts once and is stopped before the next.

Under two pytest-xdist workers (tests/work_groups.py) the modules asking for a shared topology
on this node's Ray are one work unit, handed out first; every other module (those whose
cluster is their own included) is a unit of its own, the slowest first.
"""

from __future__ import annotations

import pytest

# The fixtures through which a module asks for a Ray instance, in the order their modules
# run; the instance of one is stopped when the next is asked for.
RAY_TOPOLOGIES = ("ray_local", "ray_gpu_node", "ray_gpu_nodes", "ray_two_nodes",
                  "ray_multinode", "ray_none")
OWN_RAY = 1  # rank of a module marked `ray` that asks for no shared topology
# Topologies that are clusters of their own processes (`ray start` nodes, the soak's):
# under two workers such a module is a unit of its own, beside the shared single-node Ray.
OWN_CLUSTERS = ("ray_multinode", "ray_none")
SHARED_RAY_GROUP = "ray"

# Modules that are not in the shared-Ray unit and take a minute or more: handed out first
# so the two workers finish together (measured: the --durations list of a full run).
SLOW_FIRST = (
    "tests/cluster/test_soak.py",
    "tests/cluster/test_multinode.py",
    "tests/cluster/test_cli.py",
    "tests/cluster/test_serve_cli.py",
    "tests/cluster/test_engine_lifecycle.py",
    "tests/runner/test_fused_ops.py",
    "tests/cluster/test_triton_engine.py",
    "tests/cluster/test_openai_tools.py",
    "tests/cluster/test_gemma3_270m.py",
)


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def module_ranks(items: list[pytest.Item]) -> dict[str, int]:
    """Per module: 0 if none of its tests uses Ray, OWN_RAY if one is marked ``ray`` but
    none asks for a shared topology, else OWN_RAY + 1 + the index in RAY_TOPOLOGIES of the
    one its tests use (a module asks for one topology)."""
    ranks: dict[str, int] = {}
    for item in items:
        names = set(item.fixturenames)
        own = OWN_RAY if item.get_closest_marker("ray") is not None else 0
        rank = next((i + OWN_RAY + 1 for i, name in enumerate(RAY_TOPOLOGIES)
                     if name in names), own)
        ranks[module_of(item)] = max(ranks.get(module_of(item), 0), rank)
    return ranks


def sort_by_topology(items: list[pytest.Item]) -> None:
    """Serial order; stable, so the order within a module stays as pytest's fixture-aware
    ordering left it."""
    ranks = module_ranks(items)
    items.sort(key=lambda item: ranks[module_of(item)])


def shares_the_local_ray(rank: int) -> bool:
    return rank > OWN_RAY and RAY_TOPOLOGIES[rank - OWN_RAY - 1] not in OWN_CLUSTERS


def work_group(rank: int, module: str) -> str:
    """The xdist work unit of a module of this rank."""
    return SHARED_RAY_GROUP if shares_the_local_ray(rank) else module


def sort_for_workers(items: list[pytest.Item], ranks: dict[str, int]) -> None:
    """xdist order (units are handed out in the order of their first test): the
    shared-Ray unit, then SLOW_FIRST, then the rest as collected."""
    def key(item: pytest.Item) -> tuple[int, int]:
        module = module_of(item)
        rank = ranks[module]
        if shares_the_local_ray(rank):
            return (0, rank)
        if module in SLOW_FIRST:
            return (1, SLOW_FIRST.index(module))
        return (2, 0)

    items.sort(key=key)
