"""Engine arguments as users pass them (vLLM's names): the one definition of each of them.

To add an engine argument, add a field to ``EngineArgs`` with ``_arg(default, help)`` and
pass it on in ``create_engine_config`` (its value is validated there, by the frozen configs
of ``raylm.scheduler.config.engine_config``). Nothing else: the three surfaces derive from the fields,
``LLM(model, **kwargs)`` keywords (``from_kwargs``), the ``raylm`` CLI flags (``add_cli_args``:
``--field-name``, type and choices from the annotation, help from the metadata) and the
Serve config's ``engine_kwargs`` (``raylm.cluster.serve.config.EngineKwargs``, a pydantic
model generated from these fields). tests/cluster/test_engine_args.py checks they agree.
The Helm chart's schema of ``engine_kwargs`` (helm/raylm/values.schema.json) is generated
from ``EngineKwargs`` too: rerun ``python helm/generate_schema.py`` after adding an argument
(tests/helm/test_values_schema.py fails until then). A numeric argument states its
``bounds`` in JSON Schema's words for that schema; the frozen configs stay the checks, and
tests/cluster/test_engine_args.py checks that each bound is exactly where they start refusing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from raylm.runner.loading.gguf_checkpoint import find_gguf_file, read_gguf_config
from raylm.scheduler.config.engine_config import (
    SUPPORTED_ARCHITECTURES,
    CacheConfig,
    DType,
    EngineConfig,
    ExecutorBackend,
    ModelConfig,
    ParallelConfig,
    PlacementStrategy,
    SchedulerConfig,
)
from raylm.scheduler.config.speculative_config import SpeculativeConfig


def _arg(default: Any, help: str, *aliases: str, bounds: dict[str, float] | None = None) -> Any:
    """A field with its help text, short flags (``-tp``) and, for a number, its bounds
    (JSON Schema's ``minimum``, ``exclusiveMinimum``, ``maximum``) as metadata."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases,
                                                        "bounds": bounds})


_AT_LEAST_1 = {"minimum": 1}


