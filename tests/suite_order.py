"""The order the suite runs in, and how pytest-xdist's two workers share it.

Modules are grouped by the Ray topology they ask for (a fixture of tests/conftest.py), so
that each instance starts once. Under ``--dist loadgroup`` every module is one work unit,
but the modules on the shared single-node Ray are one unit (one worker keeps that
instance), and the modules on the other topologies another (the other worker starts them
in turn, one at a time); both are handed out first, and the Ray-free modules fill in.
"""

from __future__ import annotations

import pytest

# The fixtures through which a module asks for a Ray instance, in the order their modules
# run; the instance of one is stopped when the next is asked for.
RAY_TOPOLOGIES = ("ray_local", "ray_gpu_node", "ray_gpu_nodes", "ray_two_nodes",
                  "ray_multinode", "ray_none")
LOCAL_GROUP, CLUSTERS_GROUP = "ray-local", "ray-clusters"


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].split("@")[0]


def module_ranks(items: list[pytest.Item]) -> dict[str, int]:
    """Per module: 0 if none of its tests uses a Ray fixture, else 1 + the index in
    RAY_TOPOLOGIES of the one its tests use (a module asks for one topology)."""
    ranks: dict[str, int] = {}
    for item in items:
        names = set(item.fixturenames)
        rank = next((i + 1 for i, name in enumerate(RAY_TOPOLOGIES) if name in names), 0)
        ranks[module_of(item)] = max(ranks.get(module_of(item), 0), rank)
    return ranks


def sort_by_topology(items: list[pytest.Item]) -> dict[str, int]:
    """Ray modules first, by topology, then the others; stable, so the order within a
    module stays as pytest's fixture-aware ordering left it. Returns the module ranks."""
    ranks = module_ranks(items)
    items.sort(key=lambda item: ranks[module_of(item)] or len(RAY_TOPOLOGIES) + 1)
    return ranks


class XdistGroups:
    """Marks each test with its work unit before pytest-xdist reads the marks."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        ranks = module_ranks(items)
        for item in items:
            rank = ranks[module_of(item)]
            group = (module_of(item) if rank == 0 else LOCAL_GROUP if rank == 1
                     else CLUSTERS_GROUP)
            item.add_marker(pytest.mark.xdist_group(group))
