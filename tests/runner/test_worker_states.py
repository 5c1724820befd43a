"""A Worker asked for work before ``init_device()`` or after ``shutdown()`` says what is
missing and what builds it, instead of failing on an attribute of None."""

from __future__ import annotations

import pytest

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.runner.worker import Worker


def _worker(path: str) -> Worker:
    return Worker(EngineArgs(model=path, num_kv_blocks=16).create_engine_config())


def test_before_init_device_each_call_names_the_missing_step(llama_path):
    worker = _worker(llama_path)
    with pytest.raises(RuntimeError, match=r"rank 0 has no device: call init_device\(\)"):
        worker.device_info()
    with pytest.raises(RuntimeError, match=r"rank 0 has no model runner: init_device\(\)"):
        worker.load_model()


def test_after_shutdown_the_runner_is_gone_and_a_second_shutdown_is_harmless(llama_path):
    worker = _worker(llama_path)
    worker.init_device()
    worker.load_model()
    assert worker.device_info()["kind"] == "cpu"
    worker.shutdown()
    worker.shutdown()
    with pytest.raises(RuntimeError, match="shutdown\\(\\) drops it"):
        worker.load_model()
