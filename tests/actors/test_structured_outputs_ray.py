"""Structured outputs on the Ray executor: the grammar bitmask travels the step stream to
the workers (with PP, the last stage samples with it; every TP rank of it applies it), and
greedy constrained output equals the single-process engine's, TP=2 and PP=2, async on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from structured_workload import check, wait_for_free_kv, workload  # noqa: E402

from raylm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENGINE = dict(max_num_seqs=16, block_size=16, max_model_len=512)
ITEMS = workload(16)
FREE = ["an unconstrained prompt", "another one about rivers"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    yield ray_local


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=(
        StructuredOutputsParams(**c, disable_any_whitespace="json" in c))) for _, c in ITEMS]
    params += [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in FREE]
    outs = llm.generate([p for p, _ in ITEMS] + FREE, params, use_tqdm=False)
    for (_, constraint), o in zip(ITEMS, outs, strict=False):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        check(o.outputs[0].text, constraint)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(llama_path) -> list[list[int]]:
    llm = LLM(llama_path, distributed_executor_backend="uni", async_scheduling=True, **ENGINE)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_constrained_greedy_on_ray_equals_single_process(llama_path, reference, tp, pp):
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              async_scheduling=True, **ENGINE)
    try:
        assert llm.llm_engine.engine_config.parallel_config.distributed_executor_backend == "ray"
        assert _generate(llm) == reference
        wait_for_free_kv(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("tp", "pp", "async_scheduling"), [(2, 1, True), (1, 2, True)],
                         ids=["tp2-async", "pp2-async"])
def test_constrained_with_speculation_on_ray_equals_single_process(
        llama_path, reference, tp, pp, async_scheduling):
    """With ngram drafts the step's execute result (the drafts of its constrained requests)
    comes back over the step stream from the last stage's driver, and every TP rank of
    that stage verifies with the bitmask; with PP the accepted runs go back to the first
    stage through the ring (async scheduling)."""
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    try:
        assert _generate(llm) == reference
        metrics = llm.get_metrics()
        assert metrics["raylm:spec_decode_num_drafts"] > 0, metrics
        wait_for_free_kv(llm)
    finally:
        llm.shutdown()
