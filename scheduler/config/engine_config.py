"""Frozen configuration, one dataclass per layer. Pure Python: read by every layer.

Each config validates itself and raises ``ValueError`` naming the bad value.
``EngineConfig`` ties them together and resolves ``async_scheduling`` (the one place it is
resolved; every layer below reads the resolved value). The value sets that several layers
name (dtypes, architectures, executor backends, placement strategies) are defined here once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from raylm.scheduler.config.attention_layout import (
    check_attention_layout,
    layer_windows,
)
from raylm.scheduler.config.checkpoint_quantization import (
    CHECKPOINT_METHODS,
    checkpoint_quantization,
)
from raylm.scheduler.config.diffusion_config import DIFFUSION_ARCHITECTURES, DiffusionConfig
from raylm.scheduler.config.kv_cache_groups import KVCacheGroups
from raylm.scheduler.config.kv_transfer_config import KVTransferConfig
from raylm.scheduler.config.lora_config import LoRAConfig
from raylm.scheduler.config.moe_layout import MOE_ARCHITECTURES, check_moe_layout, moe_traits
from raylm.scheduler.config.speculative_config import MODEL_METHODS, SpeculativeConfig
from raylm.scheduler.config.state_layout import (
    STATE_SPACE_ARCHITECTURES,
    has_state_layers,
    recurrent_shapes,
)
from raylm.scheduler.config.validation import check_at_least

logger = logging.getLogger(__name__)

# Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral (a sliding window), Gemma 2 and 3 and the mixtures
# of experts (scheduler/config/moe_layout.py) run on the Llama decoder with flags.
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys((
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", *MOE_ARCHITECTURES,
    *STATE_SPACE_ARCHITECTURES, *DIFFUSION_ARCHITECTURES)))
# "auto": the checkpoint's dtype, float32 ones in bfloat16 on CUDA and on CPUs with native
# bf16 (resolved by the runner: runner/model_loader.resolve_dtype).
DType = Literal["auto", "float32", "bfloat16", "float16", "float64"]
DTYPES: tuple[str, ...] = get_args(DType)
# None: the checkpoint's own (a GGUF file's group formats, a GPTQ or AWQ checkpoint stay
# quantized on CPU); "gguf", "gptq", "awq": insist on it; "none": dequantize at load
# (runner/loading/model_loader.py).
Quantization = Literal["gguf", "gptq", "awq", "none"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
ExecutorBackend = Literal["uni", "ray"]
MambaCacheMode = Literal["align", "all"]
MAMBA_CACHE_MODES: tuple[str, ...] = get_args(MambaCacheMode)
EXECUTOR_BACKENDS: tuple[str, ...] = get_args(ExecutorBackend)
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES: tuple[str, ...] = get_args(PlacementStrategy)


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name} {why}, got {value!r}.")


def _check_at_least_1(config: object, *names: str) -> None:
    """Each named field of ``config`` is at least 1 (or None: optional, unset)."""
    for name in names:
        check_at_least(name, getattr(config, name))


def supported_architecture(architectures: list[str], model: str = "") -> str:
    """The first of a config.json's ``architectures`` that raylm runs; ValueError if none."""
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    of = f" of model {model!r}" if model else ""
    raise ValueError(f"architecture {architectures!r}{of} is not supported; "
                     f"supported: {list(SUPPORTED_ARCHITECTURES)}.")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # resolved by the runner: the checkpoint's, fp32 -> bf16 where fast
    max_model_len: int = 0  # 0: take max_position_embeddings from config.json
    seed: int = 0
    served_model_name: str | None = None
    # No CUDA graphs: every step runs eagerly (vLLM's name).
    enforce_eager: bool = False
    # The residual add + RMSNorm and rotary embedding through torch.compile (one fused
    # kernel each); None: on CUDA unless enforce_eager, off on CPU (runner/models/fused_ops.py).
    compile_fused_ops: bool | None = None
    quantization: Quantization | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Called on every node that loads the weights (each rank, in its own process) and
    # returns that node's checkpoint folder: a node-local cache or download. None: ``model``
    # is a folder every node can read at the same path. Must pickle (a module-level
    # function, or functools.partial of one); ``model`` is the driver's own resolution.
    model_resolver: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # The checks that need no checkpoint come first: the Serve config runs them early.
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"must be one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise _bad("quantization", self.quantization,
                       f"must be one of {QUANTIZATIONS} or None (the checkpoint's own)")
        if self.max_model_len < 0:
            raise _bad("max_model_len", self.max_model_len, "must be positive (0: the model's)")
        if self.seed < 0:
            raise _bad("seed", self.seed, "must be non-negative")
        if not self.hf_config:
            path = os.path.join(self.model, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"model {self.model!r} is not a folder with a config.json "
                                 "(nor a GGUF file).")
            with open(path) as f:
                object.__setattr__(self, "hf_config", json.load(f))
        arch = supported_architecture(self.hf_config.get("architectures") or [], self.model)
        if arch in DIFFUSION_ARCHITECTURES:
            self.diffusion_config  # noqa: B018 - its checks, now
            if self.quantization not in (None, "none"):
                raise _bad("quantization", self.quantization,
                           f"is not supported for {arch} (its weights load unquantized)")
        else:
            check_attention_layout(arch, self.hf_config)
            check_moe_layout(arch, self.hf_config)
            recurrent_shapes(arch, self.hf_config)
        method = checkpoint_quantization(self.hf_config)
        if self.quantization in CHECKPOINT_METHODS and self.quantization != method:
            raise _bad("quantization", self.quantization,
                       f"does not match the checkpoint's quantization_config ({method})")
        limit = int(self.text_config.get("max_position_embeddings", 2048))
        if self.max_model_len == 0:
            object.__setattr__(self, "max_model_len", limit)
        elif self.max_model_len > limit:
            raise _bad("max_model_len", self.max_model_len,
                       f"must not exceed the model's max_position_embeddings={limit}")
        if self.tokenizer is None:
            object.__setattr__(self, "tokenizer", self.model)

    def on_this_node(self) -> ModelConfig:
        """This config with ``model`` pointing at this node's copy of the checkpoint."""
        if self.model_resolver is None:
            return self
        path = self.model_resolver()
        if not os.path.isfile(os.path.join(path, "config.json")):
            found = os.listdir(path) if os.path.isdir(path) else "no such folder"
            raise ValueError(f"model_resolver {self.model_resolver!r} returned {path!r}, "
                             f"which is not a folder with a config.json on this node "
                             f"(it holds: {found}).")
        return replace(self, model=path, model_resolver=None)

    @property
    def architecture(self) -> str:
        return supported_architecture(self.hf_config["architectures"], self.model)

    @property
    def is_diffusion(self) -> bool:
        """A diffusion language model (docs/architecture.md §23): a canvas per step."""
        return self.architecture in DIFFUSION_ARCHITECTURES

    @functools.cached_property
    def diffusion_config(self) -> DiffusionConfig:
        """The canvas and the denoising loop (diffusion models only)."""
        return DiffusionConfig.from_checkpoint(self.hf_config, self.model)

    @property
    def num_sampled_tokens_per_step(self) -> int:
        """Tokens a decode step samples besides drafts: 1 autoregressively, 0 for a
        diffusion model, whose steps rewrite a canvas (no bonus token)."""
        return 0 if self.is_diffusion else 1

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's fields (a diffusion model nests them)."""
        return (self.hf_config.get("text_config") or {}) if self.is_diffusion else self.hf_config

    @functools.cached_property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None where it attends to every key. A diffusion
        model keeps every block of every layer (one table; its windows are applied by
        its attention metadata)."""
        if self.is_diffusion:
            return (None,) * int(self.text_config.get("num_hidden_layers", 0))
        return tuple(layer_windows(self.architecture, self.hf_config))

    @functools.cached_property
    def num_experts(self) -> int:
        """Routed experts per sparse layer (0: a dense model, or one whose experts every
        rank runs whole: a diffusion model's)."""
        if self.is_diffusion:
            return 0
        return moe_traits(self.architecture, self.hf_config).num_experts

    @functools.cached_property
    def has_state_layers(self) -> bool:
        """Whether some layer keeps recurrent state (Mamba2): state_layout.py."""
        return not self.is_diffusion and has_state_layers(self.architecture, self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.text_config.get("eos_token_id")
        if eos is None:
            return frozenset()
        return frozenset(eos if isinstance(eos, list) else [eos])

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # explicit pool size (tests force preemption with it)
    kv_cache_memory_bytes: int | None = None  # else: a share of free device memory
    gpu_memory_utilization: float = 0.9
    # Hybrid models with prefix caching: snapshots of the recurrent states at block
    # boundaries (scheduler/kv/state_snapshots.py); None: two per max_num_seqs.
    num_state_snapshots: int | None = None
    # Where they are taken (vLLM's names): "align", where a prefill chunk ends (chunks cut
    # at block boundaries); "all", at every block boundary a prefill passes.
    mamba_cache_mode: MambaCacheMode = "align"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise _bad("block_size", self.block_size, "must be a positive power of two")
        _check_at_least_1(self, "num_kv_blocks", "kv_cache_memory_bytes",
                          "num_state_snapshots")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise _bad("mamba_cache_mode", self.mamba_cache_mode,
                       f"must be one of {MAMBA_CACHE_MODES}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _bad("gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    async_scheduling: bool | None = None  # None: auto; EngineConfig resolves it to a bool
    max_queued_requests: int | None = None  # serving: reject beyond this many waiting

    def __post_init__(self) -> None:
        _check_at_least_1(self, "max_num_seqs", "max_num_batched_tokens", "max_queued_requests")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend | None = None
    placement_group_strategy: PlacementStrategy = "PACK"
    dp_sync_interval: int = 16
    # Mixtures of experts: each TP rank holds whole experts (num_experts / TP of them)
    # instead of every expert's 1/TP slice (vLLM's name; across DP ranks not yet).
    enable_expert_parallel: bool = False
    # CPU ranks: torch threads of a step of at least CPU_BURST_MIN_TOKENS tokens (None:
    # the rank's own threads for every step).
    cpu_burst_threads: int | None = None
    # How long the workers' placement group may wait for its resources (an autoscaler
    # adding a GPU node takes minutes).
    placement_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        _check_at_least_1(self, "tensor_parallel_size", "pipeline_parallel_size",
                          "data_parallel_size", "dp_sync_interval", "cpu_burst_threads")
        if not self.placement_timeout_s > 0:
            raise _bad("placement_timeout_s", self.placement_timeout_s, "must be positive")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise _bad("distributed_executor_backend", self.distributed_executor_backend,
                       f"must be one of {EXECUTOR_BACKENDS} or None")
        if self.distributed_executor_backend is None:
            multi = self.world_size > 1 or self.data_parallel_size > 1
            object.__setattr__(self, "distributed_executor_backend", "ray" if multi else "uni")
        if self.distributed_executor_backend == "uni" and (
            self.world_size > 1 or self.data_parallel_size > 1
        ):
            raise ValueError(
                "distributed_executor_backend='uni' cannot run tensor_parallel_size="
                f"{self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}, data_parallel_size={self.data_parallel_size}; "
                "use 'ray' or leave it unset.")
        if self.placement_group_strategy not in PLACEMENT_STRATEGIES:
            raise _bad("placement_group_strategy", self.placement_group_strategy,
                       f"must be one of {PLACEMENT_STRATEGIES}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def stage_bundles(tensor_parallel_size: int, pipeline_parallel_size: int,
                  worker_bundle: dict) -> list[dict]:
    """One bundle per pipeline stage holding its TP group's workers (``tensor_parallel_size``
    x ``worker_bundle``). A bundle lands on one node, so a TP group never spans nodes (its
    all-reduce stays on the node's links); stages may. Rank r sits in bundle r // TP."""
    check_at_least("tensor_parallel_size", tensor_parallel_size)
    check_at_least("pipeline_parallel_size", pipeline_parallel_size)
    stage = {k: v * tensor_parallel_size for k, v in worker_bundle.items()}
    return [dict(stage) for _ in range(pipeline_parallel_size)]


def dp_rank_bundles(tensor_parallel_size: int, pipeline_parallel_size: int,
                    engine_bundle: dict, worker_bundle: dict) -> list[dict]:
    """The bundles of one DP rank. With TP = PP = 1 the rank actor runs the model itself,
    so its one bundle is the worker's; otherwise bundle 0 is the rank's EngineCore actor
    and bundles 1.. its pipeline stages (``stage_bundles``)."""
    if tensor_parallel_size * pipeline_parallel_size == 1:
        return [dict(worker_bundle)]
    return [dict(engine_bundle)] + stage_bundles(tensor_parallel_size, pipeline_parallel_size,
                                                 worker_bundle)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA adapters off

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp" and spec.model is None:
            spec = replace(spec, model=self.model_config.model)  # the target's own layer
            object.__setattr__(self, "speculative_config", spec)
        if spec is not None and spec.method in MODEL_METHODS:
            spec.check_draft_vocab(self.model_config.hf_config)
        if (spec is not None and spec.reads_target_hidden_states
                and self.kv_transfer_config is not None):
            raise ValueError(f"speculative_config.method {spec.method!r} with a "
                             "kv_transfer_config is not supported: KV loaded from outside "
                             "the engine carries no EAGLE head KV for its positions.")
        self._check_diffusion()
        self._check_kv_transfer()
        self._check_expert_parallel()
        self._check_state_layers()
        model = self.model_config
        if self.lora_config is not None and (model.num_experts
                                             or model.architecture in STATE_SPACE_ARCHITECTURES):
            raise ValueError(f"enable_lora is not supported for {model.architecture} (LoRA "
                             "adapts Llama-named attention and dense MLPs; this model has "
                             "sparse experts or Mamba2 mixers).")
        if self.scheduler_config.max_model_len != self.model_config.max_model_len:
            object.__setattr__(self, "scheduler_config", replace(
                self.scheduler_config, max_model_len=self.model_config.max_model_len))
        self._resolve_async_scheduling()

    def _check_diffusion(self) -> None:
        """A diffusion model runs on one rank, without drafts, adapters or a KV connector
        (docs/architecture.md §23): the others are refused by name."""
        model = self.model_config
        if not model.is_diffusion:
            return
        pc = self.parallel_config
        refused = [(name, value) for name, value, unset in (
            ("speculative_config", self.speculative_config, None),
            ("kv_transfer_config", self.kv_transfer_config, None),
            ("enable_lora", self.lora_config is not None, False),
            ("tensor_parallel_size", pc.tensor_parallel_size, 1),
            ("pipeline_parallel_size", pc.pipeline_parallel_size, 1),
            ("data_parallel_size", pc.data_parallel_size, 1),
            ("enable_expert_parallel", pc.enable_expert_parallel, False)) if value != unset]
        if refused:
            name, value = refused[0]
            raise ValueError(f"{name}={value!r} is not supported for the diffusion model "
                             f"{model.architecture} (it runs on one rank, its canvas is its "
                             "step's only draft).")

    def _check_expert_parallel(self) -> None:
        pc, arch = self.parallel_config, self.model_config.architecture
        if not pc.enable_expert_parallel:
            return
        if not self.model_config.num_experts:
            raise ValueError(f"enable_expert_parallel=True needs a mixture-of-experts model; "
                             f"{arch} has no experts.")
        # The experts spread over the TP ranks of one engine, or over every (DP, TP) rank
        # (EP = DP x TP, each pipeline stage its own layers' experts).
        ranks, what = pc.tensor_parallel_size, "tensor_parallel_size"
        if pc.data_parallel_size > 1:
            spec = self.speculative_config
            if spec is not None and spec.method in MODEL_METHODS:
                raise ValueError("enable_expert_parallel=True with data_parallel_size > 1 "
                                 "does not run a draft model or head (speculative_config."
                                 f"method={spec.method!r}): its forward is not in the DP "
                                 "ranks' lockstep; use 'ngram'.")
            ranks = pc.data_parallel_size * pc.tensor_parallel_size
            what = "data_parallel_size x tensor_parallel_size"
        num_experts = moe_traits(arch, self.model_config.hf_config).num_experts
        if num_experts < ranks:
            raise ValueError(f"enable_expert_parallel=True: num_experts={num_experts} cannot "
                             f"give each of {what}={ranks} ranks an expert.")

    def _check_state_layers(self) -> None:
        """A model with Mamba2 layers (scheduler/config/state_layout.py): what its
        per-request state rules out is refused by name; prefix caching turns off."""
        model = self.model_config
        if not model.has_state_layers:
            return
        arch = model.architecture
        if self.kv_transfer_config is not None:
            raise ValueError(f"kv_transfer_config is not supported for {arch}: its Mamba2 "
                             "layers keep a per-request state that a KV connector does not "
                             "move.")
        if self.speculative_config is not None and self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"speculative_config with pipeline_parallel_size="
                             f"{self.parallel_config.pipeline_parallel_size} is not supported "
                             f"for {arch}: an earlier stage learns a step's accepted drafts "
                             "after its next step, and its Mamba2 state continues from them.")
        for shape in recurrent_shapes(arch, model.hf_config):
            shape.check_tp(self.parallel_config.tensor_parallel_size)

    @property
    def num_state_snapshots(self) -> int:
        """Snapshot slots of the recurrent states a hybrid model keeps for prefix caching
        (scheduler/kv/state_snapshots.py); 0 without state layers or prefix caching."""
        cache = self.cache_config
        if not (self.model_config.has_state_layers and cache.enable_prefix_caching):
            return 0
        if cache.num_state_snapshots is not None:
            return cache.num_state_snapshots
        return 2 * self.scheduler_config.max_num_seqs

    def _check_kv_transfer(self) -> None:
        """Prefill/decode transfer pulls each rank's KV heads from the peer's worker
        actors (named, so a peer finds them): the Ray backend, one DP rank, no PP."""
        kv = self.kv_transfer_config
        if kv is None or kv.is_offloading:
            return
        pc = self.parallel_config
        if pc.pipeline_parallel_size > 1 or pc.data_parallel_size > 1:
            raise ValueError(f"kv_transfer_config.kv_connector={kv.kv_connector!r} supports "
                             "pipeline_parallel_size=1 and data_parallel_size=1, got "
                             f"{pc.pipeline_parallel_size} and {pc.data_parallel_size}.")
        if pc.distributed_executor_backend != "ray":
            raise ValueError(f"kv_transfer_config.kv_connector={kv.kv_connector!r} needs "
                             "distributed_executor_backend='ray' (its peers reach the "
                             f"worker actors), got {pc.distributed_executor_backend!r}.")

    def _resolve_async_scheduling(self) -> None:
        """The one place async_scheduling is resolved (docs/architecture.md §3 rule 8):
        None turns on unless an option rules it out (then off, with a log line); True with
        such an option is an error naming it. Every layer below reads the resolved bool."""
        requested = self.scheduler_config.async_scheduling
        why = self.async_scheduling_incompatibility()
        if requested is True and why is not None:
            raise ValueError(f"async_scheduling=True is not supported with {why}.")
        if requested is not None:
            return
        if why is not None:
            logger.info("Async scheduling disabled: not supported with %s.", why)
        object.__setattr__(self, "scheduler_config", replace(
            self.scheduler_config, async_scheduling=why is None))

    def async_scheduling_incompatibility(self) -> str | None:
        """The option that rules out async scheduling, or None. Both executor backends
        execute non-blocking and every engine argument today can overlap (speculation with
        PP included: the PP ring carries accepted runs); one that cannot names itself here."""
        return None

    @property
    def async_scheduling(self) -> bool:
        resolved = self.scheduler_config.async_scheduling
        assert resolved is not None, "EngineConfig.__post_init__ resolves async_scheduling"
        return resolved

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens per decode step (0: no speculative decoding)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots booked past each step's tokens for a request: a draft model without
        PP drafts the next step right after verification, writing its own KV up to k
        positions beyond the step's (runner/spec_decode/speculator.py). Under PP the
        stages draft at the start of the step instead, inside its booking."""
        spec = self.speculative_config
        if spec is None or spec.method not in MODEL_METHODS:
            return 0
        if spec.reads_target_hidden_states:  # a head drafts at verification, PP or not
            return spec.num_speculative_tokens
        return spec.num_speculative_tokens if self.parallel_config.pipeline_parallel_size == 1 \
            else 0

    @functools.cached_property
    def eagle_aux_layers(self) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose inputs its head reads; every pipeline stage
        keeps those among its layers and sends them on (runner/models/llama.py)."""
        spec = self.speculative_config
        return spec.aux_layer_ids(self.model_config.hf_config) if spec is not None else ()

    @functools.cached_property
    def kv_cache_groups(self) -> KVCacheGroups:
        """The layers' block tables (kv_cache_groups.py). One table for every layer, which
        keeps every block, where a KV connector sends or offloads the blocks, a draft
        model reads them with attention of its own, or state layers sit between them;
        else one per group of layers of one window, windowed groups freeing the blocks
        behind their window as the request decodes."""
        spec = self.speculative_config
        model = self.model_config
        windows = model.layer_windows
        if self.kv_transfer_config is not None or model.has_state_layers or (
                spec is not None and spec.method == "draft_model"):
            return KVCacheGroups.single(len(windows), None)
        return KVCacheGroups.of(windows)

    @property
    def kv_free_window(self) -> int | None:
        """The window of a model whose every layer shares one (one block table, its
        blocks behind the window freed); None otherwise."""
        groups = self.kv_cache_groups
        return groups.windows[0] if groups.num_groups == 1 else None

    def kv_blocks_per_request(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens (drafts' slots included) holds
        at once, over every group: a full-attention group all of them, a windowed one a
        window's worth plus what the steps in flight and the next one may add before
        their tokens settle."""
        block_size = self.cache_config.block_size
        full = -(-num_tokens // block_size)
        unsettled = (self.max_concurrent_batches + 1) * (
            self.scheduler_config.max_num_batched_tokens + self.num_lookahead_tokens)
        return sum(full if window is None
                   else min(full, -(-(window - 1 + unsettled) // block_size) + 1)
                   for window in self.kv_cache_groups.windows)

    @property
    def max_concurrent_batches(self) -> int:
        # PP needs pp_size batches in flight to fill the pipeline; async needs one more
        # so the scheduler plans step t+1 while step t runs.
        pp = self.parallel_config.pipeline_parallel_size
        return pp + 1 if self.async_scheduling else pp
