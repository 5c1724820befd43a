"""Per-step dispatch overhead from an executor to 2 Ray worker actors.

    python bench/dispatch.py [--steps 2000] [--reqs 32] [--skip-model]

No-op steps (a decode SchedulerOutput of ``--reqs`` running requests; the output rank
returns one token per request) through:
- ``ray-call``   RayExecutor(dispatch="ray"): one Ray actor call per worker per step
- ``compiled``   a Ray Compiled Graph (InputNode -> MultiOutputNode, shared-memory channels,
                 ``_max_inflight_executions=2``) over equivalent no-op actors
- ``channel``    RayExecutor(dispatch="channel"): the step stream (what raylm uses)
each with one step in flight ("sync") and two ("async", as under async scheduling).
Then the tiny model (TP=2) through the real EngineCore with each RayExecutor dispatch, and
TP=1 in process as the no-dispatch reference: ms per engine step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402

from raylm.actors.ray_executor import RayExecutor  # noqa: E402
from raylm.scheduler.config.engine_config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.core_outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput  # noqa: E402


class NoopWorker:
    """Stands in for raylm.runner.worker.Worker: no model, no collectives."""

    def __init__(self, engine_config, rank=0, local_rank=0, distributed_init_method=None):
        self.rank = rank

    def init_device(self, ctx=None, num_threads=None):
        pass

    def load_model(self):
        pass

    def determine_num_kv_blocks(self):
        return 1024

    def initialize_kv_cache(self, num_blocks):
        pass

    def execute_model(self, scheduler_output):
        return noop_output(scheduler_output)

    def check_health(self):
        pass

    def shutdown(self):
        pass


def noop_output(so: SchedulerOutput) -> ModelRunnerOutput:
    ids = so.scheduled_cached_reqs.req_ids
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])


@ray.remote
class CompiledGraphWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self, so: SchedulerOutput):
        out = noop_output(so)
        return out if self.rank == 0 else None


def decode_step(step_id: int, num_reqs: int) -> SchedulerOutput:
    ids = [f"req-{i}" for i in range(num_reqs)]
    cached = CachedRequestData(req_ids=ids, new_block_ids=[[] for _ in ids],
                               num_computed_tokens=[100 + step_id] * num_reqs,
                               new_token_ids=[[] for _ in ids])
    return SchedulerOutput(step_id=step_id, scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={r: 1 for r in ids},
                           total_num_scheduled_tokens=num_reqs)


def time_steps(submit, wait, steps: int, in_flight: int, num_reqs: int) -> float:
    """us per step with ``in_flight`` steps outstanding; checks every result."""
    pending: deque = deque()

    def settle() -> None:
        out = wait(pending.popleft())
        assert len(out.sampled_token_ids) == num_reqs, out

    for i in range(50):  # warm-up
        pending.append(submit(decode_step(i, num_reqs)))
        if len(pending) >= in_flight:
            settle()
    while pending:
        settle()
    start = time.perf_counter()
    for i in range(steps):
        pending.append(submit(decode_step(i, num_reqs)))
        if len(pending) >= in_flight:
            settle()
    while pending:
        settle()
    return (time.perf_counter() - start) / steps * 1e6


def bench_executor(config: EngineConfig, dispatch: str, steps: int, num_reqs: int) -> list[float]:
    ex = RayExecutor(config, dispatch=dispatch, worker_cls=NoopWorker)
    try:
        return [time_steps(lambda so: ex.execute_model(so, non_block=True),
                           lambda f: f.result(timeout=60), steps, k, num_reqs) for k in (1, 2)]
    finally:
        ex.shutdown()


def bench_compiled_graph(steps: int, num_reqs: int) -> tuple[list[float], float]:
    from ray.dag import InputNode, MultiOutputNode

    workers = [CompiledGraphWorker.options(num_cpus=1).remote(r) for r in range(2)]
    with InputNode() as inp:
        dag = MultiOutputNode([w.step.bind(inp) for w in workers])
    start = time.perf_counter()
    cdag = dag.experimental_compile(_max_inflight_executions=2)
    compile_s = time.perf_counter() - start
    try:
        return [time_steps(cdag.execute, lambda refs: ray.get(refs)[0], steps, k, num_reqs)
                for k in (1, 2)], compile_s
    finally:
        cdag.teardown()
        for w in workers:
            ray.kill(w)


def _drain(core) -> list:
    """Step the EngineCore from this thread until it is idle; its outputs."""
    outputs = []
    while core.has_work():
        step_outputs, _ = core.step_fn()
        if step_outputs is not None:
            outputs.extend(step_outputs.outputs)
    return outputs


def bench_model(path: str, num_reqs: int, max_tokens: int) -> list[tuple[str, float, int]]:
    from raylm.runner.uniproc_executor import UniProcExecutor
    from raylm.scheduler.core.engine_core import EngineCore
    from raylm.scheduler.request import Request
    from raylm.scheduler.sampling_params import SamplingParams

    rows = []
    for name, tp, dispatch in (("TP=1 in process", 1, None), ("TP=2 ray-call", 2, "ray"),
                               ("TP=2 channel", 2, "channel")):
        config = EngineConfig(ModelConfig(model=path), CacheConfig(enable_prefix_caching=False),
                              SchedulerConfig(max_num_seqs=num_reqs),
                              ParallelConfig(tensor_parallel_size=tp,
                                             distributed_executor_backend="ray" if tp > 1 else "uni"))
        executor = (UniProcExecutor(config, num_threads=1) if dispatch is None
                    else RayExecutor(config, dispatch=dispatch))
        core = EngineCore(config, executor)
        try:
            for i in range(num_reqs):
                core.add_request(Request(
                    f"r{i}", [10 + i, 20, 30, 40], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                  ignore_eos=True),
                    eos_token_ids=frozenset(), max_model_len=config.model_config.max_model_len,
                    sampling_seed=i))
            start = time.perf_counter()
            n_tokens = sum(len(o.new_token_ids) for o in _drain(core))
            seconds = time.perf_counter() - start
            n_steps = core.scheduler.counters.num_steps
            assert n_tokens == num_reqs * max_tokens, n_tokens
            rows.append((name, seconds / n_steps * 1e3, n_steps))
        finally:
            core.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reqs", type=int, default=32)
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    from raylm.runner.loading.checkpoint import SPECS, write_random_checkpoint

    path = write_random_checkpoint(tempfile.mkdtemp(prefix="raylm-dispatch-"), SPECS["tiny"])
    config = EngineConfig(ModelConfig(model=path), CacheConfig(), SchedulerConfig(),
                          ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray"))
    print(f"ray {ray.__version__}, {os.cpu_count()} cores; 2 workers; no-op decode steps of "
          f"{args.reqs} requests; {args.steps} steps each")
    print(f"| {'dispatch':<10} | {'us/step, 1 in flight':>21} | {'us/step, 2 in flight':>21} |")
    print(f"|{'-' * 12}|{'-' * 23}|{'-' * 23}|")
    results = {"ray-call": bench_executor(config, "ray", args.steps, args.reqs)}
    try:
        results["compiled"], compile_s = bench_compiled_graph(args.steps, args.reqs)
    except Exception as e:  # report, don't hide: the choice depends on it
        print(f"compiled graph failed on this Ray/CPU setup: {type(e).__name__}: {e}")
        compile_s = float("nan")
    results["channel"] = bench_executor(config, "channel", args.steps, args.reqs)
    for name, (one, two) in results.items():
        print(f"| {name:<10} | {one:>21.0f} | {two:>21.0f} |")
    print(f"(compiled graph: {compile_s:.1f}s to compile)")
    best = min(results, key=lambda k: results[k][1])
    print(f"fastest with 2 in flight: {best}; RayExecutor default: channel")
    if not args.skip_model:
        print(f"\ntiny model (TP=2 over gloo), real EngineCore, async scheduling, "
              f"{args.reqs} requests x 64 tokens:")
        print(f"| {'executor':<16} | {'ms/step':>8} | {'steps':>6} |")
        print(f"|{'-' * 18}|{'-' * 10}|{'-' * 8}|")
        for name, ms, n in bench_model(path, args.reqs, 64):
            print(f"| {name:<16} | {ms:>8.2f} | {n:>6} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
