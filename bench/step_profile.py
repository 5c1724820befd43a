"""Where one decode step's time goes: the model's forward vs the host work around it.

    python bench/step_profile.py [--batch 200] [--dtype float32] [--steps 30]

One ModelRunner in this process (no Ray, sync scheduling) on the 6m checkpoint, ``--batch``
requests with prompts drawn from 16-512 tokens (seeded) prefilled first, then ``--steps``
decode steps timed phase by phase:
- prepare: SchedulerOutput -> device inputs (``InputPreparer.prepare``, attention
  metadata included);
- forward: the model over the batch (+ logits);
- sample: sampling metadata and the sampler;
- the rest of ``execute_model`` (state updates, output bookkeeping).
"host share" is everything but the forward: the per-step work that does not compute the
model. Medians over the timed steps. The run is single-threaded and timed in thread CPU
time (``time.thread_time``): on a shared 2-core box wall time mostly measures the
neighbours, CPU time measures the work.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()

    import torch

    from raylm.cluster.engine.engine_args import EngineArgs
    from raylm.parallel.context import ParallelContext
    from raylm.runner.model_runner import ModelRunner
    from raylm.scheduler.core_outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from raylm.scheduler.sampling_params import SamplingParams

    torch.set_num_threads(1)
    clock = time.thread_time
    bs = args.block_size
    path = checkpoint("6m")
    num_blocks = args.batch * (1024 // bs) + 1
    config = EngineArgs(model=path, dtype=args.dtype, max_model_len=1024, block_size=bs,
                        num_kv_blocks=num_blocks, max_num_seqs=args.batch,
                        max_num_batched_tokens=8192,
                        async_scheduling=False).create_engine_config()
    runner = ModelRunner(config, ParallelContext.single("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    rng = random.Random(2)
    vocab = config.model_config.vocab_size
    free = list(range(num_blocks))
    rng.shuffle(free)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    seq_len: dict[str, int] = {}
    blocks: dict[str, list[int]] = {}
    step = 0
    pending = [f"r{i}" for i in range(args.batch)]
    # Prefill in groups that fit the token budget.
    while pending:
        new, sched, total = [], {}, 0
        while pending and total < 4096:
            rid = pending.pop()
            prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))]
            blocks[rid] = [free.pop() for _ in range(-(-(len(prompt) + 1) // bs))]
            new.append(NewRequestData(rid, prompt, [], params, list(blocks[rid]), 0, 0))
            sched[rid] = len(prompt)
            seq_len[rid] = len(prompt)
            total += len(prompt)
        runner.execute_model(SchedulerOutput(step, new, CachedRequestData(), sched, total))
        step += 1

    phases = {"prepare": [], "forward": [], "sample": [], "total": []}
    current: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                current[name] = current.get(name, 0.0) + clock() - t
        return wrapper

    runner.input_preparer.prepare = timed("prepare", runner.input_preparer.prepare)
    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("forward", runner.model.compute_logits)
    runner.sampler = timed("sample", runner.sampler)
    import raylm.runner.model_runner as mr
    mr.build_sampling_metadata = timed("sample", mr.build_sampling_metadata)
    for i in range(args.steps + 3):
        cached = CachedRequestData()
        for rid in seq_len:
            cached.req_ids.append(rid)
            need = -(-(seq_len[rid] + 1) // bs) - len(blocks[rid])
            nb = [free.pop() for _ in range(max(need, 0))]
            blocks[rid] += nb
            cached.new_block_ids.append(nb)
            cached.num_computed_tokens.append(seq_len[rid])
            cached.new_token_ids.append([])
        so = SchedulerOutput(step, [], cached, dict.fromkeys(seq_len, 1), len(seq_len))
        current.clear()
        t = clock()
        runner.execute_model(so)
        current["total"] = clock() - t
        step += 1
        for rid in seq_len:
            seq_len[rid] += 1
        if i >= 3:  # warm-up steps
            for k in phases:
                phases[k].append(current.get(k, 0.0))
    med = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
    other = med["total"] - med["prepare"] - med["forward"] - med["sample"]
    host = med["total"] - med["forward"]
    ctx = sum(seq_len.values()) / len(seq_len)
    import raylm
    print(f"# decode step, 6m model, {args.dtype}, {args.batch} rows (mean context "
          f"{ctx:.0f}), block size {bs}, median of {args.steps} steps, CPU ms, 1 thread "
          f"({list(raylm.__path__)[0]})")
    print(f"total {med['total']:.2f} ms | forward {med['forward']:.2f} | prepare "
          f"{med['prepare']:.2f} | sample {med['sample']:.2f} | other {other:.2f} | "
          f"host share {100 * host / med['total']:.1f}%")
    runner.shutdown()


if __name__ == "__main__":
    main()
