"""The OpenAI HTTP API on a fake engine: real uvicorn on loopback, the official openai client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_openai_fakes import (
    ENGINE_METRIC_NAMES,
    FakeEngine,
    cancel_once_running,
    running_server,
)

from raylm.cluster.serve.handlers.serving import OpenAIServing
from raylm.cluster.serve.openai_api.routes import ModelBackend, build_openai_api
from raylm.scheduler.sampling_params import SamplingParams

MODEL = "fake-llama"


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def url(engine):
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))})
    with running_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ids_of(tokenizer, text):
    return tokenizer(text).input_ids


def test_completion_text_usage_and_envelope(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    prompt_ids = ids_of(tokenizer, "hello world")
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == engine.expected_text(prompt_ids, SamplingParams(max_tokens=6))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 6)
    assert r.usage.total_tokens == len(prompt_ids) + 6
    params = engine.seen[-1][1]
    assert params.temperature == 0 and params.max_tokens == 6


def test_completion_many_prompts_n2_token_ids(client, engine, tokenizer):
    prompts = [[5, 6, 7], [9, 10]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        p = SamplingParams(max_tokens=3)
        assert c.text == engine.expected_text(prompts[c.index // 2], p, c.index % 2)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    one = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3)
    assert one.choices[0].text == r.choices[0].text


def test_stream_equals_non_stream_and_sse_format(client, url, engine):
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 7, "n": 2}
    full = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(json.loads(e[6:])["usage"] is None for e in events[:-2])  # no include_usage


def test_chat_template_roles_and_stream(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    assert engine.seen[-1][0] == prompt_ids
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == engine.expected_text(prompt_ids, SamplingParams(max_tokens=5))
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_chat_template_override_and_kwargs(client, engine, tokenizer):
    # vLLM's request extras: a template replacing the model's, variables for the template.
    template = "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}" \
               "{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    messages = [{"role": "user", "content": "hi there"}]
    client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "hey"}})
    expected = tokenizer("[user|hey]hi there>>", add_special_tokens=False).input_ids
    assert engine.seen[-1][0] == expected
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                   extra_body={"add_generation_prompt": False})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert engine.seen[-1][0] == tokenizer(text, add_special_tokens=False).input_ids


def test_chat_default_max_tokens_fills_the_context(client, engine):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    prompt_ids, params = engine.seen[-1]
    assert params.max_tokens == engine.model_config.max_model_len - len(prompt_ids)


def test_stop_string_and_stop_token(client, engine, tokenizer):
    prompt_ids = ids_of(tokenizer, "stop here")
    full = engine.expected_text(prompt_ids, SamplingParams(max_tokens=10))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=10, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    token = engine.token_ids(prompt_ids, SamplingParams(max_tokens=10), 0)[3]
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=10,
                                  extra_body={"stop_token_ids": [token], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    assert engine.seen[-1][1].ignore_eos is True and engine.seen[-1][1].stop_token_ids == (token,)


def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) == 3 for top in lp.top_logprobs) and lp.token_logprobs[0] == -0.25
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -0.5]
    assert content[0].bytes == list(content[0].token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_prepends_prompt(client):
    r = client.completions.create(model=MODEL, prompt="echo me", max_tokens=3, echo=True)
    plain = client.completions.create(model=MODEL, prompt="echo me", max_tokens=3)
    assert r.choices[0].text == "echo me" + plain.choices[0].text


BAD_REQUESTS = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [99999]}, 400, "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 200}, 400, "128"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 500}, 400, "128"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     404, "nope"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{% if %}"}, 400, "chat template"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("route,body,status,needle", BAD_REQUESTS)
def test_bad_requests_never_reach_the_engine(url, engine, route, body, status, needle):
    before = len(engine.seen)
    r = httpx.post(f"{url}{route}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"] or needle == err["param"], err
    assert len(engine.seen) == before


def test_prompt_too_long_names_both_lengths(url, tokenizer):
    prompt = "word " * 200
    n = len(ids_of(tokenizer, prompt))
    err = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt}).json()
    assert str(n) in err["error"]["message"] and "128" in err["error"]["message"]


@pytest.mark.parametrize("content,status", [(b"{not json", 400), (b"[1, 2]", 400), (b"", 400)])
def test_malformed_bodies(url, content, status):
    r = httpx.post(f"{url}/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status and r.json()["error"]["type"] == "BadRequestError"


def test_unknown_route_and_method_use_the_envelope(url):
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=-0.5)


def test_models_and_health(client, url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "raylm"
    assert card["root"] == "fake-model" and card["max_model_len"] == 128
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_names_and_labels(client, url):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4)
    text = httpx.get(f"{url}/metrics").text
    for name in ENGINE_METRIC_NAMES + ("raylm:time_to_first_token_seconds_count",
                                       "raylm:inter_token_latency_seconds_count",
                                       "raylm:e2e_request_latency_seconds_count"):
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert lines and all(f'model_name="{MODEL}"' in ln for ln in lines), name
    success = [ln for ln in text.splitlines() if ln.startswith("raylm:request_success_total{")]
    assert any('finished_reason="length"' in ln and float(ln.split()[-1]) >= 1 for ln in success)
    ttft = [ln for ln in text.splitlines() if ln.startswith("raylm:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1
    assert "_created" not in text


def test_api_key(engine):
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(engine, MODEL))}, {MODEL: "sekret"})
    with running_server(app) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ok = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(**body).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0).models.list()
        assert httpx.get(f"{base}/health").status_code == 200


# A request that cannot finish on its own while a test runs (100k tokens at 50 ms each):
# whatever ends it is what the test is about (a disconnect, a cancel, an engine death).
FOREVER = 100_000


def _slow_engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer, max_model_len=FOREVER + 128, delay_s=0.05)


def _wait_for(predicate, timeout=60.0):  # only turns a hang into a failure
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _metric(text: str, name: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + "{")).split()[-1])


def test_disconnect_aborts_the_request(tokenizer):
    slow = _slow_engine(tokenizer)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(slow, MODEL))})
    with running_server(app) as base:
        body = {"model": MODEL, "prompt": "long one", "max_tokens": FOREVER, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert sum(ln.startswith("data: ") for ln in got) == 2
            assert slow.running
        _wait_for(lambda: not slow.running)
        assert len(slow.aborted) == 1
        text = httpx.get(f"{base}/metrics").text
        assert _metric(text, "raylm:num_requests_running") == 0
        assert _metric(text, "raylm:kv_cache_usage_perc") == 0


def test_overload_is_503_and_recovers(tokenizer):
    slow = _slow_engine(tokenizer)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(slow, MODEL, max_pending_requests=2))})
    with running_server(app) as base:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": FOREVER, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as a, \
                httpx.stream("POST", f"{base}/v1/completions", json=body) as b:
            assert a.status_code == b.status_code == 200
            r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
            two = httpx.post(f"{base}/v1/completions",
                             json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
            assert two.status_code == 503
        _wait_for(lambda: not slow.running)
        r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False, "n": 3})
        assert r.status_code == 400 and "3 sequences" in r.json()["error"]["message"]  # never fits
        _wait_for(lambda: not slow.running)
        r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200


def test_engine_death(tokenizer):
    doomed = _slow_engine(tokenizer)
    app = build_openai_api({MODEL: ModelBackend.local(OpenAIServing(doomed, MODEL))})
    with running_server(app) as base:
        body = {"model": MODEL, "prompt": "doomed", "max_tokens": FOREVER}
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(lines)
            doomed.die("worker 3 exited with SIGKILL")
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == 500 and "SIGKILL" in err["message"]
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 500 and "SIGKILL" in r.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]


def test_coalesce_joins_close_items_and_closes_the_source():
    import asyncio

    from raylm.cluster.serve.deployment.app import coalesce

    closed = []

    async def source(gaps):
        try:
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                yield f"<{i}>"
        finally:
            closed.append(True)

    async def collect(gaps, interval, limit=None):
        out = []
        gen = coalesce(source(gaps), interval)
        async for item in gen:
            out.append(item)
            if limit and len(out) == limit:
                await gen.aclose()
                break
        return out

    # 0 alone (never delayed); 1-2 arrive together; 3 comes after a long gap. The window is
    # wide so that a stall on a busy box cannot split 1 from 2, and 3 waits longer than it
    # (a sleep never ends early, so 3 can never join).
    assert asyncio.run(collect([0, 0.01, 0, 1.2], 1.0)) == ["<0>", "<1><2>", "<3>"]
    assert asyncio.run(collect([0, 0, 0], 0)) == ["<0>", "<1>", "<2>"]
    closed.clear()
    assert asyncio.run(collect([0, 0, 5, 5], 0.05, limit=2)) == ["<0>", "<1>"]
    assert closed == [True]  # the client left: the generation behind it is closed

    async def json_first():
        yield ("json", 200, {"ok": True})

    async def run_json():
        return [x async for x in coalesce(json_first(), 0.1)]

    assert asyncio.run(run_json()) == [("json", 200, {"ok": True})]


def test_stream_of_many_prompts_with_n2_matches_non_stream(client):
    body = {"model": MODEL, "prompt": ["first prompt", "second one", "third"], "max_tokens": 5,
            "n": 2}
    full = client.completions.create(**body)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            assert c.index not in finished, "no chunk after a choice's finish_reason"
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == {c.index: c.text for c in full.choices} and finished == set(range(6))


def test_errors_map_to_statuses():
    from raylm.cluster.serve.openai_api.errors import EngineOverloadedError, from_exception
    from raylm.scheduler.core.executor_base import EngineDeadError

    class BackPressureError(Exception):  # Ray Serve's queue-full error, by name
        pass

    assert from_exception(BackPressureError("queue full")).status_code == 503
    assert from_exception(EngineOverloadedError("busy")).status_code == 503
    assert from_exception(EngineDeadError("worker 2 died")).status_code == 500
    assert "worker 2 died" in from_exception(EngineDeadError("worker 2 died")).message
    assert from_exception(ValueError("bad top_p")).status_code == 500  # a bug, not the client
    assert from_exception(RuntimeError("boom")).status_code == 500


def test_cancelled_non_streaming_request_aborts_in_the_engine(tokenizer):
    import asyncio

    slow = _slow_engine(tokenizer)
    serving = OpenAIServing(slow, MODEL)

    asyncio.run(cancel_once_running(
        serving.handle("/v1/completions", {"model": MODEL, "prompt": "cancel me",
                                           "max_tokens": FOREVER}),
        lambda: bool(slow.running), settle_s=0.1))
    assert slow.running == set() and len(slow.aborted) == 1 and serving.num_pending == 0


@pytest.mark.parametrize(("interval_ms", "max_items"), [(0, None), (60_000, 2)])
def test_llm_server_streams_in_batches_of_the_configured_interval(tokenizer, interval_ms,
                                                                  max_items):
    """experimental_configs.stream_batching_interval_ms reaches the replica's stream: 0 sends
    every SSE line alone; a long window sends the first line, then everything else as one."""
    import asyncio

    from raylm.cluster.serve.deployment.app import LLMServer
    from raylm.cluster.serve.handlers.serving import COMPLETIONS

    config = {"model_loading_config": {"model_id": MODEL},
              "experimental_configs": {"stream_batching_interval_ms": interval_ms}}
    server = LLMServer(config, engine_factory=lambda cfg: FakeEngine(tokenizer, delay_s=0.001))
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "stream": True}

    async def collect():
        return [item async for item in server.handle(COMPLETIONS, body)]

    items = asyncio.run(collect())
    lines = [line for item in items for line in item.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 7  # 6 tokens, then [DONE]
    if max_items is None:
        assert len(items) == len(lines)
    else:
        assert len(items) == max_items
