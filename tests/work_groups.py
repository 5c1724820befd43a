"""How two pytest-xdist workers share the suite (``--dist loadscope``, the work units ours).

Every module on one of the shared single-node Ray topologies is one work unit, run in
topology order on one worker, so that one shared Ray at a time lives on the machine (two
workers each with their own shared Ray ran the 24 GiB machine out of memory). Every other
module (the multi-node cluster's and the soak's, whose clusters are their own, included)
is a unit of its own for whichever worker is free (tests/suite_order.py).

Which module asks for what is known only after collection, on the workers (their
fixtures), and the controller that hands units out does not collect: each worker writes
the module -> unit map to a file the controller named, before it reports its collection;
the controller's scheduler reads it when it splits the collection into units.
(xdist's own ``xdist_group`` marks rename the node ids, which pytest 9.2 no longer allows.)
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from xdist.scheduler import LoadScopeScheduling


def write_groups(path: str, groups: dict[str, str]) -> None:
    """Atomically: both workers write the same map."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, path)


class WorkGroupScheduling(LoadScopeScheduling):
    """LoadScope whose unit of a test is its module's entry in the workers' map."""

    def __init__(self, config: pytest.Config, log, path: str) -> None:
        super().__init__(config, log)
        self._path = path
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            with open(self._path) as f:
                self._groups = json.load(f)
        module = nodeid.split("::")[0]
        return self._groups.get(module, module)
