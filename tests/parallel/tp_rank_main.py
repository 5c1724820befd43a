"""One rank of the tensor-parallel tests (imported by spawned processes), and the
parent's side: start the ranks, collect their reports."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator

import numpy as np

STEPS = [  # (positions [start, end) per sequence): prefill chunk + prefill, then mixed
    [("a", 0, 5), ("b", 0, 7)],
    [("a", 5, 9), ("b", 7, 8)],
    [("a", 9, 10), ("b", 8, 9)],
]
BLOCK_SIZE = 4
BLOCKS = {"a": [9, 2, 7], "b": [4, 11, 0]}


def sequences(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {"a": torch.randint(0, vocab, (10,), generator=g),
            "b": torch.randint(0, vocab, (9,), generator=g)}


def run_steps(model) -> list:
    """Logits of every token of every step, through a paged KV cache."""
    import torch

    from raylm.runner.attention.paged_attention import allocate_kv_cache, build_attention_metadata

    for attn in model.attention_layers:
        attn.kv_cache = allocate_kv_cache(12, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
                                          torch.float32, "cpu")
    tokens = sequences(model.config.vocab_size)
    results = []
    with torch.inference_mode():
        for chunks in STEPS:
            ids, pos, slots, qsl, lens, table = [], [], [], [0], [], []
            for name, start, end in chunks:
                p = torch.arange(start, end)
                bt = torch.tensor(BLOCKS[name])
                ids.append(tokens[name][start:end])
                pos.append(p)
                slots.append(bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                qsl.append(qsl[-1] + end - start)
                lens.append(end)
                table.append(BLOCKS[name])
            meta = build_attention_metadata(np.array(qsl), np.array(lens), torch.cat(slots),
                                            torch.tensor(table, dtype=torch.int64), BLOCK_SIZE)
            hidden = model(torch.cat(ids), torch.cat(pos), meta)
            results.append(model.compute_logits(hidden))
    return results


def greedy_tokens(runner, prompt: list[int], steps: int) -> list[int]:
    from raylm.scheduler.core_outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from raylm.scheduler.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps)
    out = runner.execute_model(SchedulerOutput(
        0, [NewRequestData("r", prompt, [], params, [1, 2, 3, 4], 0, 0)], CachedRequestData(),
        {"r": len(prompt)}, len(prompt)))
    tokens = out.sampled_token_ids[0]
    for k in range(1, steps):
        cached = CachedRequestData(["r"], [[]], [len(prompt) + k - 1], [[]])
        out = runner.execute_model(SchedulerOutput(k, [], cached, {"r": 1}, 1))
        tokens += out.sampled_token_ids[0]
    return tokens


def rank_main(rank: int, world: int, port: int, paths: list[str], results) -> None:
    try:
        import torch
        import torch.distributed as dist

        from raylm.parallel.context import ParallelContext
        from raylm.runner.loading.model_loader import get_model
        from raylm.runner.model_runner import ModelRunner
        from raylm.scheduler.config.engine_config import (
            CacheConfig,
            EngineConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
        )

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        ctx = ParallelContext(tp_rank=rank, tp_size=world, pp_rank=0, pp_size=1, dp_rank=0,
                              device=torch.device("cpu"), tp_group=dist.group.WORLD)
        out = {"rank": rank, "logits": {}, "tokens": {}}
        for path in paths:
            model = get_model(ModelConfig(model=path), ctx)
            out["logits"][path] = [t.numpy() for t in run_steps(model)]
            config = EngineConfig(ModelConfig(model=path), CacheConfig(block_size=BLOCK_SIZE),
                                  SchedulerConfig(async_scheduling=False), ParallelConfig())
            runner = ModelRunner(config, ctx)
            runner.load_model(model)
            runner.initialize_kv_cache(8)
            out["tokens"][path] = greedy_tokens(runner, [5, 9, 33, 70, 2, 41], 5)
        results.put(out)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tp_ranks(paths: list[str], world: int = 2,
             timeout_s: float = 120) -> Iterator[Callable[[], dict[int, dict]]]:
    """Start ``world`` spawned ranks running ``rank_main`` on ``paths``; yields a function
    that waits for every rank's report and returns them by rank (a rank's error fails the
    test with its traceback). The parent may compute its reference meanwhile."""
    import pytest

    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    port = _free_port()
    procs = [spawn.Process(target=rank_main, args=(r, world, port, paths, results),
                           daemon=True) for r in range(world)]
    for p in procs:
        p.start()

    def collect() -> dict[int, dict]:
        outs = {}
        for _ in range(world):
            try:
                out = results.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(f"a tensor-parallel rank did not report within {timeout_s} s")
            assert "error" not in out, out.get("error")
            outs[out["rank"]] = out
        return outs

    try:
        yield collect
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
