"""Speculative decoding (ngram) through the offline engine: the same tokens as
transformers and as no speculation, in both scheduling modes, with drafts really accepted."""

from __future__ import annotations

import random
import time

import pytest

from raylm import LLM, SamplingParams

ASYNC_MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _copy_heavy(vocab: int) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup can win) next to ones that do not."""
    passages = _prompts(vocab, [12, 20, 7], seed=3)
    return [passages[0] * 3, passages[1] * 2 + passages[1][:5], passages[2] * 4,
            *_prompts(vocab, [9, 30], seed=4)]


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}


def _greedy_equals_hf(llm: LLM, oracle, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """Greedy generation of ``prompts`` gives transformers' tokens, request by request."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                         for m in max_tokens])
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, m), f"prompt of {len(p)} diverged"


def _no_leak(llm: LLM) -> dict:
    """Every block is back. Under async scheduling generate() can return while a step
    booked for the finished request is still in flight: its blocks return (deferred
    free) when that step does, so wait for it (a deadline turns a leak into a failure)."""
    deadline = time.monotonic() + 30.0
    m = llm.get_metrics()
    while m["raylm:kv_cache_usage_perc"] > 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
        m = llm.get_metrics()
    assert m["raylm:num_requests_running"] == 0 and m["raylm:kv_cache_usage_perc"] == 0.0, m
    return m


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
@pytest.mark.parametrize("model, k", [("loopy", 1), ("loopy", 3), ("loopy", 5), ("llama", 3),
                                      ("loopy+draft", 3)])
