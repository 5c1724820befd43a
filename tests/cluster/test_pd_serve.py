"""The prefill/decode Serve app (``build_pd_openai_app``) on a real local Ray: the openai
client gets the colocated engine's tokens, streaming and not; a client that leaves
aborts the request and frees the KV on both sides; a prefill replica killed mid-request
falls back to a local prefill on the decode side (the client sees no error) and the
next requests succeed.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from serve_helpers import concurrent_streams, running_serve_app

from raylm import LLM, SamplingParams

pytestmark = pytest.mark.ray

MODEL = "tiny-llama-pd"
APP = "raylm-pd"


def _side(path: str, **engine_kwargs) -> dict:
    return {"model_loading_config": {"model_id": MODEL, "model_source": path},
            "engine_kwargs": {"block_size": 8, "max_model_len": 1024, **engine_kwargs},
            "deployment_config": {"num_replicas": 1, "max_ongoing_requests": 128}}


@pytest.fixture(scope="module")
def base_url(ray_local, llama_path):
    from raylm.cluster.serve.pd.pd_app import build_pd_openai_app

    # A small token budget on the prefill side: a long prompt takes many steps there
    # (chunked prefill), long enough to kill the replica in the middle of it.
    args = {"prefill_config": _side(llama_path, max_num_batched_tokens=8),
            "decode_config": _side(llama_path)}
    with running_serve_app(ray_local, args, APP, build=build_pd_openai_app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def colocated(llama_path):
    llm = LLM(llama_path, block_size=8, max_model_len=1024)
    yield llm
    llm.shutdown()


def _side_stats(kind: str) -> dict:
    from ray import serve

    handle = serve.get_deployment_handle(f"PD{kind}:{MODEL}", APP)
    return handle.get_stats.remote().result()


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _kv_free_on_both_sides() -> bool:
    return all(_side_stats(k)["kv_cache_usage_perc"] == 0 for k in ("Prefill", "Decode"))


def test_openai_client_gets_the_colocated_tokens(client, colocated):
    prompts = ["the quick brown fox", "a tale of two cities, chapter one"]
    want = colocated.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    for prompt, ref in zip(prompts, want, strict=True):
        body = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
        full = client.completions.create(**body)
        assert full.choices[0].text == ref.outputs[0].text
        assert full.usage.completion_tokens == 12
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **body, stream=True) if c.choices)
        assert streamed == ref.outputs[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content) >= 1
    decode = _side_stats("Decode")["kv_connector"]
    assert decode["raylm:external_prefix_cache_hits"] > 0
    assert decode["raylm:kv_transfer_bytes_transferred"] > 0
    _wait_for(_kv_free_on_both_sides)


def test_concurrent_streams(base_url):
    assert concurrent_streams(base_url, MODEL, n=16, max_tokens=8) == [("length", 8)] * 16
    _wait_for(_kv_free_on_both_sides)


def test_disconnect_aborts_and_frees_kv_on_both_sides(base_url):
    body = {"model": MODEL, "prompt": "a long story " * 20, "max_tokens": 700,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        chunks = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
        assert len(chunks) == 4
        assert _side_stats("Decode")["num_requests_running"] == 1
    _wait_for(lambda: _side_stats("Decode")["num_requests_running"] == 0)
    _wait_for(_kv_free_on_both_sides)
    assert _side_stats("Decode")["generation_tokens_total"] < 700 * 2


def _prefill_replica() -> object:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "PDPrefill" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def test_prefill_replica_killed_mid_request_falls_back_to_local_prefill(
        base_url, client, colocated):
    import ray

    prompt = "tell me everything about the river " * 60  # hundreds of tokens: many steps
    want = colocated.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    result: dict = {}

    def ask() -> None:
        try:
            result["out"] = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=ask)
    t.start()
    _wait_for(lambda: _side_stats("Prefill")["num_requests_running"] == 1, timeout=30)
    ray.kill(_prefill_replica())
    t.join(timeout=120)
    assert "error" not in result, result
    assert result["out"].choices[0].text == want  # prefilled by the decode engine instead
    metrics = httpx.get(f"{base_url}/metrics").text
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("raylm:pd_num_local_prefill_fallbacks"))
    assert float(line.split()[-1]) >= 1
    for _ in range(3):  # the next requests succeed (fallback or the restarted replica)
        out = client.completions.create(model=MODEL, prompt="after the crash", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
