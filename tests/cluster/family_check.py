"""A model family against transformers under the engine's hardest bookkeeping: greedy
tokens equal, with chunked prefill, prefix hits and preemption observed, no KV block left."""

from __future__ import annotations

from raylm import LLM, SamplingParams


def assert_greedy_equals_transformers(path: str, oracle, prompts: list[list[int]],
                                      lengths: list[int], **engine) -> None:
    """``engine``: LLM arguments small enough that the batch chunks, hits the prefix cache
    (prompts sharing a start) and preempts."""
    with LLM(path, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                             for n in lengths])
        metrics = llm.get_metrics()
    for p, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, n), f"prompt of {len(p)} tokens"
    assert metrics["raylm:prefix_cache_hits"] > 0 and metrics["raylm:num_preemptions"] > 0
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
