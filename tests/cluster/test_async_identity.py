"""Async scheduling gives exactly what synchronous scheduling gives (docs/architecture.md §3), through the
real engine, on one workload that mixes every feature the ledger touches: short and long
prompts, max_tokens 1..24, min_tokens, stop_token_ids, stop strings, penalties, logprobs,
seeded sampling, prefix-cache hits, chunked prefill, forced preemption and aborts in flight.
The greedy requests must also equal transformers."""

from __future__ import annotations

import random

import pytest

from raylm import LLM, SamplingParams

ENGINE = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=8)


def _workload(vocab: int, oracle) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(21)
    shared = [rng.randrange(3, vocab) for _ in range(12)]
    prompts, params = [], []
    g = dict(temperature=0.0)
    for i, (n, max_tokens) in enumerate([(1, 1), (5, 2), (40, 3), (9, 5), (60, 16), (3, 24),
                                         (17, 16), (25, 12)]):
        p = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(shared + p if i % 3 == 0 else p)  # every third shares a prefix
        params.append(SamplingParams(**g, max_tokens=max_tokens, ignore_eos=True))
    # A stop token the greedy run reaches after min_tokens (and not before: min_tokens
    # masks stop tokens, which would change the earlier tokens).
    gated_prompt = [rng.randrange(3, vocab) for _ in range(13)]
    ref = oracle.greedy(gated_prompt, 20)
    j = next(i for i in range(6, 20) if ref[i] not in ref[:i])
    prompts.append(gated_prompt)
    params.append(SamplingParams(**g, max_tokens=20, min_tokens=6, stop_token_ids=[ref[j]]))
    extra = [
        SamplingParams(**g, max_tokens=20, stop=["e", "a"]),
        SamplingParams(**g, max_tokens=20, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(**g, max_tokens=20, repetition_penalty=1.8),
        SamplingParams(**g, max_tokens=10, logprobs=4, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=16),
        SamplingParams(temperature=1.2, min_p=0.05, seed=12, max_tokens=16, presence_penalty=0.5),
    ]
    for sp in extra:
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(4, 30))])
        params.append(sp)
    return prompts, params


def _run(path: str, async_scheduling: bool, prompts, params):
    llm = LLM(path, async_scheduling=async_scheduling, **ENGINE)
    assert llm.llm_engine.engine_config.scheduler_config.async_scheduling is async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = llm.get_metrics()
    llm.shutdown()
    return outs, metrics


def test_async_equals_sync_on_a_mixed_workload(llama_path, hf_oracle):
    oracle = hf_oracle(llama_path)
    prompts, params = _workload(512, oracle)
    sync_outs, sync_m = _run(llama_path, False, prompts, params)
    async_outs, async_m = _run(llama_path, True, prompts, params)
    for m in (sync_m, async_m):
        assert m["raylm:num_preemptions"] > 0, m
        assert m["raylm:prefix_cache_hits"] > 0, m
        assert m["raylm:kv_cache_usage_perc"] == 0.0, m
    for i, (s, a) in enumerate(zip(sync_outs, async_outs, strict=True)):
        cs, ca = s.outputs[0], a.outputs[0]
        assert ca.token_ids == cs.token_ids, f"request {i}: async != sync"
        assert (ca.text, ca.finish_reason, ca.stop_reason) == (cs.text, cs.finish_reason, cs.stop_reason)
        if cs.logprobs is not None:
            for es, ea in zip(cs.logprobs, ca.logprobs, strict=True):
                assert es.keys() == ea.keys()
                for t in es:
                    assert ea[t].logprob == pytest.approx(es[t].logprob, abs=1e-5)
                    assert ea[t].rank == es[t].rank
        sp = params[i]
        plain_greedy = sp.temperature == 0.0 and not sp.stop and not sp.stop_token_ids and (
            not sp.needs_output_history)
        if plain_greedy:
            ref = oracle.greedy(prompts[i], sp.max_tokens, ignore_eos=sp.ignore_eos)
            assert cs.token_ids == ref, f"request {i} diverged from transformers"
    # The features really fired: a min_tokens-gated stop token, a stop string, length caps.
    gated, stopped = sync_outs[8].outputs[0], sync_outs[9].outputs[0]
    assert gated.finish_reason == "stop" and gated.stop_reason == params[8].stop_token_ids[0]
    assert len(gated.token_ids) >= 7
    assert stopped.finish_reason == "stop" and stopped.stop_reason in ("e", "a")
    assert [o.outputs[0].finish_reason for o in sync_outs[:8]] == ["length"] * 8


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_in_flight_delivers_a_prefix_and_frees_blocks(llama_path, hf_oracle, async_scheduling):
    llm = LLM(llama_path, async_scheduling=async_scheduling, **ENGINE)
    engine = llm.llm_engine
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 19, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    final: dict[str, object] = {}
    aborted = False
    while len(final) < 3:
        for out in engine.step(timeout=5.0):
            if not aborted and out.request_id == "a1" and len(out.outputs[0].token_ids) >= 3:
                # Abort while later steps for a1 are already in flight (async: two of them).
                final["a1"] = engine.abort_request("a1")
                aborted = True
            elif out.finished:
                final[out.request_id] = out
    oracle = hf_oracle(llama_path)
    a1 = final["a1"].outputs[0]
    assert a1.finish_reason == "abort"
    assert 3 <= len(a1.token_ids) < 40
    assert a1.token_ids == oracle.greedy(prompts[1], len(a1.token_ids))
    for rid in ("a0", "a2"):
        i = int(rid[1])
        assert final[rid].outputs[0].token_ids == oracle.greedy(prompts[i], 40)
    # The aborted request's blocks come back once its in-flight steps have returned.
    for _ in range(50):
        m = llm.get_metrics()
        if m["raylm:num_requests_running"] == 0 and m["raylm:kv_cache_usage_perc"] == 0.0:
            break
        engine.step(timeout=0.1)
    assert m["raylm:kv_cache_usage_perc"] == 0.0, m
    llm.shutdown()
