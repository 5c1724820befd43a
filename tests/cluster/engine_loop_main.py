"""Build engines one after another in one process, ``del llm`` between them (never
``shutdown()``), on a Ray instance raylm starts itself; the last one is left for interpreter
exit to release. Run by test_engine_lifecycle.py: ``python engine_loop_main.py MODEL N``."""

from __future__ import annotations

import gc
import sys

import ray

from raylm import LLM, SamplingParams

# Engine 3 is larger than the first: the local Ray must have been sized for it.
CONFIGS = {3: {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}
TP2 = {"tensor_parallel_size": 2}


def live_placement_groups() -> int:
    return sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())


def main(path: str, num_engines: int) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = None
    for i in range(num_engines):
        llm = LLM(path, num_kv_blocks=32, max_num_seqs=4, **CONFIGS.get(i, TP2))
        tokens = list(llm.generate([[5, 9, 33, 70]], params)[0].outputs[0].token_ids)
        first = first or tokens
        assert tokens == first, (i, tokens, first)
        if i == num_engines - 1:
            print(f"engine {i} ok; left for exit", flush=True)
            return  # the interpreter's exit releases this one
        del llm
        gc.collect()
        assert live_placement_groups() == 0, ray.util.placement_group_table()
        print(f"engine {i} ok; released", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
