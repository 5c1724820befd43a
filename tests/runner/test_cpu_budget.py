"""The CPUs a process may keep busy: affinity mask capped by the cgroup's CFS quota, read
from fake cgroup trees (v2 and v1) so the test does not depend on the machine."""

from __future__ import annotations

import pytest

from raylm.runner import cpu_budget


def _tree(tmp_path, files: dict[str, str], proc_cgroup: str = "0::/\n"):
    for rel, text in files.items():
        path = tmp_path / "cg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self_cgroup").write_text(proc_cgroup)
    return str(tmp_path / "cg"), str(tmp_path / "self_cgroup")


@pytest.mark.parametrize(("files", "proc", "expected"), [
    ({"cpu.max": "250000 100000\n"}, "0::/\n", 2.5),  # v2, the container's root
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),
    ({"kubepods/pod1/cpu.max": "50000 100000\n", "cpu.max": "max 100000\n"},
     "0::/kubepods/pod1\n", 0.5),  # v2, the process's own cgroup first
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"},
     "4:cpu:/\n", 3.0),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     "4:cpu:/\n", None),
    ({}, "0::/\n", None),  # no cgroup files at all
    ({"cpu.max": "lots 100000\n"}, "0::/\n", None),  # unknown shape: no limit assumed
])
def test_cgroup_cpu_quota(tmp_path, files, proc, expected):
    root, proc_path = _tree(tmp_path, files, proc)
    assert cpu_budget.cgroup_cpu_quota(root, proc_path) == expected


@pytest.mark.parametrize(("affinity", "quota", "expected"), [
    (16, None, 16), (16, 4.0, 4), (16, 2.5, 2), (16, 0.5, 1), (2, 8.0, 2)])
def test_usable_cpus_is_the_affinity_capped_by_whole_quota_cpus(monkeypatch, affinity, quota,
                                                                 expected):
    monkeypatch.setattr(cpu_budget.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_quota", lambda: quota)
    assert cpu_budget.usable_cpus() == expected
