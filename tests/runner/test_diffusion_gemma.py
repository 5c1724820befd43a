"""DiffusionGemma (block diffusion) against transformers: the decoder's logits over a batch
of requests with different prefixes through the paged KV cache, and one seeded request's
tokens driven step by step by the sampler (docs/architecture.md §23)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from paged import PagedSequences

from raylm.parallel.context import ParallelContext
from raylm.runner.attention import paged_attention
from raylm.runner.attention.bidirectional import build_bidirectional_metadata
from raylm.runner.attention.paged_attention import build_attention_metadata
from raylm.runner.diffusion_sampler import (
    DiffusionSampler,
    DiffusionSamplingParams,
    committed_tokens,
)
from raylm.runner.loading.diffusion_checkpoint import write_random_diffusion_checkpoint
from raylm.runner.loading.diffusion_loader import get_diffusion_model
from raylm.runner.models.diffusion_gemma_config import DiffusionGemmaConfig

transformers = pytest.importorskip("transformers")
CPU = ParallelContext.single("cpu")
VOCAB = 96
EOS = 3


def _write_checkpoint(path, canvas_length: int, sliding_window: int) -> str:
    return write_random_diffusion_checkpoint(str(path), canvas_length, sliding_window,
                                             vocab_size=VOCAB, eos_token_id=EOS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Canvas lengths 4 and 8 with windows longer than any test sequence, and a canvas of
    4 with a window of 6 (a prefix past it)."""
    return {(n, w): _write_checkpoint(tmp_path_factory.mktemp(f"dgemma{n}w{w}"), n, w)
            for n, w in ((4, 32), (8, 32), (4, 6))}


def _hf(path: str):
    from transformers import DiffusionGemmaForBlockDiffusion

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    # Weights mapped from the file may sit off a 16-byte boundary, and torch's grouped
    # matmul (transformers' experts) then sums in another order: copy them (ties kept:
    # a tied parameter is one object).
    for param in hf.parameters():
        param.data = param.data.clone()
    return hf


