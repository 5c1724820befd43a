"""The order the suite runs in: the Ray-free modules first, then the modules grouped by the
Ray topology they ask for (a fixture of tests/conftest.py), so that each instance starts
once and is stopped before the next starts.

One process on purpose: two pytest-xdist workers, each with its Ray modules, ran the
2-core, 24 GiB machine out of memory (Ray's OOM killer took engine workers) and were
slower than one process (44% of the suite in 38 minutes).
"""

from __future__ import annotations

import pytest

# The fixtures through which a module asks for a Ray instance, in the order their modules
# run; the instance of one is stopped when the next is asked for.
RAY_TOPOLOGIES = ("ray_local", "ray_gpu_node", "ray_gpu_nodes", "ray_two_nodes",
                  "ray_multinode", "ray_none")


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def module_ranks(items: list[pytest.Item]) -> dict[str, int]:
    """Per module: 0 if none of its tests uses a Ray fixture, else 1 + the index in
    RAY_TOPOLOGIES of the one its tests use (a module asks for one topology)."""
    ranks: dict[str, int] = {}
    for item in items:
        names = set(item.fixturenames)
        rank = next((i + 1 for i, name in enumerate(RAY_TOPOLOGIES) if name in names), 0)
        ranks[module_of(item)] = max(ranks.get(module_of(item), 0), rank)
    return ranks


def sort_by_topology(items: list[pytest.Item]) -> None:
    """The Ray-free modules, then the others by topology; stable, so the order within a
    module stays as pytest's fixture-aware ordering left it."""
    ranks = module_ranks(items)
    items.sort(key=lambda item: ranks[module_of(item)])
