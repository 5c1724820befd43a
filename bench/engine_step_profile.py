"""Host CPU per decode step of the whole offline engine, beside the model's forward.

    RAYLM_NUM_THREADS=1 python bench/engine_step_profile.py [--batch 32 64] [--out-len 128]
        [--output-kind cumulative|delta|final_only]

An in-process ``LLMEngine`` (what ``LLM.generate`` and a Serve replica drive) on the 6m
checkpoint (fp32, async scheduling as configured by default), stepped by this thread until
every request finishes, each output built as ``--output-kind`` says (cumulative: what the
server asks for; final_only: what ``LLM.generate`` asks for). ``--batch`` requests of 32-token prompts, greedy, ``ignore_eos``, ``--out-len``
tokens each, detokenized: every request runs every step, so a step decodes ``--batch`` rows.
Everything the process does is counted in CPU time (``time.process_time``: the engine-loop,
worker, output-copy and caller threads together; wall time on a shared box mostly measures
the neighbours), and the phases are timed in thread CPU time on whichever thread runs them:
- forward: the model over the batch (+ logits): the work that is not host work;
- schedule / update: ``Scheduler.schedule`` / ``update_from_output`` (EngineCore thread);
- prepare / sample: device inputs and sampling (worker thread);
- output: ``OutputProcessor.process_outputs`` (EngineCoreOutputs -> RequestOutputs: the
  detokenizer, the caller's thread);
- other: the rest of the process (engine-loop and worker plumbing, thread hand-offs, the
  runner's bookkeeping, the output-copy thread).
Per step = per decode step of the run (the total over the run divided by ``--out-len``, so
the one prefill step is amortised in; with 32-token prompts it is small). "host" = process
CPU - forward; "host share" = host / process CPU. Each batch size runs ``--repeats`` times
in one process after a warm-up run; medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint, fixed_workload  # noqa: E402

PHASES = ("forward", "schedule", "update", "prepare", "sample", "output")


def _timed(acc: dict[str, float], name: str, fn):
    def wrapper(*a, **k):
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.thread_time() - t
    return wrapper


def _instrument(llm, acc: dict[str, float]) -> None:
    engine = llm.llm_engine
    core = engine.core.engine_core
    sched = core.scheduler
    sched.schedule = _timed(acc, "schedule", sched.schedule)
    sched.update_from_output = _timed(acc, "update", sched.update_from_output)
    runner = core.executor.worker.model_runner
    runner.model.forward = _timed(acc, "forward", runner.model.forward)
    runner.model.compute_logits = _timed(acc, "forward", runner.model.compute_logits)
    runner.input_preparer.prepare = _timed(acc, "prepare", runner.input_preparer.prepare)
    runner.sampler = _timed(acc, "sample", runner.sampler)
    op = engine.output_processor
    op.process_outputs = _timed(acc, "output", op.process_outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="6m")
    ap.add_argument("--output-kind", default="cumulative",
                    choices=["cumulative", "delta", "final_only"])
    args = ap.parse_args()

    from raylm import LLM, SamplingParams

    try:
        from raylm import RequestOutputKind
        kind = {"output_kind": RequestOutputKind[args.output_kind.upper()]}
    except ImportError:  # a raylm from before output kinds: every output is cumulative
        assert args.output_kind == "cumulative", "this raylm has cumulative outputs only"
        kind = {}

    path = checkpoint(args.size)
    llm = LLM(path, dtype="float32", max_num_seqs=max(args.batch), max_model_len=1024)
    acc: dict[str, float] = defaultdict(float)
    _instrument(llm, acc)
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True, **kind)
    engine = llm.llm_engine
    ids = iter(range(1 << 30))

    def generate(prompts: list[dict]) -> None:
        pending = set()
        for prompt in prompts:
            rid = f"b{next(ids)}"
            engine.add_request(rid, prompt, params)
            pending.add(rid)
        while pending:
            for out in engine.step(timeout=1.0):
                if out.finished:
                    pending.discard(out.request_id)
    import raylm
    print(f"# engine host CPU per decode step: {args.size} model, fp32, prompts "
          f"{args.prompt_len}, {args.out_len} output tokens, greedy, detokenized, "
          f"{args.output_kind} outputs, "
          f"RAYLM_NUM_THREADS={os.environ.get('RAYLM_NUM_THREADS', 'unset')}, median of "
          f"{args.repeats} runs, microseconds of CPU per step ({list(raylm.__path__)[0]})")
    print("| rows | process | forward | host | host share | schedule | update | prepare "
          "| sample | output | other |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        wl = fixed_workload(vocab, batch, args.prompt_len, args.out_len, seed=batch)
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        generate(prompts)  # warm-up
        runs: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):
            acc.clear()
            t = time.process_time()
            generate(prompts)
            total = time.process_time() - t
            per = {k: acc[k] / args.out_len * 1e6 for k in PHASES}
            per["process"] = total / args.out_len * 1e6
            per["host"] = per["process"] - per["forward"]
            per["other"] = per["host"] - sum(per[k] for k in PHASES if k != "forward")
            for k, v in per.items():
                runs[k].append(v)
        m = {k: statistics.median(v) for k, v in runs.items()}
        print(f"| {batch} | {m['process']:.0f} | {m['forward']:.0f} | {m['host']:.0f} | "
              f"{100 * m['host'] / m['process']:.0f}% | {m['schedule']:.0f} | "
              f"{m['update']:.0f} | {m['prepare']:.0f} | {m['sample']:.0f} | "
              f"{m['output']:.0f} | {m['other']:.0f} |", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
