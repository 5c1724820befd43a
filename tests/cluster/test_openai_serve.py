"""End to end: real Ray, real Serve HTTP on loopback, the real AsyncLLM on the tiny llama,
the official openai client. One Ray instance and one Serve app (two models) for the module."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from serve_helpers import concurrent_streams, running_serve_app
from test_openai_fakes import ENGINE_METRIC_NAMES

pytestmark = pytest.mark.ray

MODEL, SMALL = "tiny-llama", "tiny-llama-small"
ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def base_url(ray_local, llama_path):
    args = {"http_server": {"allowed_origins": [ORIGIN]}, "llm_configs": [
        {"model_loading_config": {"model_id": MODEL, "model_source": llama_path},
         "engine_kwargs": {"max_num_seqs": 64, "tool_call_parser": "hermes", "max_n": 8},
         "deployment_config": {"max_ongoing_requests": 128}},
        # A second model, to test routing and a deliberately tiny admission limit.
        {"model_loading_config": {"model_id": SMALL, "model_source": llama_path},
         "engine_kwargs": {"max_num_seqs": 1, "max_queued_requests": 1}},
    ]}
    with running_serve_app(ray_local, args, "raylm") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(base_url: str, name: str, model: str = MODEL, **labels: str) -> float:
    want = [f'model_name="{model}"'] + [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.split()[-1])
    return 0.0


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_models_health_and_metric_names(client, base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {MODEL, SMALL}
    assert cards[MODEL]["max_model_len"] == 1024 and cards[MODEL]["owned_by"] == "raylm"
    client.completions.create(model=MODEL, prompt="warm up", max_tokens=2)
    text = httpx.get(f"{base_url}/metrics").text
    for name in ENGINE_METRIC_NAMES + ("raylm:request_success_total",
                                       "raylm:time_to_first_token_seconds_bucket",
                                       "raylm:inter_token_latency_seconds_bucket",
                                       "raylm:e2e_request_latency_seconds_sum"):
        assert f'{name}{{' in text, name
        assert f'model_name="{MODEL}"' in next(ln for ln in text.splitlines()
                                                if ln.startswith(name + "{"))


def test_greedy_stream_equals_non_stream(client):
    body = dict(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**body)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True)
                       if c.choices)
    assert streamed == full.choices[0].text
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(**chat, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


def test_n_logprobs_and_stop(client):
    r = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=5, n=2,
                                  temperature=1.0, seed=7, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    greedy = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16,
                                       temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    stop = text[len(text) // 2:][:2]
    cut = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.find(stop)]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3


def test_scoring_request_echo_logprobs_max_tokens_0(client, base_url, llama_path, hf_oracle):
    # lm-evaluation-harness's local-completions log-likelihood request: echo the prompt with
    # its per-token logprobs, generate nothing.
    prompt = [5, 17, 99, 260, 3, 44, 101]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    ref = hf_oracle(llama_path).logprobs(prompt)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.token_logprobs) == len(prompt) and r.usage.completion_tokens == 0
    for pos in range(1, len(prompt)):
        assert abs(c.logprobs.token_logprobs[pos] - ref[pos - 1, prompt[pos]].item()) < 1e-4
    assert c.text == client.completions.create(model=MODEL, prompt=prompt, max_tokens=0,
                                               echo=True).choices[0].text
    # With generation: the prompt's logprobs, then the generated tokens'.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                  logprobs=0, temperature=0, extra_body={"ignore_eos": True})
    assert len(r.choices[0].logprobs.token_logprobs) == len(prompt) + 3
    r = httpx.post(f"{base_url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_bad_input_is_400_in_the_envelope(base_url):
    long_prompt = [5 + i % 400 for i in range(1025)]
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": long_prompt})
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    assert "1025" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "gone", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b"{oops",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_disconnect_aborts_and_frees_kv(base_url):
    generated_before = metric(base_url, "raylm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        chunks = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
        assert len(chunks) == 4
        assert metric(base_url, "raylm:num_requests_running") == 1
    wait_for(lambda: metric(base_url, "raylm:num_requests_running") == 0)
    assert metric(base_url, "raylm:kv_cache_usage_perc") == 0
    # Aborted, not finished: far fewer than the 900 requested tokens were generated.
    assert metric(base_url, "raylm:generation_tokens_total") - generated_before < 900
    assert metric(base_url, "raylm:request_success_total", finished_reason="abort") >= 1


def test_64_concurrent_streams_get_exact_token_counts(base_url):
    results = concurrent_streams(base_url, MODEL)
    assert results == [("length", 16)] * 64
    wait_for(lambda: metric(base_url, "raylm:num_requests_running") == 0)


def test_overload_is_503(base_url):
    body = {"model": SMALL, "prompt": "hold the line", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    stop = threading.Event()

    def hold():  # a stream that stays open until told to go
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    try:
        for t in holders:
            t.start()
        wait_for(lambda: metric(base_url, "raylm:num_requests_running", SMALL)
                 + metric(base_url, "raylm:num_requests_waiting", SMALL) == 2)
        r = httpx.post(f"{base_url}/v1/completions",
                       json={"model": SMALL, "prompt": "one more", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        ok = httpx.post(f"{base_url}/v1/completions",
                        json={"model": MODEL, "prompt": "other model", "max_tokens": 2})
        assert ok.status_code == 200  # the limit is per model
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=120)
    wait_for(lambda: metric(base_url, "raylm:num_requests_running", SMALL) == 0)
    r = httpx.post(f"{base_url}/v1/completions",
                   json={"model": SMALL, "prompt": "after", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_app_config_reaches_the_ingress_and_the_replicas(client, base_url):
    """Through Serve: the app's http_server (CORS) configures the ingress, each model's
    engine_kwargs its replica (a tool_call_parser, the request limits); /tokenize,
    /detokenize and /version route like the rest."""
    pre = httpx.options(f"{base_url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.headers.get("access-control-allow-origin") == ORIGIN
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}]
    messages = [{"role": "user", "content": "call f"}]
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                          max_tokens=4)  # "auto": MODEL has a parser
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="tool_call_parser"):
        client.chat.completions.create(model=SMALL, messages=messages, tools=tools)
    named = client.chat.completions.create(
        model=SMALL, messages=messages, tools=tools, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) in (
        {"x": 1}, {"x": 2})
    with pytest.raises(openai.BadRequestError, match="max_n"):
        client.completions.create(model=MODEL, prompt="x", n=9)
    tok = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(f"{base_url}/detokenize", json={"model": SMALL, "tokens": tok["tokens"]}
                      ).json() == {"prompt": "hello"}
    assert httpx.get(f"{base_url}/version").json()["version"]
