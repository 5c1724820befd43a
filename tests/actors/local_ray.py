"""Test helper: a Ray instance of the test module's own for the Ray-actor tests."""

from __future__ import annotations

import contextlib
import types

import ray


@contextlib.contextmanager
def local_ray(*by_value: types.ModuleType):
    """``address="local"``: a new Ray of our own, never a cluster `ray start` left on this
    machine. tests/ is not importable in Ray workers: the ``by_value`` modules (helpers
    the workers run) are shipped by value."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    for module in by_value:
        ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        ray.shutdown()
