"""A chaos soak of a real raylm Serve deployment (issue 30): minutes of seeded random load
while workers, EngineCores, replicas and a node are killed, then every request checked.

    python bench/soak.py [--minutes 10] [--seed 0] [--faults worker,engine_core,replica,node]
                         [--rate 3] [--model tiny|6m|PATH] [--history out.jsonl] [--keep-logs]

The cluster (bench/soak_faults.py): a ``ray.cluster_utils.Cluster`` of a head and a worker
node, Serve's HTTP proxy on 127.0.0.1, ``build_openai_app`` with the ingress deployment in
front of 2 replicas of one model (the tiny random Llama by default), each TP=2 on the Ray
backend (an EngineCore actor and two worker actors per replica), async scheduling, prefix
caching and prefix-aware routing, 64 KV blocks of 16 tokens per replica and 16 sequences
(so requests preempt each other), one replica per node. Speculative decoding is not in the
mix: one deployment's replicas share one engine config, so no replica can have it alone.

The load (bench/soak_history.py): Poisson arrivals at ``--rate`` requests/s with bursts
of 8-16 every ~20 s, at most ``--max-in-flight`` open, over ``--minutes``; greedy,
seeded, stop-string, n=2, logprobs, structured-output (chat) and aborted requests, mostly
streamed, 10% of streams cut by the client. The faults (each kind of ``--faults`` at
least once, then again in turn, about one per ``--fault-every`` seconds, planned over
8-70% of the run (``--fault-span``), each at least 5 s after the previous one recovered,
none past 90% of the run): SIGKILL of a worker actor, SIGKILL of an EngineCore actor,
``ray.kill`` of a Serve replica, removal of the worker node and a fresh one added. The load
goes on until every fault recovered, and 5 s more.

Afterwards (bench/soak_checks.py, bench/soak_rss.py): PASS/FAIL lines for hung requests,
token-exact text against raylm's offline ``LLM`` at TP=1, well-formed responses, errors
only in fault windows and always OpenAI's JSON, KV usage and running requests 0 once idle,
the generation-token counters, and RSS growth per process kind; then a summary table.
Exit code 1 if any check failed. ``--history`` writes every request's record, every fault
and every RSS sample as JSON lines; ``--keep-logs`` keeps the cluster's Ray logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import soak_checks  # noqa: E402
import soak_faults  # noqa: E402
import soak_history  # noqa: E402
import soak_reference  # noqa: E402
import soak_rss  # noqa: E402
from common import checkpoint  # noqa: E402

FAULT_GAP_S = 5.0  # after a recovery: requests that must succeed before the next fault
LATEST_FAULT = 0.9  # no fault starts past this share of the run


@dataclass
class SoakResult:
    checks: list[soak_checks.Check]
    records: list[soak_history.Record]
    faults: list[soak_faults.Fault]
    summary: str
    skipped_faults: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> soak_checks.Check:
        return next(c for c in self.checks if c.name == name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default=",".join(soak_faults.FAULT_KINDS),
                   help="fault kinds, in order (empty: none)")
    p.add_argument("--fault-every", type=float, default=60.0,
                   help="seconds between planned faults (more faults on longer runs)")
    p.add_argument("--fault-span", type=float, default=0.62,
                   help="share of the run the planned faults spread over (from 8%% of it)")
    p.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second")
    p.add_argument("--burst-every", type=float, default=20.0, help="mean seconds between bursts")
    p.add_argument("--max-in-flight", type=int, default=48)
    p.add_argument("--deadline", type=float, default=120.0,
                   help="seconds within which every request must end")
    p.add_argument("--model", default="tiny", help="tiny, 6m (bench checkpoints) or a path")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rss-bound", type=float, default=0.20,
                   help="the most a process kind's RSS may grow over the last half")
    p.add_argument("--rss-period", type=float, default=5.0)
    p.add_argument("--history", default=None,
                   help="write every request, fault and RSS sample here (JSON lines)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the cluster's Ray session folder (its logs) after the run")
    return p.parse_args(argv)


def fault_plan(kinds: list[str], duration: float, every: float, span: float = 0.62
               ) -> list[tuple[float, str]]:
    """(planned time, kind): every kind once, then again in turn, spread over the run from
    8% of it to 8% + ``span``, at most one per ``every`` seconds."""
    if not kinds:
        return []
    span = span * duration
    n = max(len(kinds), int(span / every) + 1)
    return [(duration * 0.08 + (span * i / (n - 1) if n > 1 else 0.0), kinds[i % len(kinds)])
            for i in range(n)]


class Soak:
    def __init__(self, args: argparse.Namespace, log=print) -> None:
        self.args = args
        self.log = log
        self.rng = random.Random(args.seed)
        self.duration = args.minutes * 60.0
        self.records: list[soak_history.Record] = []
        self.faults: list[soak_faults.Fault] = []
        self.skipped: list[str] = []
        self.last_recovery = 0.0
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _faults(self, injector: soak_faults.FaultInjector, base_url: str) -> None:
        """The fault schedule, on the main thread: Ray's ``Cluster.add_node`` installs a
        signal handler, which only the main thread may do."""
        kinds = [k for k in self.args.faults.split(",") if k]
        plan = fault_plan(kinds, self.duration, self.args.fault_every, self.args.fault_span)
        for planned, kind in plan:
            start = max(planned, self.last_recovery + FAULT_GAP_S)
            if start > LATEST_FAULT * self.duration:
                self.skipped.append(f"{kind} (planned at {planned:.0f} s; no time left)")
                continue
            time.sleep(max(0.0, start - self.now()))
            fault = injector.inject(kind)
            self.faults.append(fault)
            self.log(f"[{self.now():7.1f} s] fault {kind}: {fault.victim} "
                     f"(replica {fault.replica or '-'})", flush=True)
            injector.wait_recovered(fault, lambda: soak_faults.probe_request(base_url))
            self.log(f"[{self.now():7.1f} s] {fault.line()}", flush=True)
            if fault.recovered_at is None:
                self.skipped.append("the rest: the cluster did not recover")
                return
            self.last_recovery = fault.recovered_at

    async def _arrivals(self, base_url: str, mix: soak_history.RequestMix,
                        faults_done: threading.Event) -> None:
        import httpx

        args, rng = self.args, self.rng
        slots = asyncio.Semaphore(args.max_in_flight)
        tasks: list[asyncio.Task] = []
        next_burst = rng.expovariate(1 / args.burst_every)
        next_report = 30.0

        def load_over() -> bool:
            if not faults_done.is_set():
                return False  # a fault still recovering: its aftermath must see load
            return self.now() >= max(self.duration, self.last_recovery + FAULT_GAP_S)

        limits = httpx.Limits(max_connections=4 * args.max_in_flight,
                              max_keepalive_connections=args.max_in_flight)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            while not load_over():
                await asyncio.sleep(rng.expovariate(args.rate))
                n = 1
                if self.now() >= next_burst:
                    n = rng.randint(8, 16)
                    next_burst = self.now() + rng.expovariate(1 / args.burst_every)
                for _ in range(n):
                    rec = mix.next()
                    self.records.append(rec)
                    await slots.acquire()
                    task = asyncio.create_task(soak_history.run_request(
                        client, base_url, rec, args.deadline, self.t0))
                    task.add_done_callback(lambda _t: slots.release())
                    tasks.append(task)
                if self.now() >= next_report:
                    next_report += 30.0
                    ends = Counter(r.end_kind or "open" for r in self.records)
                    self.log(f"[{self.now():7.1f} s] {len(self.records)} requests: "
                             f"{dict(sorted(ends.items()))}", flush=True)
            await asyncio.gather(*tasks)

    def _load(self, cluster: soak_faults.SoakCluster, vocab: int) -> float:
        """The load on a thread of its own (its event loop), the faults on this one; the
        load's end once both are over."""
        mix = soak_history.RequestMix(self.rng, soak_faults.MODEL, vocab)
        injector = soak_faults.FaultInjector(cluster, random.Random(self.args.seed + 1), self.t0)
        faults_done = threading.Event()
        failure: list[BaseException] = []

        def load() -> None:
            try:
                asyncio.run(self._arrivals(cluster.base_url, mix, faults_done))
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                failure.append(e)

        thread = threading.Thread(target=load, name="soak-load")
        thread.start()
        try:
            self._faults(injector, cluster.base_url)
        finally:
            faults_done.set()
            thread.join()
        if failure:
            raise failure[0]
        return self.now()

    def run(self) -> SoakResult:
        args = self.args
        path = args.model if os.path.exists(args.model) else checkpoint(args.model)
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        app = soak_faults.app_args(path, args.tp, args.num_kv_blocks, args.max_num_seqs)
        checks: list[soak_checks.Check] = []
        with soak_faults.cluster_env():
            cluster = soak_faults.SoakCluster(app, self.log, args.keep_logs)
            try:
                t_start = time.monotonic()
                cluster.start()
                self.log(f"cluster up in {time.monotonic() - t_start:.0f} s: 2 replicas of "
                         f"{path} (TP={args.tp}) at {cluster.base_url}; Ray's logs in "
                         f"{cluster.temp_dir}{'' if args.keep_logs else ' (removed at the end)'}",
                         flush=True)
                self.t0 = time.monotonic()
                sampler = soak_rss.RSSSampler(self.t0, args.rss_period).start()
                try:
                    t_end = self._load(cluster, vocab)
                    sampler.sample_once()
                finally:
                    sampler.stop()
                self.log(f"[{self.now():7.1f} s] load over; checking the idle server",
                         flush=True)
                idle, idle_values = soak_checks.check_idle(cluster.base_url, 2)
                checks.append(idle)
                totals = soak_checks.engine_totals(cluster.base_url)
                checks.append(soak_checks.check_counters(
                    cluster.base_url, soak_faults.MODEL, self.records, self.last_recovery))
            finally:
                t_down = time.monotonic()
                cluster.shutdown()
                self.log(f"cluster shut down in {time.monotonic() - t_down:.0f} s", flush=True)
        if args.history:
            self.write_history(args.history, sampler.samples)
        self.log(f"[{self.now():7.1f} s] the cluster is down; the offline reference for "
                 f"{len(self.records)} requests", flush=True)
        oracle = soak_reference.Oracle(path, soak_faults.engine_kwargs(
            args.tp, args.num_kv_blocks, args.max_num_seqs))
        try:
            refs = oracle.run(self.records)
            self.log(f"[{self.now():7.1f} s] reference done", flush=True)
            exact, prefixes, ties, compared = soak_checks.check_exact(self.records, refs, oracle)
        finally:
            oracle.close()
        in_windows, clean, outside = soak_checks.check_errors(self.records, self.faults, t_end)
        memory = soak_rss.memory_by_kind(sampler.samples, t_end)
        grown = [m for m in memory if m.growth is not None and m.growth > args.rss_bound]
        rss = soak_checks.Check(
            "rss", not grown, f"{len(grown)} process kinds grew more than "
            f"{args.rss_bound:.0%} over the last half", [_memory_line(m) for m in grown])
        kinds = [k for k in args.faults.split(",") if k]
        injected = {f.kind for f in self.faults}
        recovered = all(f.recovered_at is not None for f in self.faults)
        checks = [soak_checks.check_hung(self.records, args.deadline), exact, prefixes, ties,
                  soak_checks.check_well_formed(self.records), in_windows, clean, *checks, rss,
                  soak_checks.Check("faults", set(kinds) <= injected and recovered,
                                    f"{len(self.faults)} injected ({', '.join(sorted(injected))}"
                                    f"), all recovered: {recovered}; skipped: "
                                    f"{self.skipped or 'none'}")]
        summary = self.summary(t_end, compared, outside, idle_values, totals, memory, checks)
        return SoakResult(checks, self.records, self.faults, summary, self.skipped)

    def write_history(self, path: str, samples: list[soak_rss.Sample]) -> None:
        """Every request, fault and RSS sample, one JSON object a line (``type`` says which)."""
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps({"type": "request", **r.to_json()}) + "\n")
            for fault in self.faults:
                f.write(json.dumps({"type": "fault", **asdict(fault)}) + "\n")
            for s in samples:
                f.write(json.dumps({"type": "rss", **asdict(s)}) + "\n")

    def summary(self, t_end: float, compared: int, outside: int, idle: dict,
                totals: dict[str, float], memory: list[soak_rss.KindMemory],
                checks: list[soak_checks.Check]) -> str:
        recs = self.records
        kinds = Counter(r.kind for r in recs)
        ends = Counter(r.end_kind for r in recs)
        exact = next(c for c in checks if c.name == "exact")
        ties = next(c for c in checks if c.name == "ties")
        rows = [
            ("minutes", f"{self.args.minutes:g} planned, load ran {t_end / 60:.2f} "
                        f"({t_end:.0f} s), seed {self.args.seed}"),
            ("requests", f"{len(recs)}; ends: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(ends.items()))),
            *(("", f"{kind:<12} {n:5d}: " + ", ".join(
                f"{end} {c}" for end, c in sorted(Counter(
                    r.end_kind for r in recs if r.kind == kind).items())))
              for kind, n in sorted(kinds.items())),
            ("faults", f"{len(self.faults)} injected" + (f"; skipped {self.skipped}"
                                                         if self.skipped else "")),
            *(("", f"{f.line()}; {_errors_in(recs, f, t_end)} errors in its window")
              for f in self.faults),
            ("hung", str(ends.get("timeout", 0) + ends.get("", 0))),
            ("token mismatches", f"{len(exact.lines)} of {compared} finished requests compared; "
                                 f"{len(ties.lines)} divergences at a tie (tolerated)"),
            ("errors", f"{ends.get('error', 0) + ends.get('unclean', 0)} "
                       f"({outside} outside fault windows, {ends.get('unclean', 0)} unclean)"),
            ("KV usage at end", json.dumps(idle.get("kv_cache_usage_perc", {}))),
            ("running at end", json.dumps(idle.get("num_requests_running", {}))),
            ("engine counters", "the live replicas' (they restart with a replaced replica): "
                                + ", ".join(f"{k} {v:g}" for k, v in totals.items())),
        ]
        lines = ["", "== soak summary ==", *(f"{k:<18} {v}" for k, v in rows), "",
                 f"{'RSS (MB)':<12} {'start':>8} {'middle':>8} {'end':>8} {'growth, last half':>18}"]
        lines += [_memory_line(m) for m in memory]
        lines += ["", "the longest-lived process of each kind, RSS at each fifth of its life:"]
        lines += [f"{m.kind:<12} {m.longest}" for m in memory]
        lines += ["", *(c.text() for c in checks)]
        return "\n".join(lines)


def _errors_in(records: list[soak_history.Record], fault: soak_faults.Fault,
               t_end: float) -> int:
    """Requests that ended in an error and were in flight in ``fault``'s window."""
    (window,) = soak_checks.fault_windows([fault], t_end)
    return sum(1 for r in records if r.end_kind in ("error", "unclean")
               and soak_checks.in_flight(r, window, t_end))


def _memory_line(m: soak_rss.KindMemory) -> str:
    growth = "n/a" if m.growth is None else f"{m.growth:+.1%}"
    return (f"{m.kind:<12} {m.start_mb:8.0f} {m.mid_mb:8.0f} {m.end_mb:8.0f} {growth:>18}  "
            f"({m.how})")


def main(argv: list[str] | None = None, log=print) -> SoakResult:
    result = Soak(parse_args(argv), log).run()
    log(result.summary, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
