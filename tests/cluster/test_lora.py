"""Multi-LoRA through the offline engine against transformers + PEFT (the adapter applied
unmerged), token for token: four random adapters of different ranks (rsLoRA, attention
only, MLP only) and the base model in one mixed batch, sync and async, through chunked
prefill, preemption and prefix hits on prompts that share a prefix across adapters;
adapters swapped in and out of fewer device slots (and host slots) than they number, the
requests waiting, none lost; padded decode steps; speculative decoding (the draft model
runs without adapters) and structured output beside adapters; the intake's refusals."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from test_llm_correctness import ASYNC_MODES

from raylm import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

ENGINE = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)
# Request i runs adapter ADAPTER_OF[i] (None: the base model).
ADAPTER_OF = [0, None, 1, 2, 3, 1, 0, None, 2, 3]
MAX_TOKENS = [20, 16, 24, 12, 18, 22, 15, 10, 14, 9]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 9, 4, 30, 12, 7, 3, 40,
                                                                   8, 17)]
    # The same 20-token prefix under the base model and three adapters: a block shared
    # across adapters would hand one adapter another's KV.
    for i in (1, 2, 5, 8, 9):
        prompts[i] = shared + prompts[i]
    return prompts


def _loras(adapters: list[str]) -> list[LoRARequest | None]:
    return [None if a is None else LoRARequest(f"adapter{a}", a + 1, adapters[a])
            for a in ADAPTER_OF]


@pytest.fixture(scope="module")
def expected(lora_adapters, peft_oracle) -> list[list[int]]:
    out = [peft_oracle.greedy(None if a is None else lora_adapters[a], p, m)
           for a, p, m in zip(ADAPTER_OF, _prompts(), MAX_TOKENS, strict=True)]
    base = [peft_oracle.greedy(None, p, m) for p, m in zip(_prompts(), MAX_TOKENS, strict=True)]
    # Every adapter changes the tokens (the test would not see a missing product).
    assert all(o != b for o, b, a in zip(out, base, ADAPTER_OF, strict=True) if a is not None)
    return out


def _generate(llm: LLM, adapters: list[str], **kwargs) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                        lora_request=_loras(adapters), use_tqdm=False, **kwargs)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runner(llm: LLM):
    return llm.llm_engine.core.engine_core.executor.worker.model_runner


def _idle(llm: LLM) -> dict:
    m = llm.get_metrics()
    assert m["raylm:num_requests_running"] == 0 and m["raylm:num_requests_waiting"] == 0
    assert m["raylm:kv_cache_usage_perc"] == 0.0, m
    return m


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_mixed_batch_equals_peft(llama_path, lora_adapters, expected, async_scheduling):
    llm = LLM(llama_path, enable_lora=True, max_loras=4, max_lora_rank=16,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        assert _generate(llm, lora_adapters) == expected
        m = _idle(llm)
        assert m["raylm:num_preemptions"] > 0, m
        assert m["raylm:prefix_cache_hits"] > 0, m  # within one adapter
        info = [k for k in m if k.startswith("raylm:lora_requests_info{")]
        assert info == ['raylm:lora_requests_info{running_lora_adapters="",'
                        'waiting_lora_adapters="",max_lora="4"}'], info
        assert _runner(llm).lora.stats == {"disk_loads": 4, "slot_loads": 4}
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", ASYNC_MODES)
def test_fewer_slots_than_adapters_swap_without_loss(llama_path, lora_adapters, expected,
                                                     async_scheduling):
    """max_loras=2 device slots and max_cpu_loras=2 host slots for 4 adapters: requests of
    a third adapter wait (a step needing more slots than there are raises on the worker),
    and every request gets its exact tokens; the second run finds adapters 2 and 3 in the
    slots, so 0 and 1 are swapped in again, and read from disk again."""
    llm = LLM(llama_path, enable_lora=True, max_loras=2, max_cpu_loras=2,
              async_scheduling=async_scheduling, **ENGINE)
    try:
        assert _generate(llm, lora_adapters) == expected
        assert _generate(llm, lora_adapters) == expected
        _idle(llm)
        stats = _runner(llm).lora.stats
        assert stats["slot_loads"] > 4 and stats["disk_loads"] > 4, stats
    finally:
        llm.shutdown()


def test_padded_decode_steps_equal_peft(llama_path, lora_adapters, expected, monkeypatch):
    """Decode steps padded to their CUDA-graph bucket (run eagerly here): padding rows
    carry no adapter."""
    monkeypatch.setenv("RAYLM_PAD_DECODE_STEPS", "1")
    llm = LLM(llama_path, enable_lora=True, max_loras=4, **ENGINE)
    try:
        assert _runner(llm).pad_decode_steps
        assert _generate(llm, lora_adapters) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("spec", [
    pytest.param({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 id="ngram"),
    pytest.param({"method": "draft_model", "num_speculative_tokens": 2}, id="draft-model"),
])
def test_speculative_decoding_with_adapters_equals_peft(llama_path, lora_adapters, expected,
                                                        spec):
    """The draft model is the base checkpoint and runs without adapters: its drafts are
    verified by the adapted target, so only acceptance changes, never the tokens."""
    if spec["method"] == "draft_model":
        spec = {**spec, "model": llama_path}
    llm = LLM(llama_path, enable_lora=True, max_loras=4, speculative_config=spec, **ENGINE)
    try:
        assert _generate(llm, lora_adapters) == expected
        m = _idle(llm)
        assert m["raylm:spec_decode_num_draft_tokens"] > 0, m
        if spec["method"] == "draft_model":  # base drafts: the base rows accept them all
            assert 0 < m["raylm:spec_decode_num_accepted_tokens"] < m[
                "raylm:spec_decode_num_draft_tokens"], m
    finally:
        llm.shutdown()


def test_structured_output_with_an_adapter(llama_path, lora_adapters):
    llm = LLM(llama_path, enable_lora=True)
    try:
        choices = ["river", "mountain", "garden"]
        params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=
                                StructuredOutputsParams(choice=choices))
        outs = llm.generate(["the quick brown fox", "hello world"], params, lora_request=[
            LoRARequest("a", 1, lora_adapters[0]), None])
        assert all(o.outputs[0].text in choices for o in outs), [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def test_intake_refusals(llama_path, lora_adapters, tmp_path):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(max_tokens=2)
    plain = LLM(llama_path)
    try:
        with pytest.raises(ValueError, match="without LoRA"):
            plain.generate([prompt], params, lora_request=LoRARequest("a", 1, lora_adapters[0]))
    finally:
        plain.shutdown()
    llm = LLM(llama_path, enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="rank 16, more than max_lora_rank=8"):
            llm.generate([prompt], params, lora_request=LoRARequest("big", 3, lora_adapters[2]))
        llm.generate([prompt], params, lora_request=LoRARequest("a", 1, lora_adapters[0]))
        with pytest.raises(ValueError, match="one id must always name the same adapter"):
            llm.generate([prompt], params, lora_request=LoRARequest("b", 1, lora_adapters[1]))
        with pytest.raises(ValueError, match="has 2 entries but there are 1 prompts"):
            llm.generate([prompt], params, lora_request=[None, None])
        dora = shutil.copytree(lora_adapters[0], tmp_path / "dora")
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        with pytest.raises(ValueError, match="use_dora=True is not supported"):
            llm.generate([prompt], params, lora_request=LoRARequest("d", 5, str(dora)))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate([prompt], params, lora_request=LoRARequest("e", 6, str(tmp_path)))
        with pytest.raises(ValueError, match="lora_int_id must be an int of at least 1"):
            LoRARequest("z", 0, lora_adapters[0])
        assert os.path.isdir(lora_adapters[0])
    finally:
        llm.shutdown()
