"""A stand-in for raylm.runner.worker.Worker: real torch.distributed, no model.

Each step all-reduces (over the TP group) a tensor holding ``step_id`` so that every rank
must take part, as in a real TP forward; the output rank returns one token per scheduled
request: ``step_id * tp_size + sum of tp_ranks``. Shipped to Ray workers by value
(``ray.cloudpickle.register_pickle_by_value``), since tests/ is not importable there.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from raylm.parallel.context import ParallelContext
from raylm.scheduler.core_outputs import ModelRunnerOutput


class FakeWorker:
    def __init__(self, engine_config, rank=0, local_rank=0, distributed_init_method=None):
        self.engine_config = engine_config
        self.rank = rank
        self.ctx = None
        self.steps = 0
        self.step_delay = 0.0
        self.torch_threads: dict[str, set[int]] = {}  # which threads ran each call

    def _ran(self, what):
        self.torch_threads.setdefault(what, set()).add(threading.get_ident())

    def get_torch_threads(self):
        return {k: sorted(v) for k, v in self.torch_threads.items()}

    def set_step_delay(self, seconds):
        self.step_delay = seconds

    def init_device(self, ctx=None, num_threads=None, expect_cuda=False):
        self._ran("init_device")
        self.ctx = ctx or ParallelContext.single("cpu")
        torch.set_num_threads(num_threads or 1)

    def load_model(self):
        self._ran("load_model")

    def determine_num_kv_blocks(self):
        return 100 - 10 * self.rank

    def initialize_kv_cache(self, num_blocks):
        self._ran("initialize_kv_cache")
        self.num_blocks = num_blocks

    def get_pid_and_threads(self):
        return os.getpid(), torch.get_num_threads()

    def execute_model(self, scheduler_output):
        self._ran("execute_model")
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if scheduler_output.step_id < 0:
            raise ValueError(f"fake worker refuses step_id={scheduler_output.step_id}")
        x = torch.tensor([float(scheduler_output.step_id * 1000 + self.ctx.tp_rank)])
        if self.ctx.tp_size > 1:
            dist.all_reduce(x, group=self.ctx.tp_group)
        req_ids = sorted(scheduler_output.num_scheduled_tokens)
        value = int(x.item())
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[[value] for _ in req_ids])

    def check_health(self):
        pass

    def shutdown(self):
        pass
