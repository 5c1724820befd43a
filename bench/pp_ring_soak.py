"""Soak of the async PP ring's order of operations (docs/architecture.md §4), without Ray.

    python bench/pp_ring_soak.py [--rounds 500] [--tp T --pp P] [--cpu] [--timeout-s S]

Under async scheduling a stage that does not sample posts the receive of each step's
sampled-id broadcast (PP broadcast group) right after its forward, before it sends its
hidden states (PP group), and leaves it pending for pp_size steps while the next steps' TP
all-reduces and hidden-state hops run. NCCL calls concurrent operations on several
communicators deadlock-prone: this runs that order for many rounds through raylm's own
bootstrap (init_distributed_environment), transport (build_pp_transport, as the worker
builds it) and SampledTokenRing, and checks every value, so a mixed-up message fails it as
surely as a hang. Layout: tp=2 pp=2 on >= 4 GPUs, tp=1 pp=2 on 2-3 GPUs; otherwise gloo
on CPU (--tp/--pp, default 2 x 2). Prints one PASS/FAIL line; exit status 0/1.

Round k (t tokens, r requests, from schedule(k); some rounds are empty), stage s of p:
  1. s > 0, t > 0: receive round k's hidden states and residual from stage s - 1;
  2. s < p - 1: take round k - p's slot out of the ring, wait for its ids, check them;
  3. t == 0: s < p - 1 puts an empty slot; the round ends (nothing travels);
  4. forward: check what arrived; all-reduce a [t, hidden] tensor over the TP group;
     hidden + 1, residual - 1;
  5. s < p - 1: post the receive of round k's broadcast into the ring, then send the
     hidden states to stage s + 1; s = p - 1: "sample" r ids and broadcast them.
After the last round the stages wait for the p receives still in the ring.

Import run_soak() with bench/ on sys.path: the spawned ranks import this module by name.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

PHASES = ("init", "recv hidden", "take ids", "forward", "post ids recv", "send hidden",
          "broadcast ids", "wait device", "drain", "done")
CHECKS = ("hidden states", "residual", "TP all-reduce", "sampled ids")
INJECT = ("ids", "hidden", "stall")  # faults, so the checks can be seen to fail
VOCAB = 128256


@dataclass(frozen=True)
class SoakConfig:
    tp: int
    pp: int
    rounds: int
    device: str  # "cuda" (nccl) or "cpu" (gloo)
    hidden: int
    dtype: str
    max_reqs: int
    max_extra: int
    timeout_s: float
    inject: str | None = None
    inject_round: int = -1


@dataclass(frozen=True)
class SoakResult:
    ok: bool
    line: str  # the PASS / FAIL line
    ranks: int
    tp: int
    pp: int
    backend: str
    rounds: int
    seconds: float


def schedule(k: int, max_reqs: int, max_extra: int) -> tuple[int, int]:
    """(tokens, requests) of round k: decodes, every third round a prefill chunk on top,
    every 13th round empty (the ring advances on empty steps too)."""
    if k % 13 == 12:
        return 0, 0
    reqs = 1 + (5 * k) % max_reqs
    return reqs + ((37 * k) % (max_extra + 1) if k % 3 == 0 else 0), reqs


# What stage s receives in round k. Values stay within +-128: exact in bf16 and fp16.
def hidden_value(k, s, tp_rank, t, h, dtype, device):
    i = torch.arange(t * h, device=device).view(t, h)
    return ((i + 31 * k + 7 * tp_rank) % 61 + s).to(dtype)


def residual_value(k, s, tp_rank, t, h, dtype, device):
    i = torch.arange(t * h, device=device).view(t, h)
    return ((3 * i + 11 * k + 5 * tp_rank) % 53 - 26 - s).to(dtype)


def sampled_ids(k, r, tp_rank, device):
    return ((torch.arange(r, device=device) * 7919 + 104729 * k + 13 * tp_rank) % VOCAB).view(r, 1)


def _soak_rank(rank: int, cfg: SoakConfig, init: str, progress) -> dict:
    import torch.distributed as dist

    from raylm.parallel.distributed import init_distributed_environment
    from raylm.parallel.pp_comm import build_pp_transport
    from raylm.runner.models.llama import IntermediateTensors
    from raylm.runner.pp_ring import SampledTokenRing
    from raylm.scheduler.core_outputs import CachedRequestData, SchedulerOutput

    def at(k: int, phase: str) -> None:  # read by the parent when the soak times out
        progress[2 * rank], progress[2 * rank + 1] = k, PHASES.index(phase)

    if cfg.device == "cpu":
        torch.set_num_threads(1)
    ctx = init_distributed_environment(
        world_size=cfg.tp * cfg.pp, rank=rank, distributed_init_method=init,
        tensor_parallel_size=cfg.tp, pipeline_parallel_size=cfg.pp, local_rank=rank,
        timeout_s=cfg.timeout_s, expect_cuda=cfg.device == "cuda")
    dtype, dev, s, tpr, p = getattr(torch, cfg.dtype), ctx.device, ctx.pp_rank, ctx.tp_rank, cfg.pp
    transport = build_pp_transport(ctx, cfg.hidden, dtype, IntermediateTensors, cfg.timeout_s)
    last = ctx.is_last_pp_rank
    req_ids = [f"r{i}" for i in range(cfg.max_reqs)]
    ring = None if last else SampledTokenRing(p, cfg.max_reqs)
    for rid in req_ids if ring is not None else ():
        ring.add_request(rid)
    # Device-side flags, read once at the end: a host sync per check would serialize what
    # the engine overlaps, and hide the very interleavings this soaks.
    bad = torch.zeros((cfg.rounds, len(CHECKS)), dtype=torch.int32, device=dev)

    def check(k, what, got, want):
        bad[k, CHECKS.index(what)] += (got != want).any()

    def check_ids(j, pending, payload, req_id_to_index):
        r = schedule(j, cfg.max_reqs, cfg.max_extra)[1]
        assert payload == j, f"ring slot of round {payload} delivered as round {j}"
        assert req_id_to_index == {rid: i for i, rid in enumerate(req_ids[:r])}, req_id_to_index
        check(j, "sampled ids", pending.wait(), sampled_ids(j, r, tpr, dev))

    def injected(k, what, stage):
        return cfg.inject == what and k == cfg.inject_round and s == stage and tpr == 0

    events: deque = deque()
    start = time.monotonic()
    for k in range(cfg.rounds):
        t, r = schedule(k, cfg.max_reqs, cfg.max_extra)
        per_req = {rid: (t - r + 1 if i == 0 else 1) for i, rid in enumerate(req_ids[:r])}
        so = SchedulerOutput(k, [], CachedRequestData(), per_req, t)
        got = None
        if s > 0 and t:  # the worker receives before execute_model takes from the ring
            at(k, "recv hidden")
            got = transport.recv_intermediate(so)
        if ring is not None:
            at(k, "take ids")
            delivery = ring.take()
            if delivery is not None:
                check_ids(delivery.step_index, delivery.pending, delivery.payload,
                          delivery.req_id_to_index)
        if t == 0:
            if ring is not None:
                ring.put(None)
        else:
            at(k, "forward")
            if got is None:
                h = hidden_value(k, 0, tpr, t, cfg.hidden, dtype, dev)
                res = residual_value(k, 0, tpr, t, cfg.hidden, dtype, dev)
            else:
                h, res = got.hidden_states, got.residual
                check(k, "hidden states", h, hidden_value(k, s, tpr, t, cfg.hidden, dtype, dev))
                check(k, "residual", res, residual_value(k, s, tpr, t, cfg.hidden, dtype, dev))
            if ctx.tp_group is not None:  # a TP forward all-reduces: a third communicator
                x = torch.full((t, cfg.hidden), tpr + 1, dtype=dtype, device=dev)
                dist.all_reduce(x, group=ctx.tp_group)
                check(k, "TP all-reduce", x, torch.full_like(x, cfg.tp * (cfg.tp + 1) // 2))
            h, res = h + 1, res - 1
            if not last:
                at(k, "post ids recv")
                ring.put(transport.recv_sampled_token_ids(r),
                         {rid: i for i, rid in enumerate(req_ids[:r])}, payload=k)
                if injected(k, "hidden", 0):
                    h[0, 0] += 100
                at(k, "send hidden")
                transport.send_intermediate(IntermediateTensors(h, res))
            else:
                ids = sampled_ids(k, r, tpr, dev)
                if injected(k, "ids", p - 1):
                    ids[r - 1, 0] += 1
                at(k, "broadcast ids")
                while injected(k, "stall", p - 1):
                    time.sleep(1)
                transport.broadcast_sampled_token_ids(ids)
        if dev.type == "cuda":  # the EngineCore holds the host p + 1 steps ahead at most
            events.append(torch.cuda.Event())
            events[-1].record()
            if len(events) > p + 1:
                at(k, "wait device")
                events.popleft().synchronize()
    at(cfg.rounds, "drain")
    for slot in ring.pending_slots() if ring is not None else ():
        check_ids(slot.step_index, slot.pending, slot.payload,
                  dict(zip(slot.req_ids, slot.indices.tolist())))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.monotonic() - start
    flagged = bad.nonzero().tolist()
    dist.barrier()  # every message delivered before any rank leaves
    at(cfg.rounds, "done")
    transport.close()
    dist.destroy_process_group()
    return {"rank": rank, "seconds": seconds, "flagged": flagged}


def _rank_main(rank: int, cfg: SoakConfig, init: str, progress, results) -> None:
    if cfg.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch first touches CUDA: gloo
    try:
        results.put(_soak_rank(rank, cfg, init, progress))
    except BaseException as e:
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}",
                     "tb": traceback.format_exc()})
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip teardown: a broken NCCL/gloo group can hang or abort in it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_soak(tp: int = 2, pp: int = 2, rounds: int = 500, *, device: str = "cpu",
             hidden: int | None = None, max_reqs: int = 8, max_extra: int | None = None,
             dtype: str | None = None, timeout_s: float = 300.0, inject: str | None = None,
             inject_round: int = -1) -> SoakResult:
    """Spawn tp * pp ranks on 127.0.0.1 and soak the ring; never raises for a failed soak.
    ``inject``: corrupt one id ("ids", last stage) or one hidden value ("hidden", stage 0)
    of ``inject_round``, or stall the last stage there ("stall"), all on TP rank 0."""
    world, gpu = tp * pp, device == "cuda"
    if pp < 2 or tp < 1 or rounds < 1:
        raise ValueError(f"needs pp >= 2, tp >= 1, rounds >= 1; got tp={tp} pp={pp} "
                         f"rounds={rounds}")
    if gpu and torch.cuda.device_count() < world:
        raise ValueError(f"tp={tp} pp={pp} needs {world} GPUs, found {torch.cuda.device_count()}")
    cfg = SoakConfig(tp, pp, rounds, device, hidden or (4096 if gpu else 64),
                     dtype or ("bfloat16" if gpu else "float32"), max_reqs,
                     max_extra if max_extra is not None else (512 if gpu else 16), timeout_s,
                     inject, inject_round)
    if inject is not None and (inject not in INJECT or not 0 <= inject_round < rounds
                               or schedule(inject_round, max_reqs, cfg.max_extra)[0] == 0):
        raise ValueError(f"inject must be one of {INJECT} at a non-empty round < {rounds}, "
                         f"got {inject!r} at {inject_round}")
    backend = "nccl" if gpu else "gloo"
    spawn = mp.get_context("spawn")  # CUDA cannot fork; gloo does not mind
    progress = spawn.Array("q", 2 * world, lock=False)
    results = spawn.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [spawn.Process(target=_rank_main, args=(r, cfg, init, progress, results), daemon=True)
             for r in range(world)]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    reports: dict[int, dict] = {}
    why = None
    while len(reports) < world and why is None:
        try:
            item = results.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, proc.exitcode) for r, proc in enumerate(procs)
                    if r not in reports and proc.exitcode not in (None, 0)]
            if dead:
                why = f"rank {dead[0][0]} died with exit code {dead[0][1]}"
            elif time.monotonic() - start > timeout_s:
                stuck = []
                for r in sorted(set(range(world)) - set(reports)):
                    k, phase = progress[2 * r], PHASES[progress[2 * r + 1]]
                    if phase == "wait device":
                        phase += f" (round {k - pp - 1})"
                    stuck.append(f"rank {r} (stage {r // tp}, tp {r % tp}) at round {k} in {phase}")
                why = f"timed out after {timeout_s:g} s: " + "; ".join(stuck)
            continue
        reports[item["rank"]] = item
        if "error" in item:  # the first error is the cause; its peers would only hang
            why = f"rank {item['rank']}: {item['error']}"
            print(item["tb"], file=sys.stderr)
    seconds = time.monotonic() - start
    for proc in procs:
        if proc.is_alive() and why is not None:
            proc.kill()
        proc.join(timeout=30)
    if why is None:
        flagged = sorted((j, c, r) for r, rep in reports.items() for j, c in rep["flagged"])
        if flagged:
            j, c, r = flagged[0]
            why = f"round {j}: {CHECKS[c]} wrong on rank {r} (stage {r // tp}, tp {r % tp})"
            if CHECKS[c] == "sampled ids":
                why += f", broadcast at round {j}, consumed at round {j + pp}" if j + pp < rounds \
                    else f", broadcast at round {j}, consumed after the last round"
            why += f"; {len(flagged)} wrong check(s) in all"
    shape = f"{world} ranks tp={tp} pp={pp} backend={backend} rounds={rounds}"
    if why is None:
        loop = max(rep["seconds"] for rep in reports.values())
        line = f"PASS pp_ring_soak: {shape} in {seconds:.1f} s (ring loop {loop:.1f} s)"
    else:
        line = f"FAIL pp_ring_soak: {why} ({shape}, after {seconds:.1f} s)"
    return SoakResult(why is None, line, world, tp, pp, backend, rounds, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--tp", type=int, help="default: 2 (1 on 2-3 GPUs)")
    ap.add_argument("--pp", type=int, help="default: 2")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even with GPUs")
    ap.add_argument("--hidden", type=int, help="default: 4096 on GPU, 64 on CPU")
    ap.add_argument("--max-reqs", type=int, default=8)
    ap.add_argument("--max-extra", type=int, help="prefill rows on top of the decodes, "
                    "every third round (default: 512 on GPU, 16 on CPU)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--inject", choices=INJECT, help="fault injection (see run_soak)")
    ap.add_argument("--inject-round", type=int, default=-1)
    args = ap.parse_args(argv)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    device = "cuda" if gpus >= 2 else "cpu"  # NCCL allows one rank per GPU
    tp = args.tp or (2 if device == "cpu" or gpus >= 4 else 1)
    try:
        result = run_soak(tp, args.pp or 2, args.rounds, device=device, hidden=args.hidden,
                          max_reqs=args.max_reqs, max_extra=args.max_extra,
                          timeout_s=args.timeout_s,
                          inject=args.inject, inject_round=args.inject_round)
    except ValueError as e:
        print(f"FAIL pp_ring_soak: {e}", flush=True)
        return 1
    print(result.line, flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