def test_greedy_equals_hf_with_chunks_prefix_hits_and_preemption(
        loopy_llama_path, llama_path, loopy_draft_path, hf_oracle, model, k, async_scheduling):
    path = llama_path if model == "llama" else loopy_llama_path
    # "+draft": a draft model that agrees with the target often, not always (its drafts
    # run right after verification, into KV slots booked ahead of the step).
    spec = ({"method": "draft_model", "model": loopy_draft_path, "num_speculative_tokens": k}
            if model.endswith("+draft") else _ngram(k))
    # A 24-token budget chunks the long prompts; 36 blocks of 4 tokens cannot hold every
    # request at full length, so the scheduler preempts with drafts in flight.
    llm = LLM(path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=36,
              max_num_batched_tokens=24, max_num_seqs=8, speculative_config=spec)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = _copy_heavy(vocab)
    prompts += [prompts[0][:20] + p for p in _prompts(vocab, [3, 8], seed=5)]  # prefix hits
    max_tokens = [24, 30, 16, 28, 20, 12, 26]
    _greedy_equals_hf(llm, hf_oracle(path), prompts, max_tokens)
    m = _no_leak(llm)
    assert m["raylm:num_preemptions"] > 0 and m["raylm:prefix_cache_hits"] > 0, m
    assert m["raylm:spec_decode_num_accepted_tokens"] > 0, m
    assert m["raylm:spec_decode_num_draft_tokens"] >= m["raylm:spec_decode_num_accepted_tokens"]
    if model.endswith("+draft"):  # some drafts rejected: the rollbacks ran
        assert m["raylm:spec_decode_num_draft_tokens"] > m["raylm:spec_decode_num_accepted_tokens"]
    per_pos = [m[f'raylm:spec_decode_num_accepted_tokens_per_pos{{position="{i}"}}']
               for i in range(k)]
    assert sum(per_pos) == m["raylm:spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a draft counts only after its elders
    llm.shutdown()


def _mixed_batch(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    prompts = [{"prompt_token_ids": p} for p in _copy_heavy(vocab)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=25, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=18, n=2, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True,
                       logprobs=1),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=14, ignore_eos=True),
    ]
    return prompts, params


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_sampling_penalties_logprobs_and_n_identical_to_no_speculation(loopy_llama_path,
                                                                        loopy_draft_path):
    """Seeded sampling, penalties, logprobs and n > 1 give the very tokens of no
    speculation (drafts are verified against the target's own seeded draw), async on and
    off, alone or in a batch; with ngram drafts, and with a draft model's made one step
    ahead (on the device until the verification: penalties read them in the history)."""
    results = {}
    draft = {"method": "draft_model", "model": loopy_draft_path, "num_speculative_tokens": 3}
    for spec in (None, _ngram(3), draft):
        for async_scheduling in (False, True):
            llm = LLM(loopy_llama_path, async_scheduling=async_scheduling, speculative_config=spec)
            prompts, params = _mixed_batch(llm.llm_engine.model_config.vocab_size)
            outs = llm.generate(prompts, params)
            results[spec and spec["method"], async_scheduling] = outs
            if spec is not None:
                alone = llm.generate(prompts[:1], params[:1])[0]
                assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids
                assert _no_leak(llm)["raylm:spec_decode_num_accepted_tokens"] > 0
            llm.shutdown()
    ref = results[None, False]
    for key, outs in results.items():
        assert _tokens(outs) == _tokens(ref), key
        for o, r in zip(outs, ref, strict=True):
            for c, rc in zip(o.outputs, r.outputs, strict=True):
                if rc.logprobs is None:
                    continue
                assert len(c.logprobs) == len(c.token_ids)
                for entry, ref_entry in zip(c.logprobs, rc.logprobs, strict=True):
                    assert entry.keys() == ref_entry.keys()
                    for t in entry:
                        assert entry[t].logprob == pytest.approx(ref_entry[t].logprob, abs=1e-4)
                        assert entry[t].rank == ref_entry[t].rank


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_stops_inside_an_accepted_run(loopy_llama_path, hf_oracle, async_scheduling):
    """stop_token_ids, min_tokens, stop strings and max_tokens cut a run of accepted drafts
    exactly where the engine without speculation stops."""
    llm = LLM(loopy_llama_path, async_scheduling=async_scheduling, speculative_config=_ngram(5))
    plain = LLM(loopy_llama_path, async_scheduling=async_scheduling)
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": _copy_heavy(vocab)[2]}
    ref = hf_oracle(loopy_llama_path).greedy(prompt["prompt_token_ids"], 30)
    text = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True))[0].outputs[0].text
    g = {"temperature": 0.0}
    cases = [SamplingParams(**g, max_tokens=m, ignore_eos=True) for m in (1, 2, 4, 7)]
    for j in (3, 9, 17):
        cases.append(SamplingParams(**g, max_tokens=30, stop_token_ids=[ref[j]]))
        cases.append(SamplingParams(**g, max_tokens=30, min_tokens=j + 1,
                                    stop_token_ids=[ref[j]]))
    cases += [SamplingParams(**g, max_tokens=30, stop=[text[i:i + 3]], ignore_eos=True)
              for i in (5, 20) if text[i:i + 3].strip()]
    for params in cases:
        got = llm.generate([prompt], params)[0].outputs[0]
        want = plain.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        if params.stop_token_ids and not params.min_tokens:
            first = ref.index(params.stop_token_ids[0])
            assert got.token_ids == ref[:first + 1] and got.finish_reason == "stop"
        if params.max_tokens < 30:
            assert got.token_ids == ref[:params.max_tokens] and got.finish_reason == "length"
    assert _no_leak(llm)["raylm:spec_decode_num_accepted_tokens"] > 0
    plain.shutdown()
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_equal_to_target_accepts_every_draft(llama_path, hf_oracle, k,
                                                         async_scheduling):
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=24, speculative_config={
                  "method": "draft_model", "model": llama_path, "num_speculative_tokens": k})
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = _prompts(vocab, [5, 17, 33, 9], seed=8)
    max_tokens = [20, 13, 16, 24]
    _greedy_equals_hf(llm, hf_oracle(llama_path), prompts, max_tokens)
    m = _no_leak(llm)
    assert m["raylm:spec_decode_num_draft_tokens"] > 0, m
    assert m["raylm:spec_decode_num_accepted_tokens"] == m["raylm:spec_decode_num_draft_tokens"]
    llm.shutdown()


