"""Prefill/decode disaggregation on Ray (the RayKVConnector): a prefill engine computes the
prompt's KV and first token, a decode engine pulls the blocks and continues. Greedy tokens
equal transformers and the colocated engine: sync and async decode, chunked prefill on
the prefill side, TP=2 on one side and 1 on the other, speculative decoding and
structured output on the decode side, failed pulls (fault injector, a dead prefill
engine) recomputed locally; both sides' KV pools drain. The pulls go through Ray's object
store, or Ray Direct Transport for a decode engine that asks for it.
"""

from __future__ import annotations

import random
import sys
import time

import pytest
import ray

from raylm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.ray

MAX_TOKENS = 10
TRANSPORT_BYTES = 'raylm:kv_connector_transfer_bytes{{transport="{}"}}'
COMMON = dict(block_size=8, distributed_executor_backend="ray", max_num_seqs=8,
              max_model_len=256)


def _kv(role: str, **extra) -> dict:
    return {"kv_connector": "RayKVConnector", "kv_role": role,
            "kv_connector_extra_config": extra}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    # Logical CPUs (24): several engines' actors share this machine's cores.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray_local


@pytest.fixture(scope="module")
def engines(loopy_llama_path):
    """Prefill: TP=1 with a 16-token budget (chunked prefill), TP=2. Decode: sync TP=1;
    async TP=2 with ngram speculation, pulling through Ray Direct Transport; async TP=1
    whose pulls fail at random."""
    path = loopy_llama_path
    made = {
        "p1": LLM(path, kv_transfer_config=_kv("kv_producer"), max_num_batched_tokens=16,
                  **COMMON),
        "p2": LLM(path, kv_transfer_config=_kv("kv_producer"), tensor_parallel_size=2,
                  **COMMON),
        "d_sync": LLM(path, kv_transfer_config=_kv("kv_consumer"), async_scheduling=False,
                      **COMMON),
        "d_spec": LLM(path, kv_transfer_config=_kv("kv_consumer", transport="rdt"),
                      tensor_parallel_size=2,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                      **COMMON),
        "d_faulty": LLM(path, kv_transfer_config=_kv(
            "kv_consumer", fault_injection={"fail_prob": 0.5, "delay_steps": 2, "seed": 3}),
            **COMMON),
    }
    yield made
    for llm in made.values():
        llm.shutdown()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def _engine_id(llm: LLM) -> str:
    return str(llm.llm_engine.engine_config.kv_transfer_config.engine_id)


