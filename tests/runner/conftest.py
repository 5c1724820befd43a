"""Runner test helpers: build a ModelRunner on CPU and reference generations from HF."""

from __future__ import annotations

import pytest
import torch
import transformers

from raylm.parallel.context import ParallelContext
from raylm.runner.model_runner import ModelRunner
from raylm.scheduler.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 256


def engine_config(path: str, async_mode: bool, max_num_seqs: int = 8) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=path),
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                        async_scheduling=async_mode),
        ParallelConfig(),
    )


def make_runner(path: str, async_mode: bool, max_num_seqs: int = 8) -> ModelRunner:
    runner = ModelRunner(engine_config(path, async_mode, max_num_seqs),
                         ParallelContext.single("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


_HF_CACHE: dict[str, object] = {}


def hf_model(path: str):
    if path not in _HF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # generate() falls back to the checkpoint's EOS when given None; the runner never
        # stops by itself (stopping is the scheduler's job), so neither may the reference.
        model.generation_config.eos_token_id = None
        _HF_CACHE[path] = model.eval()
    return _HF_CACHE[path]


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' generate(do_sample=False), never stopping early at EOS."""
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           eos_token_id=None, pad_token_id=0, **kwargs)
    out = hf_model(path).generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_mode(request) -> bool:
    return request.param
