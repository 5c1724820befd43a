"""Data parallelism behind Ray Serve: a data_parallel_size=2 model served over real HTTP to
the official openai client. The replica's deployment reserves ``[replica] + 2 x [rank]``;
the DP rank actors must live in that group, not in groups of their own (which would hold
every CPU/GPU twice and can leave a full cluster unable to place the replica's ranks)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_helpers import running_serve_app
from transformers import AutoTokenizer

pytestmark = pytest.mark.ray

MODEL = "tiny-llama-dp"


@pytest.fixture(scope="module")
def base_url(ray_local, llama_path):
    args = {"llm_configs": [
        {"model_loading_config": {"model_id": MODEL, "model_source": llama_path},
         "engine_kwargs": {"data_parallel_size": 2, "max_num_seqs": 8}}]}
    with running_serve_app(ray_local, args, "raylm-dp") as url:
        yield url


def test_dp_ranks_use_the_replica_group_and_match_transformers(base_url, llama_path, hf_oracle):
    import ray

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(6, 20))] for _ in range(6)]

    def complete(prompt: list[int]):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})

    # Concurrent, so the least-loaded router puts work on both ranks.
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    hf = hf_oracle(llama_path)
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    for prompt, r in zip(prompts, results):
        assert r.usage.completion_tokens == 8
        want = tokenizer.decode(hf.greedy(prompt, 8), skip_special_tokens=True)
        assert r.choices[0].text == want

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1, groups  # the replica's, and no group of the DP client's own
    assert len(groups[0]["bundles"]) == 3  # replica + one bundle per rank (TP = PP = 1)
