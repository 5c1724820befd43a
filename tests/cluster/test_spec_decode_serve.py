"""Speculative decoding behind the real HTTP server: a client that disconnects mid-stream
from a request whose drafts are being accepted (a repetitive prompt) aborts it with its
next steps in flight; every KV block comes back and a stream running beside it gets the
very text it gets alone. The same on a Mamba2 hybrid (Bamba) served beside it in one app,
whose answers through the openai client are transformers' greedy text."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_helpers import running_serve_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny-loopy"
HYBRID = "tiny-loopy-bamba"


@pytest.fixture(scope="module")
def base_url(ray_local, loopy_llama_path, loopy_bamba_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = {"llm_configs": [
        {"model_loading_config": {"model_id": model, "model_source": path},
         "engine_kwargs": {"max_num_seqs": 8, "speculative_config": spec}}
        for model, path in ((MODEL, loopy_llama_path), (HYBRID, loopy_bamba_path))]}
    with running_serve_app(ray_local, args, "raylm-spec") as url:
        yield url


def _metric(base_url: str, name: str, model: str = MODEL, **labels: str) -> float:
    want = [f'model_name="{model}"'] + [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.split()[-1])
    return 0.0


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _stream_text(base_url: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


@pytest.mark.parametrize("model", [MODEL, HYBRID])
def test_disconnect_with_drafts_in_flight(base_url, model):
    keep = {"model": model, "prompt": "one two three one two three one two", "max_tokens": 60,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    drop = {**keep, "prompt": "four five six four five six four five", "max_tokens": 900}
    kept: list[str] = []
    survivor = threading.Thread(target=lambda: kept.append(_stream_text(base_url, keep)))
    with httpx.stream("POST", f"{base_url}/v1/completions", json=drop, timeout=60) as resp:
        lines = resp.iter_lines()
        survivor.start()
        chunks = [ln for ln in (next(lines) for _ in range(12)) if ln.startswith("data: ")]
        assert len(chunks) == 6
    # The client is gone: the request is aborted with its next steps in flight.
    survivor.join(timeout=120)
    _wait_for(lambda: _metric(base_url, "raylm:num_requests_running", model) == 0)
    _wait_for(lambda: _metric(base_url, "raylm:kv_cache_usage_perc", model) == 0)
    assert _metric(base_url, "raylm:request_success_total", model,
                   finished_reason="abort") == 1
    assert _metric(base_url, "raylm:spec_decode_num_accepted_tokens_total", model) > 0
    alone = _stream_text(base_url, keep)
    assert kept == [alone] and alone
    # The last stream's blocks come back once its request is finished, which the gauge may
    # show a moment after the client has read the last chunk.
    _wait_for(lambda: _metric(base_url, "raylm:kv_cache_usage_perc", model) == 0)


def test_the_hybrid_answers_the_openai_client_with_transformers_text(base_url,
                                                                      loopy_bamba_path,
                                                                      hf_oracle):
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                           timeout=120)
    prompt = "seven eight nine seven eight nine seven"
    out = client.completions.create(model=HYBRID, prompt=prompt, max_tokens=30,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(loopy_bamba_path)
    ids = tokenizer(prompt)["input_ids"]
    expected = tokenizer.decode(hf_oracle(loopy_bamba_path).greedy(ids, 30),
                                skip_special_tokens=True)
    assert out.choices[0].text == expected
    assert out.usage.completion_tokens == 30
