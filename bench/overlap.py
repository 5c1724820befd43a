"""Does async scheduling hide the CPU behind the device? A reproducible overlap benchmark.

A simulated device takes a fixed ``t_device`` per step on a virtual clock: a step starts
when it has been submitted and the previous step has finished, and ends ``t_device``
later, whatever the host does meanwhile. The real Scheduler and EngineCore drive it on a
realistic request mix. Two ways for the host to learn that a step ended:

- ``event`` (the main figure): the host blocks on the step's completion like
  ``cudaEventSynchronize``, a ``time.sleep`` until the step's end that releases the GIL.
  A GPU finishes without the host's help, and so does this device.
- ``thread``: a device thread sleeps until each step's end and resolves its future, so
  every result crosses threads (lock, futex wake-up, GIL hand-off), as in the in-process
  CPU executor (the script prints how late that hand-off delivers each result).

In both, the fake model's bookkeeping (who samples this step, the runner's share of host
work) runs on the host thread at submission, so it belongs to ``t_cpu`` like the rest.

The figures come from the steady state: from the first step until the last waiting request
is admitted, the batch is full and every finished request is replaced at once, as on a
loaded server. After that the batch drains and the host's time per step falls several-fold;
averaged into one ``t_cpu`` that tail would put a "1.0x" device below the host's time on
most steps, and ``1 / max(t_device, t_cpu)`` assumes one ``t_cpu`` for all steps.
The whole run's async/sync ratio is printed too.

1. Calibrate: run synchronously against an instant device and measure the host thread's
   CPU time per steady-state step, ``t_cpu`` (schedule + the runner's bookkeeping + update
   + loop).
2. For ``t_device`` = 1.0x, 1.5x, 3x and 0.5x ``t_cpu``, run sync and async with each
   device model and report steady-state steps/s against the ideal
   ``1 / max(t_device, t_cpu)`` (sync can at best reach ``1 / (t_device + t_cpu)``).

Usage: ``python bench/overlap.py [--requests 256] [--seed 0] [--repeat 3]`` (best of N).
The last line is ``overlap: sync=<steps/s> async=<steps/s> ideal=<steps/s>
efficiency=<0..1>`` for the main case: the event device at ``t_device = t_cpu``, the tightest
point where the device is not faster than the host.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.core.engine_core import EngineCore
from raylm.scheduler.core_outputs import ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.request import Request
from raylm.scheduler.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 8192
MAX_MODEL_LEN = 1024
TOKEN = 7  # every sampled token (requests ignore EOS)
FACTORS = (1.0, 1.5, 3.0, 0.5)  # t_device / t_cpu
MAIN = ("event", 1.0)


class FakeModel:
    """The worker's per-request bookkeeping, just enough to know who samples this step."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}  # prompt + sampled, as the device knows it
        self.busy_s = 0.0  # CPU time spent here

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.thread_time()
        known = self.num_tokens
        for rid in so.finished_req_ids:
            known.pop(rid, None)
        for rid in so.preempted_req_ids:
            known.pop(rid, None)
        computed: dict[str, int] = {}
        for nd in so.scheduled_new_reqs:
            known[nd.req_id] = len(nd.prompt_token_ids) + len(nd.output_token_ids)
            computed[nd.req_id] = nd.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            if computed[rid] + n >= known[rid]:  # reached the last known token: sample
                known[rid] += 1
                sampled.append([TOKEN])
            else:
                sampled.append([])
        out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        self.busy_s += time.thread_time() - t0
        return out


def _tight_timer_slack() -> None:
    """Linux oversleeps by its 50 us default timer slack; a device is punctual. Threads
    inherit the setting, so calling it once at start covers the host and the device."""
    try:
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK = 29, 1 ns
    except (OSError, AttributeError):
        pass


class StepFuture(Future):
    """One step's result, due at ``end`` on the device's clock."""

    def __init__(self, device: SimulatedDevice, end: float, output: ModelRunnerOutput) -> None:
        super().__init__()
        self.device = device
        self.end = end
        self.output = output  # computed at submit; handed over at ``end``
        self.seen = False

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        out = self._wait(timeout)
        if not self.seen:  # how long after ``end`` the host got the result
            self.seen = True
            self.device.late_s += max(0.0, time.perf_counter() - self.end)
        return out

    def _wait(self, timeout: float | None) -> ModelRunnerOutput:
        return super().result(timeout)


