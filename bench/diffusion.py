"""Diffusion LM decoding: raylm's engine beside transformers' ``generate`` on the same tiny
random DiffusionGemma (docs/architecture.md §23), tokens/s and tokens per decoder forward
at batch 1 and 32.

    python bench/diffusion.py [--batches 1,32] [--canvas 8] [--max-tokens 64] [--repeats 3]
        [--early-stop]

Workload: a random-weight DiffusionGemma written locally (hidden 256, 4 layers alternating
sliding window 64 / global, 4 experts top-2 beside the dense MLP, vocabulary 4096, float32),
prompts of 24 random tokens, 64 new tokens per request (ignore EOS), canvas of 8, at most
8 denoising steps with transformers' adaptive stopping (stability 1, confidence 0.005:
a random model rarely stops early) and entropy bound 0.5. transformers runs each batch as
one ``generate`` call (equal-length prompts: no padding), raylm as one ``LLM.generate`` of
b requests (max_num_seqs=b, async scheduling, its defaults otherwise), each engine in a
fresh process. tok/s is generated tokens over wall time, median of --repeats after a
warm-up. tokens/forward: transformers'
``tokens_per_forward`` (mean over sequences of tokens per decoder pass it made); raylm's,
tokens over the canvases its decoder ran (one per request per step; on a CPU a step
booked after the end of its canvas is not run). Requests carry no seed (a seeded one draws from its own generator, as transformers
draws for one sequence: tests/cluster/test_diffusion.py compares its tokens), so tokens are
not compared here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import CACHE, parse_or_run_child, run_fresh  # noqa: E402

GENERATION = {"max_denoising_steps": 8,
              "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                                 "entropy_bound": 0.5}}
# --early-stop: adaptive stopping that fires on this random model (any stable argmax,
# mean entropy under 7.5 nats of the 8.3 of a uniform draw): canvases end early.
EARLY_STOP = {"stability_threshold": 0, "confidence_threshold": 7.5}
VOCAB = 4096
PROMPT_LEN = 24


def model_path(canvas: int, early_stop: bool = False) -> str:
    from raylm.runner.loading.diffusion_checkpoint import write_random_diffusion_checkpoint

    path = os.path.join(CACHE, f"dgemma-256-c{canvas}{'-early' if early_stop else ''}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        generation = {**GENERATION, **(EARLY_STOP if early_stop else {})}
        write_random_diffusion_checkpoint(path, canvas_length=canvas, sliding_window=64,
                                          vocab_size=VOCAB, hidden_size=256,
                                          num_hidden_layers=4, generation=generation)
    return path


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_transformers(args: argparse.Namespace) -> dict:
    """One ``generate`` call per repeat over the batch, after a warm-up."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    batch = prompts(args.batch)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(model_path(args.canvas, args.early_stop),
                                                         dtype=torch.float32).eval()
    rates, tpf = [], []
    with torch.inference_mode():
        hf.generate(torch.tensor(batch[:1]), max_new_tokens=args.canvas, eos_token_id=-1,
                    pad_token_id=0)  # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = hf.generate(torch.tensor(batch), max_new_tokens=args.max_tokens,
                              eos_token_id=-1, pad_token_id=0)
            seconds = time.perf_counter() - start
            rates.append((out.sequences.shape[1] - PROMPT_LEN) * len(batch) / seconds)
            tpf.append(float(out.tokens_per_forward.float().mean()))
    return {"tok_s": statistics.median(rates), "tok_fwd": statistics.median(tpf)}


def run_raylm(args: argparse.Namespace) -> dict:
    """One ``LLM.generate`` of the batch per repeat, after a warm-up."""
    from raylm import LLM, SamplingParams

    batch = [{"prompt_token_ids": p} for p in prompts(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rates, tpf = [], []
    with LLM(model_path(args.canvas, args.early_stop), dtype="float32", max_num_seqs=args.batch) as llm:
        runner = llm.llm_engine.core.engine_core.executor.worker.model_runner
        llm.generate(batch, params, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            rows = runner.num_denoised_rows
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == len(batch) * args.max_tokens, tokens
            rates.append(tokens / seconds)
            tpf.append(tokens / (runner.num_denoised_rows - rows))
    return {"tok_s": statistics.median(rates), "tok_fwd": statistics.median(tpf)}


ENGINES = {"transformers": run_transformers, "raylm": run_raylm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--canvas", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--early-stop", action="store_true",
                        help="adaptive stopping that fires (see EARLY_STOP)")
    args = parse_or_run_child(parser, tuple(ENGINES), lambda a, mode: ENGINES[mode](a))
    if args is None:
        return
    path = model_path(args.canvas, args.early_stop)  # written once, before the children read it
    print(f"model {path}: canvas {args.canvas}, {GENERATION['max_denoising_steps']} denoising "
          f"steps at most, prompts {PROMPT_LEN}, {args.max_tokens} new tokens per request; "
          "each engine in a fresh process")
    print(f"{'batch':>5} {'transformers tok/s':>19} {'tok/fwd':>8} {'raylm tok/s':>12} "
          f"{'tok/fwd':>8} {'raylm / hf':>10}")
    for b in (int(x) for x in args.batches.split(",")):
        common = ["--batch", str(b), "--canvas", str(args.canvas), "--max-tokens",
                  str(args.max_tokens), "--repeats", str(args.repeats),
                  *(["--early-stop"] if args.early_stop else [])]
        hf = run_fresh(__file__, ["--one", "transformers", *common])
        ours = run_fresh(__file__, ["--one", "raylm", *common])
        print(f"{b:>5} {hf['tok_s']:>19.1f} {hf['tok_fwd']:>8.2f} {ours['tok_s']:>12.1f} "
              f"{ours['tok_fwd']:>8.2f} {ours['tok_s'] / hf['tok_s']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
