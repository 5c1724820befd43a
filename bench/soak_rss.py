"""Memory of the soak's cluster (bench/soak.py): the RSS of every process of the Ray cluster
this process started (its descendants: GCS, raylets and the workers they fork), sampled
every few seconds on a thread, by process kind, and its growth.

Kinds, from the command line (Ray titles actor processes ``ray::<Class>``): worker
(``WorkerActor``), engine_core (``EngineCoreActor``), replica (the model's Serve
replicas), ingress (the OpenAIIngress replica), controller, proxy, gcs, raylet, and
other (idle Ray workers, agents, monitors).

Growth of a kind: over the processes of that kind that lived through the whole last half
of the run (from its middle to its end) and were WARMUP_S old by its middle (a process
that starts loads its libraries and model first), their summed RSS at the end against the
middle. Where faults restarted every process of a kind in that half, the growth is that
of the longest-lived one still alive at the end, over the second half of its life (if it
lived 2 x WARMUP_S), and the line says so.

Each sample also splits the RSS as /proc/<pid>/status does: anonymous pages (the heap:
Python objects, torch tensors, what the allocator keeps) and shared-memory pages (Ray's
object store, mapped into the processes that read from it), so that a growth can be told
apart: the trajectory of the longest-lived process prints both.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil

KINDS = ("worker", "engine_core", "replica", "ingress", "controller", "proxy", "gcs",
         "raylet", "other")
WARMUP_S = 60.0


def kind_of(cmdline: str) -> str:
    if "ray::WorkerActor" in cmdline:
        return "worker"
    if "ray::EngineCoreActor" in cmdline:
        return "engine_core"
    if "ray::ServeReplica" in cmdline:
        return "ingress" if "OpenAIIngress" in cmdline else "replica"
    if "ray::ServeController" in cmdline:
        return "controller"
    if "ray::ProxyActor" in cmdline:
        return "proxy"
    if "gcs_server" in cmdline:
        return "gcs"
    if "/raylet" in cmdline:
        return "raylet"
    return "other"


@dataclass(frozen=True)
class Sample:
    t: float
    pid: int
    kind: str
    rss: int
    anon: int = 0  # RssAnon: the heap
    shmem: int = 0  # RssShmem: shared memory (the object store's pages this process touched)


def rss_split(pid: int) -> tuple[int, int]:
    """(RssAnon, RssShmem) in bytes from /proc/<pid>/status; (0, 0) where unreadable."""
    out = {"RssAnon:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in out:
                    out[parts[0]] = int(parts[1]) * 1024
    except OSError:
        pass
    return out["RssAnon:"], out["RssShmem:"]


class RSSSampler:
    """Samples this process's descendants every ``period_s`` on a daemon thread."""

    def __init__(self, t0: float, period_s: float = 5.0) -> None:
        self.t0 = t0
        self.period_s = period_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> RSSSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample_once(self) -> None:
        t = time.monotonic() - self.t0
        for p in psutil.Process(os.getpid()).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.samples.append(Sample(t, p.pid, kind_of(cmd), rss, *rss_split(p.pid)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.period_s)


@dataclass
class KindMemory:
    kind: str
    start_mb: float  # summed over the kind's processes, at the first sample
    mid_mb: float
    end_mb: float
    growth: float | None  # last half, see the module docstring
    how: str  # what the growth was measured on
    longest: str = ""  # the longest-lived process: its RSS at each fifth of its life


def _sum_at(samples: list[Sample], rounds: list[float], t: float
            ) -> tuple[float, dict[int, int]]:
    """In the sample round nearest ``t``: the summed RSS (MB) of ``samples`` and each
    pid's RSS (0 and none where the kind had no process then)."""
    nearest = min(rounds, key=lambda x: abs(x - t))
    at = {s.pid: s.rss for s in samples if s.t == nearest}
    return sum(at.values()) / 2**20, at


def memory_by_kind(all_samples: list[Sample], t_end: float) -> list[KindMemory]:
    """Per kind: RSS at the run's start, middle and end (``t_end``: the load's end) and
    the growth over the last half."""
    out = []
    # A Ray worker's title changes with the actor it hosts (an idle worker becomes an
    # actor): a process is of the one kind other than "other" it was ever seen as.
    kinds: dict[int, str] = {}
    for s in all_samples:
        if s.kind != "other" or s.pid not in kinds:
            kinds[s.pid] = s.kind
    samples = [Sample(s.t, s.pid, kinds[s.pid], s.rss, s.anon, s.shmem) for s in all_samples
               if s.t <= t_end + 1e-6]
    if not samples:
        return out
    rounds = sorted({s.t for s in samples})
    t_first = rounds[0]
    t_mid = (t_first + t_end) / 2
    for kind in KINDS:
        mine = [s for s in samples if s.kind == kind]
        if not mine:
            continue
        start, _ = _sum_at(mine, rounds, t_first)
        mid, mid_pids = _sum_at(mine, rounds, t_mid)
        end, end_pids = _sum_at(mine, rounds, t_end)
        lives: dict[int, list[Sample]] = {}
        for s in mine:
            lives.setdefault(s.pid, []).append(s)
        survivors = [p for p in end_pids if p in mid_pids
                     and lives[p][0].t <= t_mid - WARMUP_S]
        growth, how = None, f"no process lived {2 * WARMUP_S:.0f} s"
        if survivors:
            before = sum(mid_pids[p] for p in survivors)
            after = sum(end_pids[p] for p in survivors)
            growth = (after - before) / before
            how = f"{len(survivors)} process(es) alive through the last half"
        elif end_pids:
            last = max((lives[p] for p in end_pids), key=lambda ss: ss[-1].t - ss[0].t)
            life = last[-1].t - last[0].t
            if life >= 2 * WARMUP_S:
                half = last[0].t + life / 2
                mid_s = min(last, key=lambda s: abs(s.t - half))
                growth = (last[-1].rss - mid_s.rss) / mid_s.rss
                how = (f"restarted in the last half: pid {last[0].pid}, the second half "
                       f"of its {life:.0f} s")
        longest = max(lives.values(), key=lambda ss: ss[-1].t - ss[0].t)
        out.append(KindMemory(kind, start, mid, end, growth, how, _trajectory(longest)))
    return out


def _trajectory(life: list[Sample]) -> str:
    """'pid P over T s: a -> b -> c -> d -> e -> f MB (anon ...; shmem ...)' at 0, 20, ...,
    100% of its life."""
    t0, t1 = life[0].t, life[-1].t
    points = [min(life, key=lambda s, f=f: abs(s.t - (t0 + f * (t1 - t0)))) for f in
              (0, 0.2, 0.4, 0.6, 0.8, 1.0)]

    def mbs(field: str) -> str:
        return " -> ".join(f"{getattr(p, field) / 2**20:.0f}" for p in points)

    return (f"pid {life[0].pid} over {t1 - t0:.0f} s: {mbs('rss')} MB "
            f"(anon {mbs('anon')}; shmem {mbs('shmem')})")
