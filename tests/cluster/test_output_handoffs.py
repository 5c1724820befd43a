"""The engine's outputs reach a request's stream in two handoffs (in process): the engine
loop thread's EngineOutputStream, then the request's asyncio queue, filled by AsyncLLM's
output task. Counted by instrumenting every queue and thread wake-up (tests/handoff_probe.py).
A request from a second event loop is served too, and the output task moves to it when its
first loop ends."""

from __future__ import annotations

import asyncio
import threading

import pytest
from handoff_probe import HandoffProbe

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.scheduler.sampling_params import SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine(llama_path):
    llm = AsyncLLM.from_engine_args(llama_path, max_num_seqs=4)
    yield llm
    llm.shutdown()


def _prompt(engine, max_tokens=MAX_TOKENS):
    return engine.input_processor.process(
        [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


async def _collect(engine, request_id, max_tokens=MAX_TOKENS):
    return [out async for out in engine.generate(_prompt(engine, max_tokens), request_id)]


def _passes_by_kind(probe):
    return {conduit.split("@")[0]: n for conduit, n in probe.passes.items()}


def test_in_process_outputs_change_hands_twice(engine):
    probe = HandoffProbe("handoffs-0").install()
    try:
        outs = asyncio.run(_collect(engine, "handoffs-0"))
    finally:
        probe.uninstall()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == MAX_TOKENS
    # Two conduits, each taken by every output once.
    assert len(probe.passes) == 2, probe.passes
    assert _passes_by_kind(probe) == {"EngineOutputStream": len(outs),
                                      "asyncio.Queue": len(outs)}, probe.passes


def test_a_second_event_loop_is_served_and_inherits_the_output_task(engine):
    """A request on a loop in another thread, while the first loop runs the output task:
    the first loop ends while the second's request is streaming, and that stream still
    completes (the output task moved to its loop), with the same greedy tokens."""
    second_streaming = threading.Event()
    results: dict[str, object] = {}

    async def first():
        results["first"] = await _collect(engine, "loop-a")
        await asyncio.to_thread(second_streaming.wait, 30)

    async def second():
        while engine._output_task is None:  # the first loop's task starts first
            await asyncio.sleep(0.005)
        outs = []
        async for out in engine.generate(_prompt(engine, 200), "loop-b"):
            outs.append(out)
            second_streaming.set()
        results["second"] = outs
        results["second_loop"] = asyncio.get_running_loop()
        results["task_loop"] = engine._output_task.get_loop()

    thread = threading.Thread(target=lambda: asyncio.run(second()))
    thread.start()
    asyncio.run(first())
    thread.join(timeout=60)
    assert not thread.is_alive(), "the second loop's request never finished"
    first_ids = results["first"][-1].outputs[0].token_ids
    second_ids = results["second"][-1].outputs[0].token_ids
    assert len(first_ids) == MAX_TOKENS and len(second_ids) == 200
    assert second_ids[:MAX_TOKENS] == first_ids  # greedy: the same prompt, the same start
    assert results["task_loop"] is results["second_loop"]
    assert not engine.output_processor.has_unfinished()
