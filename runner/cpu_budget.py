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


def _own_paths(proc_cgroup: str, controller: str | None) -> list[str]:
    """This process's cgroup and each of its ancestors, innermost first, for the cgroup v2
    hierarchy (``controller`` None: the ``0::/path`` line) or the v1 hierarchy holding
    ``controller``. A quota anywhere above the process limits it too."""
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        names = parts[1].split(",")
        if (controller is None and parts[0] == "0" and parts[1] == "") or (
                controller is not None and controller in names):
            rel = parts[2].strip("/")
            levels = rel.split("/") if rel else []
            return ["/".join(levels[:n]) for n in range(len(levels), -1, -1)]
    return [""]


def _min_quota(quotas: list[float | None]) -> float | None:
    limits = [q for q in quotas if q is not None]
    return min(limits) if limits else None


def _v2_quota(root: str, proc_cgroup: str) -> tuple[bool, float | None]:
    """(whether any cpu.max was read, the tightest quota among them)."""
    found, quotas = False, []
    for rel in _own_paths(proc_cgroup, None):
        text = _read(os.path.join(root, rel, "cpu.max"))  # "<quota> <period>" or "max <period>"
        if text is not None:
            found = True
            quota, _, period = text.partition(" ")
            quotas.append(None if quota == "max" else int(quota) / int(period))
    return found, _min_quota(quotas)


def _v1_quota(root: str, proc_cgroup: str) -> float | None:
    """The tightest CFS quota on the process's v1 cpu cgroup and its ancestors (-1: none).
    A container sees its own cgroup as the mount's root, where its path does not exist."""
    quotas: list[float | None] = []
    for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for rel in _own_paths(proc_cgroup, "cpu"):
            quota_us = _read(os.path.join(root, folder, rel, "cpu.cfs_quota_us"))
            period_us = _read(os.path.join(root, folder, rel, "cpu.cfs_period_us"))
            if quota_us is not None and period_us is not None and int(quota_us) > 0:
                quotas.append(int(quota_us) / int(period_us))
    return _min_quota(quotas)


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP
                     ) -> float | None:
    """CPUs the CFS quota allows this process, or None when there is none (or no file that
    says so can be read)."""
    try:
        found, quota = _v2_quota(root, proc_cgroup)
        return quota if found else _v1_quota(root, proc_cgroup)
    except (ValueError, ZeroDivisionError):
        return None  # a file in a shape this code does not know: no limit assumed


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
