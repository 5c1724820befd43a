"""One rank on one device: owns the ModelRunner, sizes and allocates the KV cache.

The distributed layer builds the ``ParallelContext`` (process groups) and, for pipeline
parallelism, supplies a ``PPTransport`` that moves IntermediateTensors between stages and,
under async scheduling, the last stage's sampled ids to the others; single-process use
needs neither.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
from dataclasses import replace
from typing import Any, Protocol

import torch

from raylm.parallel.context import ParallelContext
from raylm.parallel.distributed import cuda_missing_reason, pick_device
from raylm.parallel.expert_parallel import DPExpertGroup
from raylm.runner.async_output import AsyncModelRunnerOutput
from raylm.runner.cpu_budget import usable_cpus
from raylm.runner.diffusion_runner import DiffusionModelRunner
from raylm.runner.host_memory import cap_onednn_primitive_caches, keep_freed_host_memory
from raylm.runner.memory_budget import (
    GIB,
    kv_cache_budget_bytes,
    num_kv_blocks_for,
    step_reserve_bytes,
)
from raylm.runner.model_runner import ModelRunner
from raylm.runner.models.llama import IntermediateTensors
from raylm.runner.pp_ring import SampledTokenTransport
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.executor_base import EngineDeadError
from raylm.scheduler.core_outputs import (
    DraftTokenIds,
    DummyBatch,
    ModelRunnerOutput,
    SchedulerOutput,
)
from raylm.scheduler.structured.manager import GrammarOutput

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30


class PPTransport(SampledTokenTransport, Protocol):
    """Moves hidden states between pipeline stages, and sampled ids from the last stage to
    the others (implemented by ``raylm.parallel.pp_comm.PPCommunicator``). Sizes come from
    the SchedulerOutput every rank holds, so no shape travels."""

    def recv_intermediate(self, scheduler_output: SchedulerOutput) -> IntermediateTensors: ...

    def send_intermediate(self, tensors: IntermediateTensors) -> None: ...

    def close(self) -> None:
        """Wait for (or drop) sends still in flight; called once at shutdown."""
        ...


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _total_host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_model_name(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def default_intra_op_threads() -> int:
    """Torch threads when the caller names none: RAYLM_NUM_THREADS, else the CPUs this
    process may keep busy (its affinity mask capped by its cgroup's CPU quota)."""
    override = envs.num_threads_override()
    return usable_cpus() if override is None else override


# A CPU step of at least this many tokens takes ParallelConfig.cpu_burst_threads: large
# steps gain from more threads, small decodes hardly do, and under `raylm serve` this
# threshold gave the lowest time to first token (measurements: docs/performance.md).
CPU_BURST_MIN_TOKENS = 64


def step_threads(num_tokens: int, own_threads: int, burst_threads: int | None) -> int:
    """Torch threads of a CPU step of ``num_tokens`` tokens."""
    if burst_threads is not None and num_tokens >= CPU_BURST_MIN_TOKENS:
        return burst_threads
    return own_threads


def set_intra_op_threads(num_threads: int) -> None:
    """torch.set_num_threads, skipped when torch already uses that many (the call is not
    free: libgomp resizes its team)."""
    if num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        # The driver's checkpoint path may not exist here (another node, another cache).
        model_config = engine_config.model_config.on_this_node()
        if model_config is not engine_config.model_config:
            engine_config = replace(engine_config, model_config=model_config)
        self.engine_config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.ctx: ParallelContext | None = None
        self.model_runner: ModelRunner | DiffusionModelRunner | None = None
        self.pp_transport: PPTransport | None = None
        self._dead: BaseException | None = None
        self.num_threads = 1  # torch threads of this rank's steps, set by init_device

    def init_device(self, ctx: ParallelContext | None = None, num_threads: int | None = None,
                    expect_cuda: bool = False, ep_group: DPExpertGroup | None = None) -> None:
        """``expect_cuda``: this process was given a GPU; a torch without CUDA is then an
        error naming the cause, never a silent CPU run beside an idle GPU. ``ep_group``:
        the experts spread over the DP ranks (a DP rank running its model itself)."""
        if ctx is None:
            device, _ = pick_device(self.local_rank, expect_cuda)
            ctx = ParallelContext.single(device)
        elif expect_cuda and ctx.device.type != "cuda":
            raise RuntimeError(f"worker rank {self.rank} was given a GPU but its context "
                               f"runs on {ctx.device}: {cuda_missing_reason()}.")
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        else:
            cap_onednn_primitive_caches()
            if envs.cpu_keep_freed_memory():
                keep_freed_host_memory()
        self.num_threads = num_threads or default_intra_op_threads()
        set_intra_op_threads(self.num_threads)
        if self.engine_config.parallel_config.enable_expert_parallel:
            ctx = replace(ctx, expert_parallel=True, ep_group=ep_group,
                          dp_rank=ep_group.dp_rank if ep_group is not None else ctx.dp_rank)
        self.ctx = ctx
        info = self.device_info()
        logger.info("worker rank %d runs on %s: %s (index %s, %.1f GiB)", self.rank,
                    info["kind"], info["name"], info["index"], info["memory_bytes"] / GIB)
        runner_cls = (DiffusionModelRunner if self.engine_config.model_config.is_diffusion
                      else ModelRunner)
        self.model_runner = runner_cls(self.engine_config, ctx)

    @property
    def _context(self) -> ParallelContext:
        if self.ctx is None:
            raise RuntimeError(f"worker rank {self.rank} has no device: call init_device().")
        return self.ctx

    @property
    def _runner(self) -> ModelRunner | DiffusionModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"worker rank {self.rank} has no model runner: init_device() "
                               "builds it, shutdown() drops it.")
        return self.model_runner

    @property
    def _causal_runner(self) -> ModelRunner:
        """The runner of a causal LM: what experts across DP ranks and PP stages drive (a
        diffusion model runs on one rank, EngineConfig refuses the rest)."""
        runner = self._runner
        if not isinstance(runner, ModelRunner):
            raise RuntimeError(f"worker rank {self.rank} runs a diffusion model: no expert "
                               "groups or pipeline stages.")
        return runner

    def device_info(self) -> dict[str, Any]:
        """What this rank runs on: kind (cuda, cpu), name, index, total memory."""
        device = self._context.device
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return {"kind": "cuda", "name": props.name, "index": device.index,
                    "memory_bytes": int(props.total_memory)}
        return {"kind": device.type, "name": cpu_model_name(), "index": None,
                "memory_bytes": _total_host_memory()}

    def load_model(self) -> None:
        self._runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        cache = self.engine_config.cache_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self._runner.kv_cache_bytes_per_block()
        config = self.engine_config
        max_len = config.model_config.max_model_len
        if per_block == 0:
            # A pipeline stage of Mamba2 layers alone keeps no KV: blocks enough that the
            # pool never runs out for it (the other stages bound the engine's).
            return config.scheduler_config.max_num_seqs * -(-max_len // cache.block_size) + 1
        state = self._runner.state_cache_bytes()
        if cache.kv_cache_memory_bytes is not None:
            budget, what = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif (device := self._context.device).type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = kv_cache_budget_bytes(free, total, cache.gpu_memory_utilization,
                                           self.step_reserve_bytes())
            what = (f"{free / GIB:.1f} of {total / GIB:.1f} GiB free on {device}, "
                    f"gpu_memory_utilization={cache.gpu_memory_utilization:g}, "
                    f"{self.step_reserve_bytes() / GIB:.2f} GiB reserved for a step")
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _available_host_memory() // 2)
            what = "the CPU default: half the available host memory, at most 1 GiB"
        if state:
            budget -= state
            what += (f", less {state / GIB:.2f} GiB of Mamba2 state for "
                     f"max_num_seqs={config.scheduler_config.max_num_seqs}")
        windowed = any(w is not None for w in config.kv_cache_groups.windows)
        return num_kv_blocks_for(budget, per_block, cache.block_size, max_len, what,
                                 config.kv_blocks_per_request(max_len) if windowed else None)

    def step_reserve_bytes(self) -> int:
        runner = self._runner
        if isinstance(runner, DiffusionModelRunner):
            return runner.step_reserve_bytes()
        elem = torch.empty((), dtype=runner.dtype).element_size()
        return step_reserve_bytes(self.engine_config, self._context, elem,
                                  runner.input_preparer.attention_backend,
                                  runner.use_cuda_graphs)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput | DraftTokenIds | None:
        """Run one step; only the driver rank (TP rank 0 of the last stage) returns output
        (DraftTokenIds when its sampling waits for a bitmask that checks them)."""
        ctx, runner = self._context, self._runner
        if ctx.device.type == "cpu":
            set_intra_op_threads(step_threads(
                scheduler_output.total_num_scheduled_tokens, self.num_threads,
                self.engine_config.parallel_config.cpu_burst_threads))
        kv = runner.kv_steps  # a KV connector: its orders before the step
        if kv is not None:
            kv.begin(scheduler_output)
        intermediate = recv = None
        if not ctx.is_first_pp_rank and scheduler_output.total_num_scheduled_tokens:
            if runner.speculator is None:
                intermediate = self._transport().recv_intermediate(scheduler_output)
            else:  # the step's size is known once the runner has placed its drafts
                recv = self._transport().recv_intermediate
        out = runner.execute_model(scheduler_output, intermediate,
                                   pp_transport=self.pp_transport,
                                   recv_intermediate=recv)
        if kv is not None:
            kv.end(scheduler_output, out)  # its report rides on the output (or the next)
        if isinstance(out, IntermediateTensors):
            self._transport().send_intermediate(out)
            return None
        return out if ctx.is_driver else None

    def sample_tokens(self, grammar_output: GrammarOutput
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Sample the step deferred for its grammar bitmask. Only the last stage samples
        (every TP rank of it, with the same mask); the driver returns the output."""
        ctx = self._context
        if not ctx.is_last_pp_rank:
            return None
        runner = self._runner
        out = runner.sample_tokens(grammar_output)
        if runner.kv_steps is not None:
            runner.kv_steps.attach(out)  # reported with the step's forward
        return out if ctx.is_driver else None

    def run(self, message: SchedulerOutput | GrammarOutput | DummyBatch
            ) -> ModelRunnerOutput | AsyncModelRunnerOutput | DraftTokenIds | None:
        """One step message: a step, the sampling of a step deferred for its bitmask, or a
        DP rank's dummy pass. Both executors call it as ``Worker.run(worker, message)``, so
        a stand-in worker (tests, benchmarks) needs only ``execute_model`` and
        ``sample_tokens``."""
        if isinstance(message, GrammarOutput):
            return self.sample_tokens(message)
        if isinstance(message, DummyBatch):
            self.execute_dummy_batch()
            return None
        return self.execute_model(message)

    def _transport(self) -> PPTransport:
        if self.pp_transport is None:
            ctx = self._context
            raise RuntimeError(f"pipeline stage {ctx.pp_rank}/{ctx.pp_size} has no "
                               "pp_transport to exchange hidden states.")
        return self.pp_transport

    def execute_dummy_batch(self) -> None:
        """A wave step without a forward of this DP rank's own (docs/architecture.md §5)."""
        self._causal_runner.loaded_model.dummy_expert_pass()

    def join_expert_group(self, host: str, port: int, timeout_s: float,
                          local_host: str | None = None) -> None:
        """Collective with this (stage, TP rank)'s workers in the other DP ranks: the Gloo
        group its sparse layers dispatch over, on DP rank 0's store at (host, port);
        ``local_host``: this node's address for Gloo to bind."""
        from raylm.parallel.dp_sync import join_gloo_group

        ctx = self._context
        group = ctx.ep_group
        if group is None:
            raise RuntimeError(f"worker rank {self.rank} has no expert-parallel group to join.")
        pg, store = join_gloo_group(
            host=host, port=port, prefix=f"raylm-ep-pp{ctx.pp_rank}-tp{ctx.tp_rank}",
            rank=group.dp_rank, size=group.dp_size, timeout_s=timeout_s,
            local_host=local_host)
        group.attach(pg, store)

    def expert_load(self) -> dict[int, dict[int, int]]:
        """Per sparse layer of this rank's stage: tokens routed to each of its experts."""
        return self._causal_runner.loaded_model.expert_load()

    def pp_stats(self) -> dict[str, int]:
        """How sampled ids reached this rank's inputs (tests, benchmarks, debugging)."""
        runner = self._causal_runner
        ring = runner.pp_ring
        stats = runner.async_input_stats
        return {"pp_rank": self._context.pp_rank, "slice_copy": stats.slice_copy,
                "scatter": stats.scatter,
                "ring_steps": ring.num_steps if ring else 0,
                "ring_delivered": ring.num_delivered if ring else 0,
                "ring_tokens_dropped": ring.num_tokens_dropped if ring else 0}

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"worker rank {self.rank} is dead: {self._dead!r}")

    def mark_dead(self, error: BaseException) -> None:
        self._dead = error

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
            # Drop the weights and the KV cache now, not when the last reference to this
            # worker goes: on a GPU the KV cache takes most of the free memory, and the next
            # engine in this process sizes its own cache from what is free.
            self.model_runner = None
            if self.ctx is not None and self.ctx.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        if self.pp_transport is not None:
            self.pp_transport.close()
