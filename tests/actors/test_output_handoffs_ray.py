"""On Ray, the engine's outputs reach a request's stream in two handoffs: the EngineCore
actor's EngineOutputStream (its loop thread to the long poll), then, after the Ray reply
the output task awaits, the request's asyncio queue. Counted in both processes by
instrumenting every queue and thread wake-up (tests/handoff_probe.py); the probe enters the
EngineCore actor through ``__ray_call__``."""

from __future__ import annotations

import asyncio
import sys

import handoff_probe
import pytest
import ray
from handoff_probe import HandoffProbe
from local_ray import ship_by_value

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.ray

MAX_TOKENS = 8
REQUEST_ID = "handoffs-ray"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    ship_by_value(sys.modules[__name__], handoff_probe)
    yield ray_local


def _install(actor, request_id):
    actor.handoff_probe = HandoffProbe(request_id).install()


def _passes(actor):
    actor.handoff_probe.uninstall()
    return dict(actor.handoff_probe.passes)


def test_ray_outputs_change_hands_twice(llama_path):
    engine = AsyncLLM.from_engine_args(llama_path, max_num_seqs=4,
                                       distributed_executor_backend="ray")
    try:
        (rank,) = engine.core.ranks
        ray.get(rank.__ray_call__.remote(_install, REQUEST_ID))
        prompt = engine.input_processor.process(
            [5, 6, 7], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))

        async def collect():
            return [out async for out in engine.generate(prompt, REQUEST_ID)]

        driver = HandoffProbe(REQUEST_ID).install()
        try:
            outs = asyncio.run(collect())
        finally:
            driver.uninstall()
        in_actor = ray.get(rank.__ray_call__.remote(_passes))
    finally:
        engine.shutdown()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == MAX_TOKENS
    # One conduit in each process, each taken by every output once.
    assert len(in_actor) == 1 and len(driver.passes) == 1, (in_actor, driver.passes)
    assert [c.split("@")[0] for c in in_actor] == ["EngineOutputStream"]
    assert [c.split("@")[0] for c in driver.passes] == ["asyncio.Queue"]
    assert list(in_actor.values()) == [len(outs)] and list(driver.passes.values()) == [len(outs)]
