"""Steady async steps read the device only through the designated copy (async_output.py).

On a GPU every other read of a device tensor's values (``.cpu()``, ``.numpy()``,
``.tolist()``, ``.item()``) synchronises the host with the device and loses the overlap
(bench/gpu_check.py checks it there with torch.cuda.set_sync_debug_mode). On the CPU the
"device" tensors are host tensors, so the same rule is checked by recording who calls those
methods on any tensor but the host staging buffers (the input preparer's ``*_cpu``, pinned
on a GPU) while the engine runs steady steps: only the copier may."""

from __future__ import annotations

import pytest
from host_reads import COPIER, host_reads

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
        llm.generate(batch, params, use_tqdm=False)  # warm-up
        preparer = llm.llm_engine.core.engine_core.executor.worker.model_runner.input_preparer
        buffers = [v for k, v in vars(preparer).items() if k.endswith("_cpu")]
        assert len(buffers) == 3, list(vars(preparer))
        with host_reads(buffers) as reads:
            outs = llm.generate(batch, params, use_tqdm=False)
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    oracle = hf_oracle(path)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, 24)
    if spec is not None:  # drafts were verified in the recorded steps
        assert metrics["raylm:spec_decode_num_accepted_tokens"] > 0, metrics
    # The copier's own reads are the only ones (and there were some: the check is live).
    assert any(f == COPIER for f, _, _ in reads), reads
    others = {k: n for k, n in reads.items() if k[0] != COPIER}
    assert not others, f"host reads of device tensors outside the copier: {others}"
