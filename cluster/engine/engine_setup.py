"""What both engine clients build from EngineArgs: the engine config, the tokenizer, the
intake, the output processor and the EngineCore client (in this process, or Ray actors)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.output_processor import OutputProcessor
from raylm.cluster.engine.processor import InputProcessor
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig, ModelConfig
from raylm.scheduler.core.engine_core_loop import EngineCoreClient


class EngineClientBase:
    """What both engine clients (LLMEngine, AsyncLLM) hold: the engine config, the
    tokenizer, the intake, an output processor and the EngineCore client."""

    def __init__(self, engine_args: EngineArgs,
                 model_resolver: Callable[[], str] | None = None) -> None:
        """``model_resolver``: finds the checkpoint on each node that loads it (see
        ``ModelConfig.model_resolver``); ``engine_args.model`` is this process's copy."""
        config = engine_args.create_engine_config()
        if model_resolver is not None:
            config = replace(config, model_config=replace(
                config.model_config, model_resolver=model_resolver))
        self.engine_args = engine_args
        self.engine_config = config
        self.model_config: ModelConfig = config.model_config
        self.tokenizer = load_tokenizer(self.model_config.tokenizer or self.model_config.model)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer,
                                              engine_args.request_limits(),
                                              config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core = make_engine_core_client(config)


def make_engine_core_client(config: EngineConfig) -> EngineCoreClient:
    """Start the EngineCore where the config says: in process, or in Ray actors (one per
    DP rank)."""
    # ParallelConfig makes data_parallel_size > 1 imply the "ray" backend.
    if config.parallel_config.distributed_executor_backend == "ray":
        from raylm.actors.ray_engine_core_client import make_ray_engine_core_client

        return make_ray_engine_core_client(config)
    from raylm.runner.structured.xgrammar_backend import make_structured_output_manager
    from raylm.runner.uniproc_executor import UniProcExecutor
    from raylm.scheduler.core.engine_core import EngineCore
    from raylm.scheduler.core.engine_core_loop import InprocEngineCoreClient

    expect_cuda, local_rank = False, 0
    if "ray" in sys.modules:  # a Serve replica holding the model's GPU, perhaps
        from raylm.actors.gpu_assignment import current_device_assignment

        device = current_device_assignment("the engine's process")
        expect_cuda, local_rank = device.expect_cuda, device.local_rank
    executor = UniProcExecutor(config, num_threads=ray_actor_threads(),
                               expect_cuda=expect_cuda, local_rank=local_rank)
    return InprocEngineCoreClient(
        EngineCore(config, executor, make_structured_output_manager(config)))


def ray_actor_threads() -> int | None:
    """Torch threads for a model run inside this process when it is a Ray actor (a Serve
    replica): the CPUs Ray reserved for it, at least one. None elsewhere, and when
    RAYLM_NUM_THREADS is set: the runner's default applies. Without this a replica spreads
    its forward over every core of a node it shares with other replicas, Serve's proxy and
    ingress; on CPU an OpenMP team then waits at each barrier for whichever of its threads
    the OS has descheduled, which costs more than the extra threads gain."""
    if envs.num_threads_override() is not None:
        return None
    ray = sys.modules.get("ray")  # a Ray worker has imported it; nobody else needs to
    if ray is None or not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:
        return None
    return max(1, int(ctx.get_assigned_resources().get("CPU", 0)))


def load_tokenizer(name: str) -> Any:
    """A Hugging Face folder's (or hub name's) tokenizer, or the one in a GGUF file."""
    from transformers import AutoTokenizer

    from raylm.runner.loading.gguf_checkpoint import find_gguf_file, load_gguf_tokenizer

    gguf_path = find_gguf_file(name)
    if gguf_path is not None:
        return load_gguf_tokenizer(gguf_path)
    return AutoTokenizer.from_pretrained(name)