class Requests:
    """Block tables and the two passes' metadata for requests run by hand."""

    def __init__(self, model, lengths: dict[str, int]) -> None:
        self.paged = PagedSequences([model], lengths, block_size=4, num_blocks=48)
        self.bs = self.paged.block_size

    def _rows(self, chunks: list[tuple[str, int, int]]):
        bs, table, slots, qsl, seq_lens, pos = self.bs, [], [], [0], [], []
        for name, start, end in chunks:
            bt = self.paged.block_tables[name]
            p = torch.arange(start, end)
            pos.append(p)
            slots.append(torch.tensor(bt)[p // bs] * bs + p % bs)
            table.append(bt + [0] * (self.paged.max_blocks - len(bt)))
            qsl.append(qsl[-1] + end - start)
            seq_lens.append(end)
        return (np.array(qsl), np.array(seq_lens), torch.cat(slots),
                torch.tensor(table, dtype=torch.int64), torch.cat(pos))

    def encoder_step(self, chunks):
        qsl, seq_lens, slots, table, pos = self._rows(chunks)
        return pos, build_attention_metadata(qsl, seq_lens, slots, table, self.bs)

    def decoder_step(self, chunks):
        qsl, seq_lens, slots, table, pos = self._rows(chunks)
        return pos, build_bidirectional_metadata(qsl, seq_lens, slots, table, self.bs)


def _hf_encode(hf, cache, ids: torch.Tensor, start: int) -> None:
    hf.model.encoder(input_ids=ids[None], cache=cache,
                     position_ids=torch.arange(start, start + ids.numel())[None])


def _hf_logits(hf, cache, canvas, start, sc) -> torch.Tensor:
    out = hf(decoder_input_ids=canvas[None], cache=cache,
             self_conditioning_logits=None if sc is None else sc[None],
             decoder_position_ids=torch.arange(start, start + canvas.numel())[None])
    return out.logits[0]


@torch.inference_mode()
def test_decoder_logits_match_transformers_over_a_batch(checkpoints):
    """Two requests with prefixes of 5 and 11 tokens (past the sliding window of 6), three
    denoising steps (the last with self-conditioning for one request only), a committed
    canvas encoded after each prefix, then two more steps."""
    from transformers import DynamicCache

    path = checkpoints[4, 6]
    model = get_diffusion_model(path, CPU, dtype="float32")
    hf = _hf(path)
    L = model.config.canvas_length
    g = torch.Generator().manual_seed(0)
    prompts = {"a": torch.randint(0, VOCAB, (5,), generator=g),
               "b": torch.randint(0, VOCAB, (11,), generator=g)}
    reqs = Requests(model, {k: len(v) + 2 * L for k, v in prompts.items()})
    caches = {k: DynamicCache(config=hf.config.get_text_config(decoder=True)) for k in prompts}
    for k, ids in prompts.items():
        _hf_encode(hf, caches[k], ids, 0)
    pos, meta = reqs.encoder_step([(k, 0, len(v)) for k, v in prompts.items()])
    model.encode(torch.cat(list(prompts.values())), pos, meta)
    prefix = {k: len(v) for k, v in prompts.items()}
    sc: dict[str, torch.Tensor | None] = {"a": None, "b": None}
    # (which requests carry the previous step's logits), per step
    plan = [("a", "b"), ("a", "b"), ("a",), "commit", (), ("a", "b")]
    for conditioned in plan:
        if conditioned == "commit":
            canvases = {k: torch.randint(0, VOCAB, (L,), generator=g) for k in prompts}
            for k in prompts:
                _hf_encode(hf, caches[k], canvases[k], prefix[k])
            pos, meta = reqs.encoder_step([(k, prefix[k], prefix[k] + L) for k in prompts])
            model.encode(torch.cat(list(canvases.values())), pos, meta)
            prefix = {k: n + L for k, n in prefix.items()}
            continue
        canvases = {k: torch.randint(0, VOCAB, (L,), generator=g) for k in prompts}
        used = {k: sc[k] if k in conditioned else None for k in prompts}
        logits_in = torch.cat([used[k] if used[k] is not None else torch.zeros(L, VOCAB)
                               for k in prompts])
        mask = torch.tensor([used[k] is not None for k in prompts]).repeat_interleave(L)
        pos, meta = reqs.decoder_step([(k, prefix[k], prefix[k] + L) for k in prompts])
        logits = model.denoise(torch.cat(list(canvases.values())), pos, meta,
                               logits_in, mask)
        assert logits.dtype == torch.float32 and logits.shape == (2 * L, VOCAB)
        for i, k in enumerate(prompts):
            ref = _hf_logits(hf, caches[k], canvases[k], prefix[k], used[k])
            torch.testing.assert_close(logits[i * L:(i + 1) * L], ref, atol=1e-4, rtol=0)
            sc[k] = logits[i * L:(i + 1) * L] / 0.7  # any logits condition the next step


def _generate_by_hand(model, prompt: list[int], params: DiffusionSamplingParams,
                      max_new_tokens: int, seed: int, eos: tuple[int, ...]) -> list[int]:
    """What the engine will do for one request: encode the prompt, denoise each canvas
    with the sampler, commit its argmax, encode it, until EOS or the length."""
    cfg = model.config
    L = cfg.canvas_length
    canvases = math.ceil(max_new_tokens / L)
    reqs = Requests(model, {"r": len(prompt) + canvases * L})
    sampler = DiffusionSampler(params, L, cfg.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    pos, meta = reqs.encoder_step([("r", 0, len(prompt))])
    model.encode(torch.tensor(prompt), pos, meta)
    n, out = len(prompt), []
    for _ in range(canvases):
        state = sampler.new_canvas(torch.device("cpu"), gen)
        while not state.finished(params):
            pos, meta = reqs.decoder_step([("r", n, n + L)])
            logits = model.denoise(state.canvas, pos, meta, state.self_conditioning_logits)
            state = sampler.step(state, logits, gen)
        tokens, stop = committed_tokens(state.argmax_canvas, eos)
        out += tokens
        if stop:
            break
        pos, meta = reqs.encoder_step([("r", n, n + L)])
        model.encode(state.argmax_canvas, pos, meta)
        n += L
    return out


def _hf_generate(hf, prompt: list[int], params: DiffusionSamplingParams, seed: int,
                 eos: int) -> list[int]:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSamplerConfig,
    )

    torch.manual_seed(seed)
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=16, eos_token_id=eos, pad_token_id=0,
        max_denoising_steps=params.max_denoising_steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=params.entropy_bound),
        t_min=params.t_min, t_max=params.t_max,
        stability_threshold=params.stability_threshold,
        confidence_threshold=params.confidence_threshold,
    ).sequences[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out  # transformers pads after EOS


@pytest.mark.parametrize("canvas_length", [4, 8])
@torch.inference_mode()
def test_seeded_request_reproduces_transformers_generate(checkpoints, canvas_length,
                                                        monkeypatch):
    """transformers' defaults (every canvas runs its 6 steps: a random model is never
    stable), and adaptive stopping that fires after a varying number of steps. The
    request stops at a token that transformers generates in its second or third canvas:
    the rest of that canvas is dropped, as transformers pads it.

    Self-conditioning feeds each step's logits, scaled up by 1 / temperature, into the
    next, so a random model amplifies float rounding from step to step until a sample
    flips: every row runs as an sdpa span here (transformers' kernel, the same sums)
    instead of the ragged kernel, whose sums differ in the last bits."""
    monkeypatch.setattr(paged_attention, "RAGGED_MAX_QUERY_LEN", 0)
    path = checkpoints[canvas_length, 32]
    model = get_diffusion_model(path, CPU, dtype="float32")
    hf = _hf(path)
    prompt = [5, 17, 42, 9, 61, 33, 70]
    stops = 0
    for params in (DiffusionSamplingParams(max_denoising_steps=6),
                   DiffusionSamplingParams(max_denoising_steps=10, entropy_bound=1.0,
                                           stability_threshold=0, confidence_threshold=2.0)):
        for seed in (0, 7):
            eos = _hf_generate(hf, prompt, params, seed, EOS)[10]
            ref = _hf_generate(hf, prompt, params, seed, eos)
            got = _generate_by_hand(model, prompt, params, 16, seed, (eos,))
            assert got == ref, f"seed {seed}, {params}"
            stops += len(got) < 16
    assert stops >= 2  # the stop token ended some request early


def test_config_refuses_what_it_cannot_run(checkpoints):
    import json
    import os

    with open(os.path.join(checkpoints[4, 6], "config.json")) as f:
        hf = json.load(f)
    assert DiffusionGemmaConfig.from_hf(hf).layers[1].value_is_key
    bad = {**hf, "text_config": {**hf["text_config"], "use_bidirectional_attention": "all"}}
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DiffusionGemmaConfig.from_hf(bad)
    with pytest.raises(ValueError, match="canvas_length"):
        DiffusionGemmaConfig.from_hf({**hf, "canvas_length": 0})


def test_batched_sampler_step_equals_each_canvas_alone():
    """step_batch over canvases at different steps gives each canvas exactly what step
    gives it alone (its draws from its own generator); a canvas without a generator
    draws from the fast batched path: tokens of the vocabulary, accepted where sampled."""
    cpu = torch.device("cpu")
    sampler = DiffusionSampler(DiffusionSamplingParams(max_denoising_steps=5, entropy_bound=2.0,
                                                       stability_threshold=2,
                                                       confidence_threshold=9.0), 4, VOCAB)
    g = torch.Generator().manual_seed(3)
    states = [sampler.new_canvas(cpu, torch.Generator().manual_seed(i)) for i in range(3)]
    states[1] = sampler.step(states[1], torch.randn(4, VOCAB, generator=g),
                             torch.Generator().manual_seed(9))
    logits = torch.randn(3 * 4, VOCAB, generator=g) * 3
    batched = sampler.step_batch(states, logits, [torch.Generator().manual_seed(10 + i)
                                                  for i in range(3)])
    for i, state in enumerate(states):
        alone = sampler.step(state, logits[4 * i:4 * i + 4], torch.Generator().manual_seed(10 + i))
        got = batched[i]
        assert got.steps_done == alone.steps_done == state.steps_done + 1
        for name in ("canvas", "argmax_canvas", "self_conditioning_logits", "argmax_history",
                     "stopped"):
            assert torch.equal(getattr(got, name), getattr(alone, name)), (i, name)
    free = sampler.step_batch(states, logits, [None, None, None])
    for state in free:
        assert state.canvas.shape == (4,) and 0 <= int(state.canvas.min()) <= int(
            state.canvas.max()) < VOCAB
