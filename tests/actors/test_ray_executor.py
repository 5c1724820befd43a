"""RayExecutor with a fake worker (real actors, real gloo TP group, no model).

Covers both step paths (the step stream and plain Ray calls), in-order pipelined steps,
the output rank, KV sizing, collective_rpc, failures (killed actor, raising step) and
placement errors.
"""

from __future__ import annotations

import re
import time

import pytest
import ray
from local_ray import ship_by_value

from raylm.actors.placement import PlacementGroupError
from raylm.actors.ray_executor import RayExecutor
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import CachedRequestData, SchedulerOutput

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster(ray_local):
    import fake_worker

    ship_by_value(fake_worker)
    yield fake_worker.FakeWorker


def _config(model: str, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(ModelConfig(model=model), CacheConfig(), SchedulerConfig(),
                        ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       distributed_executor_backend="ray"))


def _step(step_id: int, req_ids=("a", "b")) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, scheduled_new_reqs=[],
                           scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={r: 1 for r in req_ids},
                           total_num_scheduled_tokens=len(req_ids))


@pytest.mark.parametrize("dispatch", ["channel", "ray"])
def test_tp2_pipelined_steps_return_in_order_from_output_rank(ray_cluster, llama_path, dispatch):
    ex = RayExecutor(_config(llama_path, tp=2), dispatch=dispatch, worker_cls=ray_cluster)
    try:
        assert ex.supports_async_scheduling
        assert ex.determine_num_kv_blocks() == 90  # the minimum over ranks
        ex.initialize_kv_cache(90)
        futures = [ex.execute_model(_step(i), non_block=True) for i in range(1, 21)]
        for i, fut in enumerate(futures, start=1):
            out = fut.result(timeout=30)
            # both TP ranks joined the all-reduce: step*1000 + rank 0, plus step*1000 + rank 1
            assert out.req_ids == ["a", "b"]
            assert out.sampled_token_ids == [[2000 * i + 1]] * 2
        blocking = ex.execute_model(_step(21, ("z",)))
        assert blocking.sampled_token_ids == [[42001]]
        pids_threads = ex.collective_rpc("get_pid_and_threads")
        assert len({pid for pid, _ in pids_threads}) == 2  # one process per rank
        assert all(threads == 1 for _, threads in pids_threads)  # the bundle's 1 CPU
        assert ex.collective_rpc("determine_num_kv_blocks") == [100, 90]
        # One thread per rank ran setup and every step (OpenMP keeps a team per thread).
        for ran in ex.collective_rpc("get_torch_threads"):
            assert set(ran) == {"init_device", "load_model", "initialize_kv_cache",
                                "execute_model"}
            assert len({t for threads in ran.values() for t in threads}) == 1, ran
        with pytest.raises(ValueError, match="_private"):
            ex.collective_rpc("_private")
        ex.check_health()
    finally:
        ex.shutdown()


@pytest.mark.parametrize("dispatch", ["channel", "ray"])
def test_killed_worker_fails_pending_steps_with_engine_dead(ray_cluster, llama_path, dispatch):
    ex = RayExecutor(_config(llama_path, tp=2), dispatch=dispatch, worker_cls=ray_cluster)
    try:
        ex.collective_rpc("set_step_delay", (0.05,))
        futures = [ex.execute_model(_step(i), non_block=True) for i in range(1, 4)]
        futures[0].result(timeout=30)
        ray.kill(ex.workers[1])
        start = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            for _ in range(200):  # keep stepping as the EngineCore would
                futures.append(ex.execute_model(_step(10), non_block=True))
                futures.pop(0).result(timeout=30)
        assert time.monotonic() - start < 30
        msg = str(info.value)
        assert "worker rank 1" in msg and "actor " in msg, msg
        # Nothing left hanging: each step still listed failed as the engine died, or had
        # run on both ranks before the kill took effect (ray.kill is asynchronous, and the
        # EngineDeadError may come from a submission after those steps completed).
        for fut in futures:
            error = fut.exception(timeout=30)
            assert error is None or isinstance(error, EngineDeadError), error
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            ex.check_health()
        with pytest.raises(EngineDeadError):
            ex.execute_model(_step(99), non_block=True)
    finally:
        ex.shutdown()


