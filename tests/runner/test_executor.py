"""UniProcExecutor and Worker: ordered futures, failure handling, KV sizing, end to end."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import pytest
from conftest import BLOCK_SIZE, NUM_BLOCKS, engine_config, hf_greedy, random_prompts
from step_driver import StepDriver

from raylm.runner.async_output import AsyncModelRunnerOutput
from raylm.runner.uniproc_executor import UniProcExecutor
from raylm.runner.worker import Worker
from raylm.scheduler.config.engine_config import CacheConfig
from raylm.scheduler.core.executor_base import EngineDeadError, Executor
from raylm.scheduler.core_outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from raylm.scheduler.sampling_params import SamplingParams


class _SlowOutput(AsyncModelRunnerOutput):
    """An AsyncModelRunnerOutput whose get_output() takes a random time."""

    def __init__(self, step_id: int, delay: float) -> None:
        self.step_id, self.delay = step_id, delay

    def get_output(self) -> ModelRunnerOutput:
        time.sleep(self.delay)
        return ModelRunnerOutput([str(self.step_id)], {str(self.step_id): 0}, [[self.step_id]])


class _FakeWorker:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.executed: list[int] = []
        self.dead = None

    def execute_model(self, so):
        if so.step_id == self.fail_at:
            raise RuntimeError(f"boom at step {so.step_id}")
        self.executed.append(so.step_id)
        if so.step_id % 3 == 0:  # a plain (sync) output between async ones
            return ModelRunnerOutput([str(so.step_id)], {str(so.step_id): 0}, [[so.step_id]])
        return _SlowOutput(so.step_id, random.Random(so.step_id).uniform(0, 0.01))

    def determine_num_kv_blocks(self):
        return 7

    def initialize_kv_cache(self, n):
        self.kv = n

    def mark_dead(self, error):
        self.dead = error

    def shutdown(self):
        pass


def _so(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0)


def _make(llama_path, worker, async_mode=True):
    return UniProcExecutor(engine_config(llama_path, async_mode), worker=worker)


def test_futures_resolve_in_submission_order(llama_path):
    executor = _make(llama_path, _FakeWorker())
    assert isinstance(executor, Executor)
    assert executor.supports_async_scheduling
    resolved: list[int] = []
    lock = threading.Lock()

    def record(f: Future) -> None:
        with lock:
            resolved.append(f.result().sampled_token_ids[0][0])

    futures = [executor.execute_model(_so(i), non_block=True) for i in range(20)]
    for f in futures:
        f.add_done_callback(record)
    assert [f.result(timeout=10).sampled_token_ids[0][0] for f in futures] == list(range(20))
    assert resolved == list(range(20))
    assert executor.execute_model(_so(20)).sampled_token_ids == [[20]]  # blocking form
    assert executor.determine_num_kv_blocks() == 7
    executor.shutdown()


def test_a_failing_step_kills_the_executor(llama_path):
    worker = _FakeWorker(fail_at=2)
    executor = _make(llama_path, worker)
    futures = [executor.execute_model(_so(i), non_block=True) for i in range(5)]
    assert futures[1].result(timeout=10).sampled_token_ids == [[1]]
    with pytest.raises(EngineDeadError, match="boom at step 2") as info:
        futures[2].result(timeout=10)
    assert isinstance(info.value.__cause__, RuntimeError)
    for f in futures[3:]:  # later steps never run
        with pytest.raises(EngineDeadError):
            f.result(timeout=10)
    assert worker.executed == [0, 1]
    with pytest.raises(EngineDeadError, match="boom"):
        executor.check_health()
    with pytest.raises(EngineDeadError):
        executor.execute_model(_so(9), non_block=True)
    assert isinstance(worker.dead, RuntimeError)
    executor.shutdown()


def test_a_real_runner_error_surfaces_as_engine_dead(llama_path):
    executor = UniProcExecutor(engine_config(llama_path, True), num_threads=1)
    executor.initialize_kv_cache(NUM_BLOCKS)
    bad = SchedulerOutput(0, [], CachedRequestData(["ghost"], [[]], [0], [[]]), {"ghost": 1}, 1)
    with pytest.raises(EngineDeadError, match="ghost"):
        executor.execute_model(bad, non_block=True).result(timeout=30)
    with pytest.raises(EngineDeadError):
        executor.check_health()
    executor.shutdown()


def test_executor_end_to_end_greedy(llama_path):
    """Futures from a real worker, two steps in flight, equal HF greedy."""
    executor = UniProcExecutor(engine_config(llama_path, True), num_threads=1)
    executor.initialize_kv_cache(executor.determine_num_kv_blocks())

    class FutureRunner:  # StepDriver calls execute_model(so) and get_output()
        def execute_model(self, so):
            future = executor.execute_model(so, non_block=True)
            return type("R", (), {"get_output": lambda self: future.result(timeout=60)})()

    driver = StepDriver(FutureRunner(), BLOCK_SIZE, NUM_BLOCKS, async_mode=True)
    prompts = random_prompts([7, 13, 4], 500, seed=11)
    for i, p in enumerate(prompts):
        driver.add(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6))
    outputs = driver.run()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(llama_path, p, 6)
    executor.check_health()
    executor.shutdown()


def test_worker_sizes_the_kv_cache(llama_path):
    config = engine_config(llama_path, False)
    worker = Worker(replace(config, cache_config=CacheConfig(block_size=BLOCK_SIZE)))
    worker.init_device(num_threads=1)
    assert worker.ctx.device.type == "cpu" and worker.ctx.is_driver
    worker.load_model()
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    # tiny llama: 2 layers x (K + V) x block 4 x 2 KV heads x head_dim 16 x 4 bytes
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert 0 < worker.determine_num_kv_blocks() * per_block <= 1 << 30
    max_len = config.model_config.max_model_len
    blocks = -(-max_len // BLOCK_SIZE) + 10  # one full-length request and some
    sized = Worker(replace(config, cache_config=CacheConfig(
        block_size=BLOCK_SIZE, kv_cache_memory_bytes=blocks * per_block + 1)))
    sized.init_device(num_threads=1)
    sized.load_model()
    assert sized.determine_num_kv_blocks() == blocks
    explicit = Worker(config)
    explicit.init_device(num_threads=1)
    assert explicit.determine_num_kv_blocks() == NUM_BLOCKS
    tiny = Worker(replace(config, cache_config=CacheConfig(block_size=BLOCK_SIZE,
                                                           kv_cache_memory_bytes=1)))
    tiny.init_device(num_threads=1)
    tiny.load_model()
    with pytest.raises(ValueError, match=f"max_model_len={max_len} .* the longest "
                                         "max_model_len this memory holds is 0"):
        tiny.determine_num_kv_blocks()
    short = Worker(replace(config, cache_config=CacheConfig(
        block_size=BLOCK_SIZE, kv_cache_memory_bytes=10 * per_block)))
    short.init_device(num_threads=1)
    short.load_model()
    with pytest.raises(ValueError, match=f"holds is {10 * BLOCK_SIZE}\\. Lower max_model_len"):
        short.determine_num_kv_blocks()


def test_cpu_steps_of_a_prompt_wave_take_the_burst_threads(llama_path):
    """cpu_burst_threads: a step of at least CPU_BURST_MIN_TOKENS tokens runs on that many
    torch threads, every other step on the rank's own; the tokens stay HF's."""
    import torch

    from raylm.runner.worker import CPU_BURST_MIN_TOKENS, step_threads

    assert step_threads(CPU_BURST_MIN_TOKENS, 1, 2) == 2
    assert step_threads(CPU_BURST_MIN_TOKENS - 1, 1, 2) == 1
    assert step_threads(10_000, 3, None) == 3
    config = engine_config(llama_path, False)
    config = replace(config, parallel_config=replace(config.parallel_config,
                                                     cpu_burst_threads=2))
    worker = Worker(config)
    worker.init_device(num_threads=1)
    worker.load_model()
    worker.initialize_kv_cache(NUM_BLOCKS)
    seen: list[tuple[int, int]] = []  # (tokens of the step, torch threads it ran on)
    before = torch.get_num_threads()

    class Recording:  # StepDriver calls execute_model(so)
        def execute_model(self, so):
            out = worker.execute_model(so)
            seen.append((so.total_num_scheduled_tokens, torch.get_num_threads()))
            return out

    try:
        driver = StepDriver(Recording(), BLOCK_SIZE, NUM_BLOCKS, async_mode=False)
        prompts = random_prompts([70, 5, 9], 500, seed=3)
        for i, p in enumerate(prompts):
            driver.add(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=5))
        outputs = driver.run()
    finally:
        torch.set_num_threads(before)
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(llama_path, p, 5)
    assert seen[0][0] >= CPU_BURST_MIN_TOKENS and seen[0][1] == 2
    small = [threads for tokens, threads in seen if tokens < CPU_BURST_MIN_TOKENS]
    assert small and set(small) == {1}
