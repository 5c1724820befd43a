"""How many CPUs this process may keep busy: its affinity mask, capped by its cgroup's quota.

A container limited with a CFS quota (``docker --cpus``, a Kubernetes CPU limit) still sees
every core of the node in its affinity mask; an OpenMP team sized to the node is then
throttled every period and each parallel region waits for its descheduled threads. Ray
reads the same files to size a node's logical CPUs; raylm reads them for a process that Ray
did not size (an offline ``LLM``, a ``raylm batch`` driver).
"""

from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_cpu_max_paths(root: str, proc_cgroup: str) -> list[str]:
    """cpu.max of this process's own cgroup (``0::/path`` in /proc/self/cgroup), then of
    the root a container usually sees as its own."""
    paths = []
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip("/")
            if rel:
                paths.append(os.path.join(root, rel, "cpu.max"))
    paths.append(os.path.join(root, "cpu.max"))
    return paths


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP
                     ) -> float | None:
    """CPUs the CFS quota allows this process, or None when there is none (or no file that
    says so can be read)."""
    try:
        for path in _v2_cpu_max_paths(root, proc_cgroup):
            text = _read(path)
            if text is not None:  # cgroup v2: "<quota> <period>" or "max <period>"
                quota, _, period = text.partition(" ")
                return None if quota == "max" else int(quota) / int(period)
        for folder in ("cpu", "cpu,cpuacct"):  # cgroup v1: quota -1 means none
            quota_us = _read(os.path.join(root, folder, "cpu.cfs_quota_us"))
            period_us = _read(os.path.join(root, folder, "cpu.cfs_period_us"))
            if quota_us is not None and period_us is not None:
                return None if int(quota_us) <= 0 else int(quota_us) / int(period_us)
    except (ValueError, ZeroDivisionError):
        return None  # a file in a shape this code does not know: no limit assumed
    return None


def usable_cpus() -> int:
    """Cores in the affinity mask, at most the quota's whole CPUs, at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)
