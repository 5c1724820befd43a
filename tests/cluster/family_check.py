"""A model family against transformers under the engine's hardest bookkeeping: greedy
tokens equal, with chunked prefill, prefix hits and preemption observed, no KV block left."""

from __future__ import annotations

import json
import shutil

from raylm import LLM, SamplingParams


def with_config(src: str, dst, **fields) -> str:
    """A copy of the checkpoint at ``src`` in ``dst`` (a pathlib folder) with config.json's
    ``fields`` changed: a field's refusal or effect tested without rewriting the weights."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


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


def assert_state_snapshot_hits(path: str, oracle, mode: str, expected_hits: int) -> None:
    """A hybrid model's prefix hit from a state snapshot (scheduler/kv/state_snapshots.py):
    a 23-token prompt runs in one chunk (blocks of 4, a 64-token budget), then a prompt
    sharing its first 10 tokens. "all" saved the state at every block boundary that chunk
    passed, so the second hits 8 tokens; "align" cut the chunk at 20 and saved only there,
    so it hits none. Both equal transformers."""
    first = list(range(100, 123))
    second = first[:10] + list(range(500, 512))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(path, block_size=4, max_num_batched_tokens=64, mamba_cache_mode=mode) as llm:
        a = llm.generate([{"prompt_token_ids": first}], params)
        before = llm.get_metrics()["raylm:prefix_cache_hits"]
        b = llm.generate([{"prompt_token_ids": second}], params)
        hits = llm.get_metrics()["raylm:prefix_cache_hits"] - before
    assert a[0].outputs[0].token_ids == oracle.greedy(first, 6)
    assert b[0].outputs[0].token_ids == oracle.greedy(second, 6)
    assert hits == expected_hits
