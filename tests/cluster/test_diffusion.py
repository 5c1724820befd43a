"""A diffusion language model (DiffusionGemma, docs/architecture.md §23) through the engine:
one seeded request reproduces transformers' ``generate`` after ``torch.manual_seed``, sync
and async, canvases of 4 and 8, with adaptive stopping ending canvases early (async: the
steps booked after such an end are discarded, their random draws undone) and a stop token
mid-canvas; a batch of requests runs each to its length, steady async steps read nothing
back but the output copy, and nothing stays in the KV pool."""

from __future__ import annotations

import pytest
import torch
from engine_idle import idle_metrics
from host_reads import host_reads

from raylm import LLM, SamplingParams
from raylm.runner.loading.diffusion_checkpoint import write_random_diffusion_checkpoint

# Adaptive stopping that fires after a varying number of steps on a random model (a
# random model's argmax is never stable for transformers' defaults).
GENERATION = {"max_denoising_steps": 10, "stability_threshold": 0, "confidence_threshold": 3.0,
              "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 1.0}}
PROMPT = [5, 17, 42, 9, 61, 33, 70]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {n: write_random_diffusion_checkpoint(
        str(tmp_path_factory.mktemp(f"dgemma{n}")), canvas_length=n, vocab_size=320,
        with_tokenizer=True, generation=GENERATION) for n in (4, 8)}


def _reference(path: str, prompt: list[int], seed: int, max_new_tokens: int,
               stop: int | None) -> list[int]:
    from transformers import DiffusionGemmaForBlockDiffusion

    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    for param in hf.parameters():  # aligned copies: see tests/runner/test_diffusion_gemma.py
        param.data = param.data.clone()
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                          eos_token_id=-1 if stop is None else stop,
                          pad_token_id=0).sequences[0, len(prompt):].tolist()
    out = out[:max_new_tokens]
    return out[:out.index(stop) + 1] if stop in out else out


@pytest.mark.parametrize("canvas_length", [4, 8])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_request_reproduces_transformers_generate(checkpoints, canvas_length,
                                                         async_scheduling):
    """Each request alone (batched rows sum in another order, and self-conditioning
    amplifies the last bits into other samples on a random model)."""
    path = checkpoints[canvas_length]
    with LLM(path, dtype="float32", block_size=4, async_scheduling=async_scheduling,
             enable_prefix_caching=False) as llm:
        stops = 0
        for seed in (0, 7):
            ref = _reference(path, PROMPT, seed, 16, None)
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(seed=seed, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ref, f"seed {seed}"
            # A stop token transformers generates in a later canvas ends the request there.
            stop = ref[10]
            ref = _reference(path, PROMPT, seed, 16, stop)
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(seed=seed, max_tokens=16, ignore_eos=True,
                                              stop_token_ids=[stop]), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == ref, f"seed {seed}, stop {stop}"
            stops += out.outputs[0].finish_reason == "stop"
        core = llm.llm_engine.core.engine_core
        discarded = core.scheduler.step_settler.num_discarded_steps
        skipped = core.executor.worker.model_runner.num_skipped_rows
        metrics = idle_metrics(llm)
    assert stops == 2
    # Async: canvases ended before a step already booked after them (the CPU runner does
    # not run those, nor those of requests that ended there), and still matched.
    assert (discarded > 0) == async_scheduling and skipped >= discarded
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0


def test_steps_after_a_canvas_ends_run_as_device_no_ops_as_on_a_gpu(checkpoints):
    """The GPU's path on a CPU: rows of ended canvases are run, their state kept on the
    device by selects, their draws undone at the next canvas; tokens still equal
    transformers'."""
    path = checkpoints[4]
    with LLM(path, dtype="float32", block_size=4, async_scheduling=True,
             enable_prefix_caching=False) as llm:
        core = llm.llm_engine.core.engine_core
        runner = core.executor.worker.model_runner
        runner.skips_ended_rows = False
        for seed in (0, 7):
            out = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(seed=seed, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
            assert out.token_ids == _reference(path, PROMPT, seed, 16, None), f"seed {seed}"
        discarded = core.scheduler.step_settler.num_discarded_steps
    assert discarded > 0 and runner.num_skipped_rows == 0


def test_a_batch_runs_each_request_to_its_length_reading_nothing_back(checkpoints):
    """Six requests of different prompts and lengths (not multiples of the canvas) in a pool
    small enough to preempt, async: every one gets exactly max_tokens tokens; steady
    steps read device values on the host only through the output copy."""
    prompts = [PROMPT, list(range(20, 45)), [7], list(range(60, 70)), [3, 4, 5], [9] * 12]
    lengths = [16, 5, 11, 8, 3, 13]
    params = [SamplingParams(seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(lengths)]
    batch = [{"prompt_token_ids": p} for p in prompts]
    with LLM(checkpoints[4], dtype="float32", block_size=4, num_kv_blocks=14,
             max_num_batched_tokens=16, async_scheduling=True) as llm:
        llm.generate(batch, params, use_tqdm=False)  # warm-up
        with host_reads([]) as reads:
            outs = llm.generate(batch, params, use_tqdm=False)
        metrics = idle_metrics(llm)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # The output copy, and on a CPU the flags of canvases that may have ended (computed
    # with the last step: reading them waits for nothing; a GPU runs those rows instead).
    assert set(reads) <= {("runner/async_output.py", "<listcomp>", "numpy"),
                          ("runner/diffusion_runner.py", "_live_canvases", "tolist")}, reads
    assert metrics["raylm:num_preemptions"] > 0
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0


def test_what_it_cannot_run_is_refused_by_name(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(checkpoints[4], tensor_parallel_size=2)
    with LLM(checkpoints[4], dtype="float32") as llm:
        with pytest.raises(ValueError, match="temperature"):
            llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.3))
        with pytest.raises(ValueError, match="logprobs"):
            llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(logprobs=1))


def test_a_prefix_hit_over_a_committed_canvas_gives_transformers_logits(checkpoints,
                                                                        monkeypatch):
    """Blocks holding a committed canvas are cached once the encoder has rewritten them: a
    request whose prompt extends that prompt and canvas hits them, and its first decoder
    step's logits equal transformers' over the whole prompt encoded afresh."""
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    from raylm.runner.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion as Ours

    steps = []
    denoise = Ours.denoise

    def recorded(self, ids, positions, meta, *conditioning):
        logits = denoise(self, ids, positions, meta, *conditioning)
        steps.append((ids.clone(), positions.clone(), logits))
        return logits

    monkeypatch.setattr(Ours, "denoise", recorded)
    path = checkpoints[4]
    prompt = PROMPT + [80, 81]
    with LLM(path, dtype="float32", block_size=4) as llm:
        first = llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(seed=0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        extended = prompt + first[:4] + [3]
        start = len(steps)
        llm.generate([{"prompt_token_ids": extended}],
                     SamplingParams(seed=1, max_tokens=4, ignore_eos=True), use_tqdm=False)
        metrics = idle_metrics(llm)
    # the prompt's 9 tokens and 3 of the canvas: three blocks; none left in use after
    assert metrics["raylm:prefix_cache_hits"] == 12
    assert metrics["raylm:kv_cache_usage_perc"] == 0.0
    # (a no-op step the first request booked after its end may come first: async)
    ids, positions, logits = next(s for s in steps[start:] if s[1][0] == len(extended))
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=torch.tensor([extended]), cache=cache,
                         position_ids=torch.arange(len(extended))[None])
        ref = hf(decoder_input_ids=ids[None], cache=cache,
                 decoder_position_ids=positions[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
