"""Test helper for the Ray-actor tests, which run on the run's shared Ray (``ray_local``)."""

from __future__ import annotations

import types

import ray


def ship_by_value(*modules: types.ModuleType) -> None:
    """tests/ is not importable in Ray workers: the ``modules`` (helpers the workers run)
    are pickled by value."""
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
