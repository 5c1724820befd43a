"""A fake EngineClient (deterministic tokens) and a loopback uvicorn server, for the API tests.

The fake obeys max_tokens, stop strings, stop_token_ids, n and logprobs like the real engine,
streams cumulative RequestOutputs, counts aborts (a stream closed before its last output),
and can be told to die.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from raylm.cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
from raylm.cluster.engine.processor import InputProcessor, ValidatedPrompt
from raylm.scheduler.config.engine_config import ModelConfig
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.sampling_params import SamplingParams

FIRST_TOKEN, NUM_PLAIN = 280, 230  # token ids the fake emits: BPE merges (valid UTF-8), no specials

# The gauges and counters every /metrics exposition has, each labelled with the model.
ENGINE_METRIC_NAMES = ("raylm:num_requests_running", "raylm:num_requests_waiting",
                       "raylm:kv_cache_usage_perc", "raylm:prompt_tokens_total",
                       "raylm:generation_tokens_total", "raylm:num_preemptions_total")


class FakeEngine:
    """Token k of choice i is ``FIRST_TOKEN + (seed + 7k + 13i) % NUM_PLAIN``."""

    def __init__(self, tokenizer, max_model_len: int = 128, delay_s: float = 0.0):
        self.tokenizer = tokenizer
        self.model_config = ModelConfig(model="fake-model", max_model_len=max_model_len, hf_config={
            "architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_model_len,
            "vocab_size": 512, "eos_token_id": 2})
        # The real intake: the fake validates and tokenizes what the real engine would.
        self.input_processor = InputProcessor(self.model_config, tokenizer)
        self.delay_s = delay_s
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.seen: list[tuple[list[int], SamplingParams]] = []
        self.dead: str | None = None
        self.prompt_tokens = self.generation_tokens = 0

    def token_ids(self, prompt_ids: list[int], params: SamplingParams, index: int) -> list[int]:
        seed = sum(prompt_ids) + (params.seed or 0)
        return [FIRST_TOKEN + (seed + 7 * k + 13 * index) % NUM_PLAIN
                for k in range(params.max_tokens or 16)]

    def expected_text(self, prompt_ids, params, index=0) -> str:
        return self.tokenizer.decode(self.token_ids(prompt_ids, params, index))

    def _logprobs(self, token_id: int, k: int) -> dict[int, Logprob]:
        entries = {token_id: Logprob(-0.25, 1, self.tokenizer.decode([token_id]))}
        for r in range(2, k + 1):
            other = FIRST_TOKEN + (token_id + r) % NUM_PLAIN
            entries[other] = Logprob(-0.25 * r, r, self.tokenizer.decode([other]))
        return entries

    async def generate(self, prompt: ValidatedPrompt, request_id: str):
        if self.dead:
            raise EngineDeadError(self.dead)
        params, prompt_token_ids = prompt.params, prompt.prompt_token_ids
        self.seen.append((list(prompt_token_ids), params))
        self.running.add(request_id)
        self.prompt_tokens += len(prompt_token_ids)
        choices = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        plans = [self.token_ids(prompt_token_ids, params, i) for i in range(params.n)]
        try:
            for k in range(max(len(p) for p in plans)):
                await asyncio.sleep(self.delay_s)
                if self.dead:
                    raise EngineDeadError(self.dead)
                for c, plan in zip(choices, plans, strict=True):
                    if c.finish_reason is None:
                        self._append(c, plan[k], params, last=k == len(plan) - 1)
                finished = all(c.finish_reason is not None for c in choices)
                yield RequestOutput(request_id, prompt.prompt, list(prompt_token_ids),
                                    [_copy(c) for c in choices], finished)
                if finished:
                    return
        finally:
            if request_id in self.running:
                self.running.discard(request_id)
                if not all(c.finish_reason is not None for c in choices):
                    self.aborted.append(request_id)

    def _append(self, c: CompletionOutput, token: int, params: SamplingParams, last: bool) -> None:
        self.generation_tokens += 1
        c.token_ids.append(token)
        if c.logprobs is not None:
            c.logprobs.append(self._logprobs(token, params.logprobs))
        c.text = self.tokenizer.decode(c.token_ids)
        if token in params.stop_token_ids:
            c.finish_reason, c.stop_reason = "stop", token
            return
        for s in params.stop:
            at = c.text.find(s)
            if at >= 0:
                c.text = c.text[: at + len(s)] if params.include_stop_str_in_output else c.text[:at]
                c.finish_reason, c.stop_reason = "stop", s
                return
        if last:
            c.finish_reason = "length"

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def die(self, why: str = "worker 0 exited: segfault in the fake") -> None:
        self.dead = why

    def get_stats(self) -> dict:
        return {"num_requests_running": len(self.running), "num_requests_waiting": 0,
                "kv_cache_usage_perc": 0.01 * len(self.running), "num_preemptions_total": 0,
                "prompt_tokens_total": self.prompt_tokens,
                "generation_tokens_total": self.generation_tokens}

    def shutdown(self) -> None:
        pass


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), None,
                            list(c.logprobs) if c.logprobs is not None else None,
                            c.finish_reason, c.stop_reason)


async def cancel_once_running(request, running, deadline_s: float = 60.0,
                              settle_s: float = 0.05) -> None:
    """Start ``request`` (a coroutine), wait until ``running()`` says the engine has it,
    let it run ``settle_s`` more, cancel it and check the cancellation reached it."""
    task = asyncio.ensure_future(request)
    deadline = time.monotonic() + deadline_s
    while not running():
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.01)
    await asyncio.sleep(settle_s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app):
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yield the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def real_engine_client(path: str, model: str, **engine_kwargs):
    """The real AsyncLLM (in process) on ``path`` behind the routes on loopback uvicorn:
    yields the official openai client; shuts the engine down after."""
    import openai

    from raylm.cluster.engine.async_llm import AsyncLLM
    from raylm.cluster.serve.handlers.serving import OpenAIServing
    from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api

    engine = AsyncLLM.from_engine_args(path, **engine_kwargs)
    app = build_openai_api({model: ModelBackend.local(OpenAIServing(engine, model))})
    try:
        with running_server(app) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    finally:
        engine.shutdown()


# ---- the fake itself must behave, or the API tests prove nothing --------------------------

@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


def _collect(engine, ids, params):
    async def go():
        prompt = engine.input_processor.process(ids, params)
        return [out async for out in engine.generate(prompt, "r")]
    return asyncio.run(go())


def test_fake_obeys_max_tokens_n_and_logprobs(tokenizer):
    engine = FakeEngine(tokenizer)
    outs = _collect(engine, [5, 6, 7], SamplingParams(max_tokens=5, n=2, logprobs=3))
    assert len(outs) == 5 and outs[-1].finished and not outs[-2].finished
    final = outs[-1].outputs
    assert [len(c.token_ids) for c in final] == [5, 5]
    assert final[0].token_ids != final[1].token_ids
    assert all(c.finish_reason == "length" for c in final)
    assert len(final[0].logprobs) == 5 and len(final[0].logprobs[0]) == 3
    assert engine.running == set() and engine.aborted == []


def test_fake_stops_on_stop_string(tokenizer):
    engine = FakeEngine(tokenizer)
    full = engine.expected_text([1, 2, 3], SamplingParams(max_tokens=8))
    stop = full[len(full) // 2: len(full) // 2 + 2]
    final = _collect(engine, [1, 2, 3], SamplingParams(max_tokens=8, stop=stop))[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full[: full.find(stop)]