def pd_generate(prefill: LLM, decode: LLM, prompts: list, params: SamplingParams):
    """What the PD proxy does, offline: prefill with max_tokens=1 (its blocks are held for
    the decode engine), then decode with the prefill's kv_transfer_params."""
    first = prefill.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)
    tp = prefill.llm_engine.engine_config.parallel_config.tensor_parallel_size
    remote = [params.clone(extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": _engine_id(prefill),
        "remote_request_id": out.request_id, "remote_tp_size": tp}}) for out in first]
    return decode.generate(prompts, remote, use_tqdm=False)


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _wait_drained(*llms: LLM, timeout_s: float = 20.0) -> None:
    """Every side's KV pool empties (the prefill side once the decode side released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = [llm.get_metrics()["raylm:kv_cache_usage_perc"] for llm in llms]
        if not any(usage):
            return
        assert time.monotonic() < deadline, f"KV still in use: {usage}"
        time.sleep(0.1)


@pytest.mark.parametrize("prefill, decode", [
    pytest.param("p1", "d_sync", id="chunked-prefill-sync-decode"),
    pytest.param("p1", "d_spec", id="tp1-to-tp2-async-spec-decode"),
    pytest.param("p2", "d_sync", id="tp2-to-tp1"),
])
def test_pd_greedy_matches_hf(engines, loopy_llama_path, hf_oracle, prefill, decode):
    prompts = _prompts(4, seed=len(prefill + decode))
    outs = pd_generate(engines[prefill], engines[decode],
                       [{"prompt_token_ids": p} for p in prompts], _greedy())
    oracle = hf_oracle(loopy_llama_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
    m = engines[decode].get_metrics()
    assert m["raylm:external_prefix_cache_hits"] >= sum(len(p) for p in prompts)
    assert m["raylm:kv_transfer_bytes_transferred"] > 0
    transport = engines[decode].llm_engine.engine_config.kv_transfer_config.pd_transport
    assert m[TRANSPORT_BYTES.format(transport)] == m["raylm:kv_transfer_bytes_transferred"]
    _wait_drained(engines[prefill], engines[decode])


@pytest.mark.parametrize("prefill", ["p1", "p2"])
def test_pd_over_ray_direct_transport_matches_hf(engines, loopy_llama_path, hf_oracle,
                                                 prefill):
    """The TP=2 decode engine pulls through Ray Direct Transport (a Gloo pair per decode
    rank and prefill rank, made on the first pull; from TP=1 both decode ranks pair with
    the one prefill rank): transformers' tokens, and every byte came that way."""
    prompts = _prompts(3, seed=len(prefill) + 20)
    decode = engines["d_spec"]
    before = decode.get_metrics()
    outs = pd_generate(engines[prefill], decode, [{"prompt_token_ids": p} for p in prompts],
                       _greedy())
    oracle = hf_oracle(loopy_llama_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
    m = decode.get_metrics()
    moved = m["raylm:kv_transfer_bytes_transferred"] - before.get(
        "raylm:kv_transfer_bytes_transferred", 0)
    assert moved > 0
    assert m[TRANSPORT_BYTES.format("rdt")] - before.get(TRANSPORT_BYTES.format("rdt"), 0) \
        == moved
    assert TRANSPORT_BYTES.format("object_store") not in m
    # This test's pulls, not the shared engine's life (an earlier test's pull may time out
    # on a loaded machine and be recomputed, as designed).
    failed = "raylm:kv_connector_num_failed_load_requests"
    assert m[failed] - before.get(failed, 0) == 0
    _wait_drained(engines[prefill], decode)


def test_pd_structured_output_matches_colocated(engines, loopy_llama_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    prompts = ["a number as JSON:", "and another one, please:"]
    pd = pd_generate(engines["p1"], engines["d_spec"], prompts, params)
    local = LLM(loopy_llama_path, block_size=8, max_model_len=256)
    try:
        colocated = local.generate(prompts, params, use_tqdm=False)
    finally:
        local.shutdown()
    assert [o.outputs[0].token_ids for o in pd] == [o.outputs[0].token_ids for o in colocated]
    _wait_drained(engines["p1"], engines["d_spec"])


def test_failed_pulls_are_recomputed(engines, loopy_llama_path, hf_oracle):
    """Half the pulled blocks are spoiled (and completions arrive late): each request
    returns to its last good block, recomputes the rest, and ends with transformers'
    tokens; nothing leaks on either side."""
    prompts = _prompts(6, seed=7)
    outs = pd_generate(engines["p1"], engines["d_faulty"],
                       [{"prompt_token_ids": p} for p in prompts], _greedy())
    oracle = hf_oracle(loopy_llama_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
    m = engines["d_faulty"].get_metrics()
    assert m["raylm:kv_connector_num_failed_loads"] > 0
    assert m["raylm:kv_connector_num_recomputed_tokens"] >= 8 * m[
        "raylm:kv_connector_num_failed_load_requests"] > 0
    _wait_drained(engines["p1"], engines["d_faulty"])


def test_dead_prefill_engine_is_recomputed_locally(engines, loopy_llama_path, hf_oracle):
    """The prefill engine dies after its prompts finished: the decode engine's pulls fail
    and it computes the prompts itself (last: it kills p2)."""
    prompts = _prompts(2, seed=11)
    prefill, decode = engines["p2"], engines["d_sync"]
    first = prefill.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)
    engine_id = _engine_id(prefill)
    prefill.shutdown()
    remote = [_greedy().clone(extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": engine_id,
        "remote_request_id": o.request_id, "remote_tp_size": 2}}) for o in first]
    outs = decode.generate([{"prompt_token_ids": p} for p in prompts], remote, use_tqdm=False)
    oracle = hf_oracle(loopy_llama_path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
    assert decode.get_metrics()["raylm:kv_connector_num_failed_load_requests"] == 2
    _wait_drained(decode)


def test_latent_attention_moves_its_one_cache_row(tmp_path_factory, hf_oracle):
    """DeepSeek-V3: a TP=2 prefill engine (each rank the whole latent cache) to a TP=1
    decode engine; transformers' tokens, and what moved is the latent and rotated key
    alone: (32 + 16) float32 per token and layer of every block the prompt touches (half
    what a key and a value tensor would move), pulled from one prefill rank."""
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    path = write_random_checkpoint(str(tmp_path_factory.mktemp("mla-pd")), CheckpointSpec(
        architecture="DeepseekV3ForCausalLM", num_hidden_layers=3, seed=48))
    prefill = LLM(path, kv_transfer_config=_kv("kv_producer"), tensor_parallel_size=2,
                  **COMMON)
    decode = LLM(path, kv_transfer_config=_kv("kv_consumer"), **COMMON)
    try:
        prompts = _prompts(3, seed=30)
        outs = pd_generate(prefill, decode, [{"prompt_token_ids": p} for p in prompts],
                           _greedy())
        oracle = hf_oracle(path)
        for p, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
        m = decode.get_metrics()
        bs = COMMON["block_size"]
        assert m["raylm:external_prefix_cache_hits"] > 0
        blocks = sum(-(-len(p) // bs) for p in prompts)
        assert m["raylm:kv_transfer_bytes_transferred"] == blocks * bs * 3 * (32 + 16) * 4
        _wait_drained(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