class EventFuture(StepFuture):
    """Resolved when the clock passes ``end``, with no other thread involved."""

    def done(self) -> bool:
        return time.perf_counter() >= self.end

    def _wait(self, timeout: float | None) -> ModelRunnerOutput:
        delay = self.end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, like an event wait
        return self.output


class SimulatedDevice:
    """Executor protocol over a virtual device clock; ``model`` is ``event`` or ``thread``."""

    supports_async_scheduling = True

    def __init__(self, t_device: float, model: str = "event") -> None:
        if model not in ("event", "thread"):
            raise ValueError(f"device model must be 'event' or 'thread', got {model!r}")
        self.t_device = t_device
        self.threaded = model == "thread" and t_device > 0
        self.model = FakeModel()
        self._free_at = 0.0  # when the device finishes its last submitted step
        self._queue: deque[StepFuture] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.num_steps = 0
        self.idle_s = 0.0  # device waiting for the host to submit the next step
        self.late_s = 0.0  # host picking results up after their step's end

    @property
    def free_at(self) -> float:
        return self._free_at

    def determine_num_kv_blocks(self) -> int:
        return NUM_BLOCKS

    def device_info(self) -> dict:
        return {"kind": "simulated", "name": "virtual clock", "count": 1}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.threaded:
            threading.Thread(target=self._loop, daemon=True).start()

    def execute_model(self, so: SchedulerOutput, non_block: bool = False):
        self.num_steps += 1
        now = time.perf_counter()  # submitted: the fake model's bookkeeping is not the host's
        output = self.model.run(so)
        if self._free_at and now > self._free_at:
            self.idle_s += now - self._free_at  # the host was late
        self._free_at = end = max(now, self._free_at) + self.t_device
        if self.threaded:
            fut = StepFuture(self, end, output)
            with self._cv:
                self._queue.append(fut)
                self._cv.notify()
        elif self.t_device == 0:  # instant device: calibrate t_cpu
            fut = StepFuture(self, end, output)
            fut.set_result(output)
        else:
            fut = EventFuture(self, end, output)
        return fut if non_block else fut.result()

    def _loop(self) -> None:
        """The thread model: resolve each future from the device thread at its end."""
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                fut = self._queue.popleft()
            delay = fut.end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            fut.set_result(fut.output)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()


def make_config(async_scheduling: bool) -> EngineConfig:
    model = ModelConfig(model="simulated", max_model_len=MAX_MODEL_LEN, hf_config={
        "architectures": ["LlamaForCausalLM"], "max_position_embeddings": MAX_MODEL_LEN,
        "vocab_size": 32000})
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                                         async_scheduling=async_scheduling),
        parallel_config=ParallelConfig(),
    )


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def make(cls, num_requests: int, seed: int) -> Workload:
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(16, 512))]
                   for _ in range(num_requests)]
        return cls(prompts, [rng.randint(16, 256) for _ in range(num_requests)])

    def requests(self) -> list[Request]:
        return [Request(f"req-{i}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
                        frozenset({2}), MAX_MODEL_LEN, sampling_seed=i)
                for i, (p, m) in enumerate(zip(self.prompts, self.max_tokens))]


@dataclass(frozen=True)
class Span:
    """Counters from the first step up to one point of a run."""

    steps: int
    wall_s: float
    cpu_s: float  # CPU time of the host thread
    runner_s: float  # of which the fake model's bookkeeping
    device_idle_s: float
    late_s: float

    @classmethod
    def take(cls, device: SimulatedDevice, t0: float, c0: float) -> Span:
        # Wall time runs until the device has finished every step submitted so far: async
        # has one step ahead in flight, and it must not count before it is done.
        end = max(time.perf_counter(), device.free_at)
        return cls(device.num_steps, end - t0, time.thread_time() - c0,
                   device.model.busy_s, device.idle_s, device.late_s)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s


@dataclass(frozen=True)
class Result:
    steady: Span  # until the last waiting request was admitted
    whole: Span
    generated: int


