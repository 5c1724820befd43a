"""Multi-LoRA on the CUDA path (the Triton attention backend brings the Triton LoRA
kernels), run on CPU by Triton's interpreter: greedy tokens equal transformers + PEFT for
adapters and the base model in one batch, with decode steps padded to their CUDA-graph
bucket over the fixed LoRA buffers (what a graph replays over) and without."""

from __future__ import annotations

import importlib
import os
import random

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit wraps the kernels

from raylm import LLM, LoRARequest, SamplingParams  # noqa: E402
from raylm.runner.attention import triton_paged  # noqa: E402
from raylm.runner.lora import triton_ops  # noqa: E402

for _module, _kernel in ((triton_paged, "_paged_attention_kernel"),
                         (triton_ops, "_shrink_kernel")):
    if type(getattr(_module, _kernel)).__name__ != "InterpretedFunction":
        importlib.reload(_module)  # imported earlier without the interpreter

ADAPTER_OF = [0, None, 2, 1]
MAX_TOKENS = [6, 5, 7, 4]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded-decode"])
def test_triton_lora_equals_peft(llama_path, lora_adapters, peft_oracle, monkeypatch, padded):
    monkeypatch.setenv("RAYLM_ATTENTION_BACKEND", "triton")
    if padded:
        monkeypatch.setenv("RAYLM_PAD_DECODE_STEPS", "1")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 3, 18, 8)]
    llm = LLM(llama_path, enable_lora=True, max_loras=2, block_size=16, num_kv_blocks=8,
              max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=padded)
    try:
        runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
        # The Triton kernels, over the fixed buffers a CUDA graph would replay over.
        assert runner.lora.context.backend == "triton" and runner.lora.buffers is not None
        assert runner.pad_decode_steps == padded
        loras = [None if a is None else LoRARequest(f"a{a}", a + 1, lora_adapters[a])
                 for a in ADAPTER_OF]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in MAX_TOKENS], lora_request=loras, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        want = [peft_oracle.greedy(None if a is None else lora_adapters[a], p, m)
                for a, p, m in zip(ADAPTER_OF, prompts, MAX_TOKENS, strict=True)]
        assert got == want
    finally:
        llm.shutdown()
