"""A model run inside a Ray actor (a Serve replica's in-process engine) takes as many torch
threads as the CPUs Ray reserved for that actor, not every core of the node."""

from __future__ import annotations

import pytest
import ray

from raylm.cluster.engine.engine_setup import ray_actor_threads


@pytest.fixture(scope="module")
def ray_instance(ray_local):
    yield ray_local


@ray.remote
class Probe:
    def threads(self, env: dict[str, str]) -> int | None:
        import os

        os.environ.update(env)
        return ray_actor_threads()


@pytest.mark.parametrize(("num_cpus", "expected"), [(2, 2), (1, 1), (0.5, 1), (0, 1)])
def test_an_actor_uses_the_cpus_it_reserved(ray_instance, num_cpus, expected):
    probe = Probe.options(num_cpus=num_cpus).remote()
    assert ray.get(probe.threads.remote({})) == expected
    ray.kill(probe)


def test_the_override_and_the_driver_leave_it_to_the_runner(ray_instance):
    probe = Probe.options(num_cpus=2).remote()
    assert ray.get(probe.threads.remote({"RAYLM_NUM_THREADS": "3"})) is None
    ray.kill(probe)
    assert ray_actor_threads() is None  # the driver is no actor: affinity mask / override
