"""LLMEngine: tokenizer + input processor + EngineCore client + output processor.

The synchronous core shared by the offline ``LLM`` and the serving ``AsyncLLM``. It holds
no event loop and no threads of its own besides the EngineCore client's.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raylm.cluster.engine.engine_args import EngineArgs
from raylm.cluster.engine.output_processor import OutputProcessor
from raylm.cluster.engine.outputs import RequestOutput
from raylm.cluster.engine.processor import InputProcessor, PromptType, ValidatedPrompt
from raylm.scheduler.config import envs
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.core.engine_core_loop import EngineCoreClient
from raylm.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


class LLMEngine:
    def __init__(self, engine_args: EngineArgs,
                 model_resolver: Callable[[], str] | None = None) -> None:
        """``model_resolver``: finds the checkpoint on each node that loads it (see
        ``ModelConfig.model_resolver``); ``engine_args.model`` is this process's copy."""
        self.engine_args = engine_args
        self.engine_config = engine_args.create_engine_config()
        if model_resolver is not None:
            self.engine_config = replace(self.engine_config, model_config=replace(
                self.engine_config.model_config, model_resolver=model_resolver))
        self.model_config = self.engine_config.model_config
        self.tokenizer = load_tokenizer(self.model_config.tokenizer or self.model_config.model)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer,
                                              engine_args.request_limits(),
                                              self.engine_config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The output processor is touched by the caller's thread (add/abort) and by
        # whoever calls step(); one lock keeps its dicts consistent.
        self._lock = threading.Lock()
        self.core = make_engine_core_client(self.engine_config)

    def add_request(self, request_id: str, prompt: PromptType | ValidatedPrompt,
                    params: SamplingParams | None = None) -> None:
        """Queue one request. A ValidatedPrompt (with its own params) went through the
        intake already; any other prompt goes through it here, with ``params``."""
        if not isinstance(prompt, ValidatedPrompt):
            if params is None:
                raise TypeError("add_request needs params for a prompt that is not a "
                                "ValidatedPrompt.")
            prompt = self.input_processor.process(prompt, params)
        elif params is not None:
            raise TypeError("a ValidatedPrompt carries its own params; pass none.")
        parent, requests = self.input_processor.make_requests(request_id, prompt)
        with self._lock:
            self.output_processor.add_request(parent, [r.request_id for r in requests])
        try:
            for r in requests:
                self.core.add_request(r)
        except Exception:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        with self._lock:
            child_ids = self.output_processor.child_ids(request_id)
            final = self.output_processor.abort_request(request_id, error)
        if child_ids:
            self.core.abort_requests(child_ids)
        return final

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Wait for the next engine outputs (up to ``timeout``) and turn them into RequestOutputs."""
        engine_outputs = self.core.get_output(timeout=timeout)
        if engine_outputs is None:
            return []
        with self._lock:
            outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_metrics(self) -> dict[str, Any]:
        return self.core.get_metrics()

    @property
    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks (every DP rank's); None while not known."""
        return self.core.num_kv_blocks

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()