def run(workload: Workload, async_scheduling: bool, t_device: float,
        model: str = "event") -> Result:
    device = SimulatedDevice(t_device, model)
    engine = EngineCore(make_config(async_scheduling), device)
    for r in workload.requests():
        engine.add_request(r)
    # As an engine process does once it is up: nothing collectable is left from earlier
    # runs, and what lives now is never scanned again. Collections of what the run itself
    # allocates still happen, on the host's time, as they would in a server.
    gc.collect()
    gc.freeze()
    generated = 0
    steady = None
    t0, c0 = time.perf_counter(), time.thread_time()
    while engine.has_work():
        out, _ = engine.step_fn()
        if out is not None:
            generated += sum(len(o.new_token_ids) for o in out.outputs)
        if steady is None and not engine.scheduler.waiting:
            steady = Span.take(device, t0, c0)
    whole = Span.take(device, t0, c0)
    engine.shutdown()
    gc.unfreeze()
    expected = sum(workload.max_tokens)
    assert generated == expected, f"generated {generated} tokens, expected {expected}"
    return Result(steady, whole, generated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per point")
    args = parser.parse_args()
    _tight_timer_slack()
    workload = Workload.make(args.requests, args.seed)
    p = [len(x) for x in workload.prompts]
    print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} "
          "(a loaded machine inflates every number)")
    print(f"workload: {args.requests} requests, prompt {min(p)}-{max(p)} tokens "
          f"(mean {sum(p) / len(p):.0f}), max_tokens {min(workload.max_tokens)}-"
          f"{max(workload.max_tokens)} (mean {sum(workload.max_tokens) / len(p):.0f}), "
          f"max_num_seqs 64, max_num_batched_tokens 2048, block_size {BLOCK_SIZE}")

    run(workload, False, 0.0)  # warm-up
    # Best of N everywhere: other processes only ever make a run slower.
    # CPU time, not wall time: waiting for a core on a busy machine is not scheduler work.
    calib = min((run(workload, False, 0.0).steady for _ in range(args.repeat)),
                key=lambda s: s.cpu_s / s.steps)
    t_cpu = calib.cpu_s / calib.steps
    print(f"calibration: steady state {calib.steps} steps, t_cpu = {t_cpu * 1e6:.0f} us/step "
          f"of host CPU time (of which the fake model's bookkeeping "
          f"{calib.runner_s / calib.steps * 1e6:.0f} us; wall {calib.wall_s / calib.steps * 1e6:.0f} us)")
    print(f"{'device':>6} {'t_device':>10} {'sync st/s':>10} {'async st/s':>11} {'ideal':>9} "
          f"{'sync bound':>11} {'efficiency':>10} {'speedup':>8} {'cpu share':>9} "
          f"{'dev idle':>8} {'late us':>7} {'whole run':>9}")
    main_line = ""
    for model in ("event", "thread"):
        for factor in FACTORS:
            t_device = factor * t_cpu
            sync, asyn = (max((run(workload, a, t_device, model) for _ in range(args.repeat)),
                              key=lambda r: r.steady.steps_per_s) for a in (False, True))
            s, a = sync.steady, asyn.steady
            ideal = 1.0 / max(t_device, t_cpu)
            efficiency = a.steps_per_s / ideal
            print(f"{model:>6} {factor:>4.1f}x t_cpu {s.steps_per_s:>10.0f} "
                  f"{a.steps_per_s:>11.0f} {ideal:>9.0f} {1.0 / (t_device + t_cpu):>11.0f} "
                  f"{efficiency:>10.2f} {a.steps_per_s / s.steps_per_s:>8.2f} "
                  f"{t_cpu / (t_cpu + t_device):>9.2f} {a.device_idle_s / a.wall_s:>8.2f} "
                  f"{a.late_s / a.steps * 1e6:>7.0f} "
                  f"{asyn.whole.steps_per_s / sync.whole.steps_per_s:>9.2f}")
            if (model, factor) == MAIN:
                main_line = (f"overlap: sync={s.steps_per_s:.0f} async={a.steps_per_s:.0f} "
                             f"ideal={ideal:.0f} efficiency={efficiency:.2f}")
    print(main_line)


if __name__ == "__main__":
    main()