@dataclass(frozen=True)
class EngineArgs:
    model: str = dataclasses.field(metadata={"help": "Hugging Face checkpoint folder or GGUF "
                                                     "file"})
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model's)")
    served_model_name: str | None = _arg(None, "the name clients send as `model`")
    dtype: DType = _arg("auto", "weights and activations (auto: the checkpoint's; float32 "
                                "checkpoints run in bfloat16 on CUDA and on CPUs with "
                                "AVX512-BF16/AMX)")
    max_model_len: int | None = _arg(None, "longest prompt + output in tokens (default or 0: "
                                           "the model's max_position_embeddings)",
                                     bounds={"minimum": 0})
    max_num_seqs: int = _arg(128, "most sequences in one step", bounds=_AT_LEAST_1)
    max_num_batched_tokens: int | None = _arg(None, "most tokens in one step (default: "
                                                    "max(2048, max_num_seqs))",
                                              bounds=_AT_LEAST_1)
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)",
                           bounds=_AT_LEAST_1)
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    num_kv_blocks: int | None = _arg(None, "cap on the KV-cache blocks", bounds=_AT_LEAST_1)
    kv_cache_memory_bytes: int | None = _arg(None, "KV-cache size in bytes (default: a share "
                                                   "of free device memory)",
                                             bounds=_AT_LEAST_1)
    gpu_memory_utilization: float = _arg(0.9, "share of device memory the engine may use",
                                         bounds={"exclusiveMinimum": 0, "maximum": 1})
    seed: int = _arg(0, "engine seed: the seeds of unseeded requests derive from it",
                     bounds={"minimum": 0})
    async_scheduling: bool | None = _arg(None, "plan step t+1 while step t runs "
                                               "(default: on)")
    tensor_parallel_size: int = _arg(1, "workers per pipeline stage", "-tp", bounds=_AT_LEAST_1)
    pipeline_parallel_size: int = _arg(1, "pipeline stages", "-pp", bounds=_AT_LEAST_1)
    data_parallel_size: int = _arg(1, "engines (DP ranks)", "-dp", bounds=_AT_LEAST_1)
    distributed_executor_backend: ExecutorBackend | None = _arg(
        None, "uni: in process; ray: worker actors (default: ray when parallel)")
    placement_group_strategy: PlacementStrategy = _arg("PACK", "Ray placement group "
                                                               "strategy of the workers")
    placement_timeout_s: float = _arg(
        1800.0, "seconds the workers' placement group may wait for its resources (a cluster "
                "autoscaler adding a node); the error names the missing resources",
        bounds={"exclusiveMinimum": 0})
    dp_sync_interval: int = _arg(16, "steps between the DP ranks' wave syncs",
                                 bounds=_AT_LEAST_1)
    cpu_burst_threads: int | None = _arg(
        None, "CPU: torch threads of a step of at least 64 tokens (a wave of prompts); other "
              "steps keep the rank's own threads (its reserved CPUs). For an engine with a "
              "node to itself, whose other processes idle while prompts run (`raylm serve` "
              "on the local Ray instance it starts uses the node's CPUs). Default: the "
              "rank's own", bounds=_AT_LEAST_1)
    max_queued_requests: int | None = _arg(None, "serving: refuse requests beyond this many "
                                                 "waiting (HTTP 503)", bounds=_AT_LEAST_1)
    speculative_config: dict[str, Any] | None = _arg(
        None, "speculative decoding, vLLM's dict (JSON on the command line): {\"method\": "
              "\"ngram\" | \"draft_model\", \"num_speculative_tokens\": k, ...}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}.")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    # ---- EngineConfig --------------------------------------------------------------------
    def create_engine_config(self, hf_config: dict[str, Any] | None = None) -> EngineConfig:
        """``hf_config``: the checkpoint's config.json, read from ``model`` when None."""
        model_config = self.create_model_config(hf_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=self.create_cache_config(),
            scheduler_config=self.create_scheduler_config(model_config.max_model_len),
            parallel_config=self.create_parallel_config(),
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config),
        )

    def create_model_config(self, hf_config: dict[str, Any] | None = None) -> ModelConfig:
        # A GGUF checkpoint carries its config in the file's metadata.
        gguf_path = None if hf_config else find_gguf_file(self.model)
        if gguf_path is not None:
            hf_config = read_gguf_config(gguf_path)
        return ModelConfig(
            model=gguf_path or self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len or 0, seed=self.seed,
            served_model_name=self.served_model_name, hf_config=hf_config or {},
        )

    def create_cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
            num_kv_blocks=self.num_kv_blocks, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        # Chunked prefill is always on, so the token budget need not cover max_model_len.
        budget = self.max_num_batched_tokens
        if budget is None:  # 0 is not "unset": SchedulerConfig refuses it
            budget = max(2048, self.max_num_seqs)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=max_model_len, async_scheduling=self.async_scheduling,
            max_queued_requests=self.max_queued_requests,
        )

    def create_parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            placement_group_strategy=self.placement_group_strategy,
            dp_sync_interval=self.dp_sync_interval,
            cpu_burst_threads=self.cpu_burst_threads,
            placement_timeout_s=self.placement_timeout_s,
        )

    def check_without_checkpoint(self) -> None:
        """Every check of ``create_engine_config`` that does not read the checkpoint (the
        Serve config runs it at load time, before any replica starts)."""
        # A stand-in config.json that fits any max_model_len: only the arguments are checked.
        self.create_engine_config(hf_config={
            "architectures": [SUPPORTED_ARCHITECTURES[0]],
            "max_position_embeddings": max(self.max_model_len or 0, 2)})


# ---- the surfaces derived from the fields ------------------------------------------------

def engine_arg_fields(exclude: typing.Collection[str] = ()) -> list[dataclasses.Field]:
    return [f for f in fields(EngineArgs) if f.name not in exclude]


def engine_arg_types() -> dict[str, Any]:
    """Each field's annotation, resolved (``int | None``, ``Literal[...]``)."""
    return typing.get_type_hints(EngineArgs)


def _cli_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keywords for one field's annotation."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = members  # X | None: the flag's type is X
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return {"choices": choices, "type": type(choices[0])}
    if typing.get_origin(annotation) is dict:
        return {"type": _json_object, "metavar": "JSON"}
    assert annotation in (int, float, str), f"no CLI form for the annotation {annotation!r}"
    return {"type": annotation}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_cli_args(parser: argparse.ArgumentParser, exclude: typing.Collection[str] = ("model",)
                 ) -> None:
    """One ``--field-name`` flag per engine argument. Every flag defaults to None ("not
    given"), so EngineArgs' own defaults stay the only ones."""
    group = parser.add_argument_group("engine arguments")
    hints = engine_arg_types()
    for f in engine_arg_fields(exclude):
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        group.add_argument(*flags, dest=f.name, default=None, help=f.metadata["help"],
                           **_cli_kwargs(hints[f.name]))


def cli_engine_kwargs(args: argparse.Namespace, exclude: typing.Collection[str] = ("model",)
                      ) -> dict[str, Any]:
    """The engine arguments given as flags (``add_cli_args`` with the same ``exclude``)."""
    return {f.name: getattr(args, f.name) for f in engine_arg_fields(exclude)
            if getattr(args, f.name, None) is not None}
