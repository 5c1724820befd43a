"""Steady async steps read the device only through the designated copy (async_output.py).

On a GPU every other read of a device tensor's values (``.cpu()``, ``.numpy()``,
``.tolist()``, ``.item()``) synchronises the host with the device and loses the overlap
(bench/gpu_check.py checks it there with torch.cuda.set_sync_debug_mode). On the CPU the
"device" tensors are host tensors, so the same rule is checked by recording who calls those
methods on any tensor but the host staging buffers (the input preparer's ``*_cpu``, pinned
on a GPU) while the engine runs steady steps: only the copier may."""

from __future__ import annotations

import pytest
from host_reads import assert_only_the_copier_reads, steady_generate_reads

from raylm import LLM, SamplingParams


def _prompts(vocab: int) -> list[list[int]]:
    passage = [(7 * i) % (vocab - 3) + 3 for i in range(11)]
    return [passage * 3, passage[:6] * 4, [5, 9, 13, 21, 34, 55, 89]]


@pytest.mark.parametrize("model", ["llama", "bamba"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "none"])
def test_steady_async_steps_read_the_device_only_through_the_copier(request, hf_oracle,
                                                                     method, model):
    """``bamba``: a Mamba2 hybrid, whose next step after a verification continues from the
    state its accepted count names, read from nothing but the worker's settled count."""
    path = request.getfixturevalue("llama_path" if model == "llama" else "loopy_bamba_path")
    draft = request.getfixturevalue("llama_path" if model == "llama"
                                    else "bamba_mlp_draft_path")
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": draft,
                            "num_speculative_tokens": 3},
            "none": None}[method]
    llm = LLM(path, async_scheduling=True, block_size=4, num_kv_blocks=96,
              speculative_config=spec)
    try:
        prompts = _prompts(llm.llm_engine.model_config.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        outs, reads = steady_generate_reads(llm, batch, params)
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    oracle = hf_oracle(path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 24)
    if spec is not None:  # drafts were verified in the recorded steps
        assert metrics["raylm:spec_decode_num_accepted_tokens"] > 0, metrics
    assert_only_the_copier_reads(reads)
