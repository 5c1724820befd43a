"""Error mapping through the real server: uvicorn on loopback in front of the real AsyncLLM
(in process). A request the engine refuses (InvalidRequestError) is a 400 with OpenAI's error
JSON; an engine bug, even a ValueError, is a logged 500; neither leaks a request. And a
cancel that arrives while an unfinished stream is being aborted is never swallowed."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import httpx
import openai
import pytest
from test_openai_fakes import FakeEngine, running_server

from raylm.cluster.engine.async_llm import AsyncLLM
from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.errors import from_exception
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.request import InvalidRequestError

MODEL = "tiny-llama"
NUM_KV_BLOCKS, BLOCK_SIZE = 4, 16  # 64 tokens of KV: a request for more can never run


@pytest.fixture(scope="module")
def engine(llama_path):
    llm = AsyncLLM.from_engine_args(llama_path, num_kv_blocks=NUM_KV_BLOCKS,
                                    block_size=BLOCK_SIZE, max_num_seqs=4)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with running_server(build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))})) \
            as base:
        yield base


def _assert_engine_idle_and_working(engine, url):
    assert not engine.output_processor.has_unfinished()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello",
                                                  "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_a_400_naming_the_numbers(engine, url, stream):
    # 2 prompt tokens + 100 fit max_model_len (1024) but need 7 blocks of the pool's 4.
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 100, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert "needs 7 KV blocks" in err["message"] and "only 4" in err["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="KV blocks"):
        client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=100)
    _assert_engine_idle_and_working(engine, url)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_bug_is_a_logged_500_even_as_a_value_error(engine, url, stream, monkeypatch,
                                                          caplog):
    def broken(*args, **kwargs):
        raise ValueError("slot_mapping has 3 entries for 4 tokens")  # a bug, not bad input

    monkeypatch.setattr(engine.input_processor, "make_requests", broken)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
    with caplog.at_level(logging.ERROR, logger="raylm.cluster.serve.openai_api.errors"):
        r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and err["code"] == 500
    assert "ValueError: slot_mapping has 3 entries for 4 tokens" in err["message"]
    logged = [rec for rec in caplog.records if rec.name == "raylm.cluster.serve.openai_api.errors"]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "slot_mapping has 3 entries" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    _assert_engine_idle_and_working(engine, url)


def test_client_validation_is_a_400_without_logging(url, caplog):
    with caplog.at_level(logging.INFO, logger="raylm"):
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "exceeds max_model_len=1024" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]


def test_exception_classes_map_to_statuses():
    assert from_exception(InvalidRequestError("n too big", "n")).to_dict()["error"] == {
        "message": "n too big", "type": "BadRequestError", "param": "n", "code": 400}
    assert from_exception(ValueError("bad index")).status_code == 500
    assert from_exception(TypeError("None is not iterable")).status_code == 500
    assert from_exception(EngineDeadError("worker 2 died")).status_code == 500


class _SlowCloseEngine(FakeEngine):
    """Its streams take a while to close (an engine client whose abort awaits), so a cancel
    can arrive meanwhile."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, delay_s=0.02)
        self.close_started = asyncio.Event()

    async def generate(self, prompt, request_id):
        try:
            async with aclosing(super().generate(prompt, request_id)) as stream:
                async for out in stream:
                    yield out
        finally:
            self.close_started.set()
            await asyncio.sleep(0.2)


def test_cancel_during_the_abort_of_a_closed_stream_propagates(engine):
    engine = _SlowCloseEngine(engine.tokenizer)
    serving = OpenAIServing(engine, MODEL)

    async def go():
        lines = await serving.handle("/v1/completions", {
            "model": MODEL, "prompt": "a", "max_tokens": 50, "stream": True})
        await anext(lines)
        closing = asyncio.ensure_future(lines.aclose())  # the client went away
        await engine.close_started.wait()
        closing.cancel()  # ... and the server is shutting down
        with pytest.raises(asyncio.CancelledError):
            await closing

    asyncio.run(go())
    assert len(engine.aborted) == 1 and engine.running == set() and serving.num_pending == 0
