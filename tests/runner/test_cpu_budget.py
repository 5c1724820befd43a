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
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
      "cpu/batch/cpu.cfs_quota_us": "150000\n", "cpu/batch/cpu.cfs_period_us": "100000\n",
      "cpu/batch/job1/cpu.cfs_quota_us": "-1\n", "cpu/batch/job1/cpu.cfs_period_us": "100000\n"},
     "3:cpuset:/\n1:cpu:/batch/job1\n", 1.5),  # v1, the quota of the process's parent cgroup
    ({"a/cpu.max": "100000 100000\n", "a/b/cpu.max": "max 100000\n", "cpu.max": "max 100000\n"},
     "0::/a/b\n", 1.0),  # v2: an ancestor's limit applies too
    ({"a/cpu.max": "400000 100000\n", "a/b/cpu.max": "200000 100000\n"},
     "0::/a/b\n", 2.0),  # v2: the tightest level wins
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


def _one_cpu_cgroup():
    """A real cgroup with a CFS quota of one CPU (v1 cpu controller or v2), made for this
    test and removed after; None where this process may not make one (not root, v2
    without the cpu controller delegated)."""
    import os

    for folder, limit in (("/sys/fs/cgroup/cpu", {"cpu.cfs_quota_us": "100000",
                                                   "cpu.cfs_period_us": "100000"}),
                          ("/sys/fs/cgroup", {"cpu.max": "100000 100000"})):
        if not os.path.isfile(os.path.join(folder, "cgroup.procs")):
            continue
        path = os.path.join(folder, f"raylm_test_{os.getpid()}")
        try:
            os.mkdir(path)
            for name, value in limit.items():
                with open(os.path.join(path, name), "w") as f:
                    f.write(value)
            return path
        except OSError:
            if os.path.isdir(path):
                os.rmdir(path)
    return None


def test_a_process_under_a_real_one_cpu_quota_takes_one_thread():
    """The acceptance's cgroup case on this machine's own kernel: a process moved into a
    cgroup limited to one CPU sizes its torch threads to 1 though it sees every core."""
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a machine with at least 2 CPUs to tell the quota apart")
    cgroup = _one_cpu_cgroup()
    if cgroup is None:
        pytest.skip("this process may not create a cgroup with a CPU quota")

    def enter() -> None:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    code = ("import os; from raylm.runner.worker import default_intra_op_threads; "
            "print(len(os.sched_getaffinity(0)), default_intra_op_threads())")
    env = {k: v for k, v in os.environ.items() if k != "RAYLM_NUM_THREADS"}
    try:
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=enter, env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        os.rmdir(cgroup)
    seen, threads = map(int, out.split())
    assert seen >= 2 and threads == 1
