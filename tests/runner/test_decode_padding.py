"""Decode steps padded to CUDA-graph buckets (the padded path runs eagerly on CPU with
RAYLM_PAD_DECODE_STEPS=1): padding never changes a token (greedy equals transformers, sync
and async), the padding rows live in a scratch KV block the scheduler never hands out, and
steps with a prefill are never padded."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.runner.cuda_graphs import decode_buckets
from raylm.runner.prepare_inputs import InputPreparer


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert decode_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(1) == [1]
    for n in (1, 3, 37, 70, 128):
        assert any(b >= n for b in decode_buckets(128))


@pytest.fixture
def padded_steps(monkeypatch):
    """Pads decode steps on this CPU engine and records each prepared step's shape."""
    monkeypatch.setenv("RAYLM_PAD_DECODE_STEPS", "1")
    seen: list[tuple[int, int]] = []
    real = InputPreparer.prepare

    def spy(self, so, settle):
        batch = real(self, so, settle)
        seen.append((len(batch.req_ids), batch.padded_rows))
        assert batch.input_ids.shape[0] == (batch.padded_rows or int(batch.num_scheduled.sum()))
        return batch

    monkeypatch.setattr(InputPreparer, "prepare", spy)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padding_never_changes_a_token(llama_path, hf_oracle, padded_steps, async_scheduling):
    prompts = [[5, 9, 33], [7] * 17, [11, 400, 7, 8, 9], [3] * 40, [250, 4]]
    max_tokens = [14, 9, 20, 6, 17]  # requests end at different steps: the batch shrinks
    with LLM(llama_path, max_num_seqs=6, async_scheduling=async_scheduling,
             dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in max_tokens])
        blocks = llm.llm_engine.core.engine_core.num_kv_blocks
        runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
        assert runner.kv_caches[0][0].shape[0] == blocks + 1  # the scratch block
        assert llm.get_metrics()["raylm:kv_cache_usage_perc"] == 0.0
    oracle = hf_oracle(llama_path)
    for p, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, m)
    padded = [(rows, pad) for rows, pad in padded_steps if pad]
    # Batches of 5 and 3 rows ran as 6 and 4; a step with a prefill ran as it was.
    assert (5, 6) in padded and (3, 4) in padded, padded_steps
    assert all(pad in decode_buckets(6) and pad >= rows for rows, pad in padded)
    assert padded_steps[0][1] == 0  # the first step holds the prompts
