"""The prefix router end to end: a local Ray with three replicas of the tiny Llama behind the
ingress deployment, the real engines' prefix-cache counters read per replica from the
ingress's /metrics. Requests sharing a prefix land on the replica that holds it while load
is balanced (every repeat is a full hit); a hot prefix overflows to other replicas;
requests for a LoRA adapter go to the replica that holds it; a killed replica leaves the
router and its replacement joins."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from serve_helpers import running_serve_app

pytestmark = pytest.mark.ray

MODEL = "tiny-llama"
PREFIX = 48  # three KV blocks of 16
ADAPTERS = ("ad0", "ad1")


@pytest.fixture(scope="module")
def base_url(ray_local, llama_path, lora_adapters):
    args = {"llm_configs": [{
        "model_loading_config": {"model_id": MODEL, "model_source": llama_path},
        "engine_kwargs": {"max_num_seqs": 8, "max_model_len": 512, "enable_lora": True,
                          "max_loras": 2, "max_lora_rank": 16,
                          "lora_modules": [f"{name}={path}" for name, path
                                           in zip(ADAPTERS, lora_adapters)]},
        "deployment_config": {"num_replicas": 3, "max_ongoing_requests": 16,
                              "request_router": {"policy": "prefix", "imbalance_threshold": 2,
                                                 "stats_period_s": 0.5}}}]}
    with running_serve_app(ray_local, args, "raylm-routing") as url:
        yield url


def samples(base_url: str, name: str) -> dict[str, float]:
    """``name``'s samples on /metrics, by their label text."""
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        m = re.match(re.escape(name) + r"\{(.*)\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def per_replica(base_url: str, name: str) -> dict[str, float]:
    return {re.search(r'replica="([^"]+)"', k).group(1): v
            for k, v in samples(base_url, name).items() if "replica=" in k}


def decisions(base_url: str) -> dict[str, float]:
    return {re.search(r'decision="([^"]+)"', k).group(1): v
            for k, v in samples(base_url, "raylm:router_requests_total").items()}


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f} s"
        time.sleep(0.25)


def prompt(prefix: int, i: int) -> list[int]:
    return [10 + (prefix * 37 + j) % 400 for j in range(PREFIX)] + [450 + i % 60] * 5


def complete(base_url: str, ids: list[int], max_tokens: int = 2, model: str = MODEL) -> str:
    r = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def settled(base_url: str, queries_before: dict[str, float], expected_tokens: int):
    """Per-replica counters once the replicas' reports include ``expected_tokens`` more
    prompt tokens queried than ``queries_before``."""
    def done():
        now = per_replica(base_url, "raylm:prefix_cache_queries_total")
        grown = sum(now.values()) - sum(queries_before.values())
        return now if len(now) == 3 and grown >= expected_tokens else None
    return wait_for(done, what=f"{expected_tokens} prompt tokens in the replicas' reports")


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(base_url):
    wait_for(lambda: len(per_replica(base_url, "raylm:prefix_cache_queries_total")) == 3,
             what="three replicas reporting")
    queries0 = per_replica(base_url, "raylm:prefix_cache_queries_total")
    hits0 = per_replica(base_url, "raylm:prefix_cache_hits_total")
    before = decisions(base_url)
    repeats, prefixes = 4, (1, 2, 3)
    for i in range(repeats):
        for p in prefixes:
            complete(base_url, prompt(p, i))  # one at a time: the load stays balanced
    settled(base_url, queries0, repeats * len(prefixes) * (PREFIX + 5))
    hits = per_replica(base_url, "raylm:prefix_cache_hits_total")
    gained = {r: hits[r] - hits0.get(r, 0) for r in hits}
    # Every repeat found its whole prefix: it went where its first request went.
    assert sum(gained.values()) == (repeats - 1) * len(prefixes) * PREFIX, gained
    after = decisions(base_url)
    assert after.get("prefix_match", 0) - before.get("prefix_match", 0) == \
        (repeats - 1) * len(prefixes), after


def test_a_hot_prefix_overflowing_one_replica_spills_to_the_others(base_url):
    # One request first, alone: the router's mirror then holds the hot prefix on one
    # replica only, and the burst piles onto it until the loads differ (were the burst
    # first, its early requests would find no match and spread by free KV).
    warm0 = per_replica(base_url, "raylm:prefix_cache_queries_total")
    complete(base_url, prompt(7, 99))
    queries0 = settled(base_url, warm0, PREFIX + 5)
    before = decisions(base_url)
    n = 12

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=prompt(7, i), max_tokens=48,
                extra_body={"ignore_eos": True}) for i in range(n)))

    asyncio.run(burst())
    now = settled(base_url, queries0, n * (PREFIX + 5))
    served = {r for r in now if now[r] > queries0.get(r, 0)}
    assert len(served) >= 2, (queries0, now)
    assert decisions(base_url).get("least_loaded", 0) > before.get("least_loaded", 0)


def test_requests_for_an_adapter_go_to_the_replica_that_holds_it(base_url, lora_adapters,
                                                                 peft_oracle, llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_path)
    before = decisions(base_url)
    for adapter, path in zip(ADAPTERS, lora_adapters):
        queries0 = per_replica(base_url, "raylm:prefix_cache_queries_total")
        for i in range(4):  # no shared prefix: each prompt's first block is its own
            ids = [20 + (ord(adapter[-1]) * 7 + i * 31 + j) % 400 for j in range(20)]
            assert complete(base_url, ids, 4, adapter) == tok.decode(
                peft_oracle.greedy(path, ids, 4))
        now = settled(base_url, queries0, 4 * 20)
        served = [r for r in now if now[r] > queries0.get(r, 0)]
        assert len(served) == 1, (adapter, queries0, now)  # all four on one replica
    after = decisions(base_url)
    # The first request of each adapter picks by free KV; the other three follow it.
    assert after.get("adapter_match", 0) - before.get("adapter_match", 0) == 6, after


def test_a_killed_replica_leaves_the_router_and_its_replacement_joins(base_url):
    import ray

    replicas = set(per_replica(base_url, "raylm:prefix_cache_queries_total"))
    victim = sorted(replicas)[0]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(victim)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # Requests keep being served meanwhile, by the live replicas.
    complete(base_url, prompt(1, 99))
    wait_for(lambda: victim not in per_replica(base_url, "raylm:num_requests_running"),
             what="the killed replica gone from the router")
    joined = wait_for(lambda: (lambda now: now if len(now) == 3 else None)(
        set(per_replica(base_url, "raylm:num_requests_running"))), timeout=180,
        what="a replacement replica reporting")
    assert victim not in joined and len(joined - replicas) == 1
    for i in range(3):
        complete(base_url, prompt(2, 100 + i))
    assert samples(base_url, "raylm:router_num_replicas")[f'model_name="{MODEL}"'] == 3
