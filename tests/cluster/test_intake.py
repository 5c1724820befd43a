"""The intake runs once per request and the engine client owns the one abort.

Counted on the real AsyncLLM and LLM (random-weight llama, in process): ``validate_prompt``
runs exactly once per request (completion, chat, token-id prompt, offline generate), the
tokenizer encodes a text prompt exactly once and never a token-id prompt, and a cancelled
stream reaches the engine as exactly one abort.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from contextlib import aclosing

import pytest
from test_openai_fakes import FakeEngine, cancel_once_running

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.engine.llm import LLM
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.scheduler import intake
from raylm.scheduler.request import InvalidRequestError
from raylm.scheduler.sampling_params import SamplingParams

MODEL = "tiny-intake"
DEADLINE_S = 30.0  # only turns a hang into a failure


@pytest.fixture(scope="module")
def engine(llama_path):
    llm = AsyncLLM.from_engine_args(llama_path, max_num_seqs=4)
    yield llm
    llm.shutdown()


class Counts:
    validations = 0
    encodes = 0


@pytest.fixture
def counts(monkeypatch, engine):
    """Count validate_prompt calls (wherever it was imported) and outermost encodes of the
    engine's tokenizer class (``__call__`` and ``encode``)."""
    c = Counts()
    original = intake.validate_prompt

    def counting_validate(*args, **kwargs):
        c.validations += 1
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("raylm.") and \
                getattr(module, "validate_prompt", None) is original:
            monkeypatch.setattr(module, "validate_prompt", counting_validate)

    cls = type(engine.tokenizer)
    depth = threading.local()

    def counting(method):
        def wrapper(self, *args, **kwargs):
            level = getattr(depth, "level", 0)
            if level == 0:
                c.encodes += 1
            depth.level = level + 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth.level = level
        return wrapper

    monkeypatch.setattr(cls, "__call__", counting(cls.__call__))
    monkeypatch.setattr(cls, "encode", counting(cls.encode))
    return c


def _run(serving: OpenAIServing, route: str, body: dict):
    async def go():
        result = await serving.handle(route, body)
        if isinstance(result, dict):
            return result
        return [line async for line in result]
    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_prompt_validated_and_encoded_once(engine, counts, stream):
    serving = OpenAIServing(engine, MODEL)
    _run(serving, "/v1/completions",
         {"model": MODEL, "prompt": "count me once", "max_tokens": 3, "stream": stream})
    assert (counts.validations, counts.encodes) == (1, 1)


def test_completion_token_id_prompts_are_never_encoded(engine, counts):
    serving = OpenAIServing(engine, MODEL)
    _run(serving, "/v1/completions",
         {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3})
    assert (counts.validations, counts.encodes) == (2, 0)


def test_chat_validated_and_encoded_once(engine, counts):
    engine.tokenizer.chat_template = engine.tokenizer.chat_template or (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    serving = OpenAIServing(engine, MODEL)
    _run(serving, "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert (counts.validations, counts.encodes) == (1, 1)


def test_rejected_prompt_is_validated_once_and_never_reaches_the_engine(engine, counts):
    serving = OpenAIServing(engine, MODEL)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        serving.prepare("/v1/completions", {"model": MODEL, "prompt": [99999]})
    assert (counts.validations, counts.encodes) == (1, 0)
    assert not engine.output_processor.has_unfinished()


def test_offline_generate_validates_each_prompt_once(llama_path, engine, counts):
    llm = LLM(llama_path, max_num_seqs=4)
    try:
        outs = llm.generate(["a text prompt", [5, 6, 7], {"prompt_token_ids": [8, 9]}],
                            SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(outs) == 3
        assert (counts.validations, counts.encodes) == (3, 1)
    finally:
        llm.shutdown()


def test_fake_engine_uses_the_same_intake(tokenizer):
    engine = FakeEngine(tokenizer)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.input_processor.process([5, 6], SamplingParams(max_tokens=500),
                                       strict_max_tokens=True)
    # The offline API caps what the HTTP API refuses.
    prompt = engine.input_processor.process([5, 6], SamplingParams(max_tokens=500))
    assert prompt.prompt_token_ids == [5, 6] and prompt.prompt is None


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


# ---- the one abort ---------------------------------------------------------------------

class AbortCounts:
    def __init__(self) -> None:
        self.client: list[str] = []  # AsyncLLM._abort: what the engine client sends
        self.core: list[list[str]] = []  # the EngineCore client's abort_requests


@pytest.fixture
def aborts(monkeypatch, engine):
    a = AbortCounts()
    abort_request, core_abort = engine._abort, engine.core.abort_requests

    def counting_abort_request(request_id, *args, **kwargs):
        a.client.append(request_id)
        return abort_request(request_id, *args, **kwargs)

    def counting_core_abort(request_ids):
        a.core.append(list(request_ids))
        return core_abort(request_ids)

    monkeypatch.setattr(engine, "_abort", counting_abort_request)
    monkeypatch.setattr(engine.core, "abort_requests", counting_core_abort)
    return a


def _wait_engine_idle(engine) -> None:
    scheduler = engine.core.engine_core.scheduler
    deadline = time.monotonic() + DEADLINE_S
    while scheduler.requests or engine.output_processor.has_unfinished():
        assert time.monotonic() < deadline, "the aborted request is still in the engine"
        time.sleep(0.01)


def test_closed_stream_is_one_abort(engine, aborts):
    serving = OpenAIServing(engine, MODEL)

    async def go():
        lines = await serving.handle("/v1/completions", {
            "model": MODEL, "prompt": "a long one", "max_tokens": 500, "stream": True,
            "ignore_eos": True})
        async with aclosing(lines):
            await anext(lines)
            await anext(lines)
        # the client went away: aclosing closed the stream

    asyncio.run(go())
    assert len(aborts.client) == 1 and len(aborts.core) == 1
    assert aborts.core[0] == aborts.client
    assert serving.num_pending == 0
    _wait_engine_idle(engine)


def test_cancelled_request_is_one_abort(engine, aborts):
    serving = OpenAIServing(engine, MODEL)

    asyncio.run(cancel_once_running(
        serving.handle("/v1/completions", {"model": MODEL, "prompt": "a long one",
                                           "max_tokens": 500, "ignore_eos": True}),
        engine.output_processor.has_unfinished, DEADLINE_S))
    assert len(aborts.client) == 1 and len(aborts.core) == 1
    assert serving.num_pending == 0
    _wait_engine_idle(engine)


def test_cancel_while_the_request_is_being_added_still_aborts_it(engine, aborts, monkeypatch):
    processor = engine.input_processor
    make_requests = processor.make_requests
    adding = threading.Event()

    def slow_make_requests(*args, **kwargs):
        adding.set()
        time.sleep(0.3)
        return make_requests(*args, **kwargs)

    monkeypatch.setattr(processor, "make_requests", slow_make_requests)
    prompt = processor.process([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))

    async def go():
        async def consume():
            async with aclosing(engine.generate(prompt, "slow-add")) as stream:
                async for _ in stream:
                    pass

        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(adding.wait, DEADLINE_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.6)  # the add finishes in its thread, then the abort follows

    asyncio.run(go())
    assert aborts.client == ["slow-add"] and aborts.core == [["slow-add"]]
    _wait_engine_idle(engine)