def test_random_draft_model_is_rejected_and_output_still_exact(llama_path, tmp_path,
                                                                 hf_oracle):
    from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint

    draft = write_random_checkpoint(str(tmp_path / "draft"), CheckpointSpec(
        seed=9, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    llm = LLM(llama_path, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    prompts = _prompts(512, [5, 17, 33], seed=8)
    _greedy_equals_hf(llm, hf_oracle(llama_path), prompts, [30] * len(prompts))
    m = _no_leak(llm)
    assert m["raylm:spec_decode_num_draft_tokens"] > 0, m
    assert m["raylm:spec_decode_num_accepted_tokens"] <= 0.1 * m[
        "raylm:spec_decode_num_draft_tokens"], m
    llm.shutdown()
    with pytest.raises(ValueError, match="speculative_config.model .*vocab_size"):
        other = write_random_checkpoint(str(tmp_path / "other"), CheckpointSpec(vocab_size=256))
        LLM(llama_path, speculative_config={"method": "draft_model", "model": other,
                                            "num_speculative_tokens": 2})


def test_disable_by_batch_size_turns_drafting_off_for_large_batches(loopy_llama_path,
                                                                     hf_oracle):
    llm = LLM(loopy_llama_path, speculative_config={**_ngram(3), "disable_by_batch_size": 1})
    prompts = _prompts(512, [7, 7], seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert _no_leak(llm)["raylm:spec_decode_num_drafts"] == 0  # two requests every step
    alone = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert _no_leak(llm)["raylm:spec_decode_num_accepted_tokens"] > 0  # one: it drafts
    oracle = hf_oracle(loopy_llama_path)
    assert alone.outputs[0].token_ids == outs[0].outputs[0].token_ids == oracle.greedy(
        prompts[0], 30)
    assert outs[1].outputs[0].token_ids == oracle.greedy(prompts[1], 30)
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_abort_with_drafts_in_flight_frees_blocks_and_keeps_others_exact(
        loopy_llama_path, hf_oracle, async_scheduling):
    """Requests aborted right after a step that accepted drafts (so the next steps are
    booked with drafts, two of them in flight under async) end with a prefix of their
    greedy output; the other requests' tokens are unchanged and every block comes back."""
    llm = LLM(loopy_llama_path, async_scheduling=async_scheduling, block_size=4,
              num_kv_blocks=64, max_num_seqs=8, speculative_config=_ngram(3))
    engine = llm.llm_engine
    prompts = _copy_heavy(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    to_abort = {"a0", "a2"}  # copy-heavy prompts: their drafts are accepted
    final: dict[str, object] = {}
    seen: dict[str, int] = {}
    while len(final) < len(prompts):
        for out in engine.step(timeout=5.0):
            rid, n = out.request_id, len(out.outputs[0].token_ids)
            grew, seen[rid] = n - seen.get(rid, 0), n
            if rid in to_abort and rid not in final and grew > 1 and n >= 3:
                final[rid] = engine.abort_request(rid)
            elif out.finished:
                final[rid] = out
    oracle = hf_oracle(loopy_llama_path)
    for i, p in enumerate(prompts):
        got = final[f"a{i}"].outputs[0]
        if f"a{i}" in to_abort:
            assert got.finish_reason == "abort", i
            assert 3 <= len(got.token_ids) < 40, (i, len(got.token_ids))
            assert got.token_ids == oracle.greedy(p, len(got.token_ids)), i
        else:
            assert got.token_ids == oracle.greedy(p, 40), i
    for _ in range(50):  # the aborted requests' blocks return once their steps have
        m = llm.get_metrics()
        if m["raylm:num_requests_running"] == 0 and m["raylm:kv_cache_usage_perc"] == 0.0:
            break
        engine.step(timeout=0.1)
    assert m["raylm:kv_cache_usage_perc"] == 0.0 and m["raylm:num_requests_running"] == 0, m
    assert m["raylm:spec_decode_num_accepted_tokens"] > 0, m
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_draft_model_drafts_right_after_verification(llama_path, hf_oracle, monkeypatch,
                                                     async_scheduling):
    """Without PP the draft model proposes step t+1's drafts inside step t, right after
    its verification, and step t+1 places them: no decode proposes at its own start."""
    from raylm.runner.spec_decode.speculator import Speculator

    calls = {"after_verification": 0, "at_step_start": 0}
    after, at_start = Speculator._draft_after_verification, Speculator._propose

    def counted_after(self, *args):
        calls["after_verification"] += 1
        return after(self, *args)

    def counted_at_start(self, wanted):
        calls["at_step_start"] += len(wanted)
        return at_start(self, wanted)

    monkeypatch.setattr(Speculator, "_draft_after_verification", counted_after)
    monkeypatch.setattr(Speculator, "_propose", counted_at_start)
    llm = LLM(llama_path, async_scheduling=async_scheduling, block_size=4, num_kv_blocks=64,
              speculative_config={"method": "draft_model", "model": llama_path,
                                  "num_speculative_tokens": 3})
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = _prompts(vocab, [5, 17, 33, 9], seed=12)
    _greedy_equals_hf(llm, hf_oracle(llama_path), prompts, [21] * len(prompts))
    m = _no_leak(llm)
    assert m["raylm:spec_decode_num_accepted_tokens"] == m["raylm:spec_decode_num_draft_tokens"]
    assert m["raylm:spec_decode_num_draft_tokens"] > 0, m
    assert calls["after_verification"] > 0 and calls["at_step_start"] == 0, calls
    llm.shutdown()