def test_control_calls_answer_while_the_torch_thread_serves_steps(ray_cluster, llama_path):
    """The worker's one torch thread is busy with the stream; health, collective_rpc and
    shutdown still answer (the control group), and setup after the first step is refused."""
    ex = RayExecutor(_config(llama_path, tp=2), worker_cls=ray_cluster)
    try:
        ex.initialize_kv_cache(90)
        ex.collective_rpc("set_step_delay", (0.5,))
        futures = [ex.execute_model(_step(i), non_block=True) for i in range(1, 5)]
        ex.check_health()
        assert ex.collective_rpc("determine_num_kv_blocks") == [100, 90]
        assert not futures[-1].done()  # answered between steps, not after them
        with pytest.raises(RuntimeError, match="initialize_kv_cache must come before"):
            ex.initialize_kv_cache(90)
        assert futures[0].result(timeout=30).sampled_token_ids == [[2001], [2001]]
    finally:
        ex.shutdown()  # with steps still in flight: returns, and nothing hangs
    assert ex.workers == []
    for fut in futures[1:]:  # each one resolved: a result, or the shutdown's error
        error = fut.exception(timeout=5)
        assert error is None or "shut down" in str(error), error


def test_raising_step_reports_worker_error(ray_cluster, llama_path):
    ex = RayExecutor(_config(llama_path, tp=2), worker_cls=ray_cluster)
    try:
        assert ex.execute_model(_step(1)).sampled_token_ids == [[2001], [2001]]
        with pytest.raises(EngineDeadError, match="refuses step_id=-1"):
            ex.execute_model(_step(-1), non_block=True).result(timeout=30)
    finally:
        ex.shutdown()


def test_unsatisfiable_tp_fails_fast_naming_cpus(ray_cluster, llama_path):
    start = time.monotonic()
    have = int(ray.cluster_resources()["CPU"])
    with pytest.raises(PlacementGroupError) as info:
        RayExecutor(_config(llama_path, tp=64), placement_timeout_s=2, worker_cls=ray_cluster)
    assert time.monotonic() - start < 30
    msg = str(info.value)
    # One bundle for the stage's TP group (a TP group never spans nodes).
    assert "1 x {'CPU': 64.0}" in msg and "CPU: requested 64" in msg, msg
    assert f"of {have} in the cluster (missing {64 - have})" in msg, msg


def test_gpu_bundle_on_cpu_cluster_fails_fast_naming_gpu(ray_cluster, llama_path):
    with pytest.raises(PlacementGroupError, match=r"GPU: requested 2, available 0 of 0"):
        RayExecutor(_config(llama_path, tp=2), resource="GPU", placement_timeout_s=2,
                    worker_cls=ray_cluster)
    # the failed group was removed: a satisfiable engine still fits afterwards
    ex = RayExecutor(_config(llama_path, tp=2), worker_cls=ray_cluster)
    ex.shutdown()


def test_bad_dispatch_is_value_error(ray_cluster, llama_path):
    with pytest.raises(ValueError, match="dispatch"):
        RayExecutor(_config(llama_path), dispatch="carrier-pigeon")


def test_missing_resource_descriptions(ray_cluster):
    from raylm.actors.placement import describe_missing_resources, worker_bundles

    spread = describe_missing_resources(worker_bundles(1, 3, "CPU"), "STRICT_SPREAD")
    assert "STRICT_SPREAD needs 3 nodes, the cluster has 1" in spread
    have = int(ray.cluster_resources()["CPU"])
    big = describe_missing_resources([{"CPU": have + 4.0}], "PACK")
    # what is free depends on how fast the previous test's actors released their CPUs
    assert re.search(rf"CPU: requested {have + 4}, available [\d.]+ of {have}", big), big
    assert "fits on no node" in big
    with pytest.raises(ValueError, match="resource"):
        worker_bundles(2, 1, "TPU")
