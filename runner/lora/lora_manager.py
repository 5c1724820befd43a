"""One rank's LoRA adapters: device slots, the host cache, and each step's mapping.

``max_loras`` device slots per adapted linear; an adapter a step needs and no slot holds
takes a free slot or the least recently used one no request of the step needs (the
scheduler keeps a step's distinct adapters within ``max_loras``, so there always is one).
Adapters read from disk stay on the host, cut for this rank, in an LRU of
``max_cpu_loras``: a swapped-out adapter comes back with a copy, not a read. Every rank of
a TP group or PP pipeline decides alike from the same SchedulerOutputs, but nothing
depends on that: a rank's slots are its own.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from raylm.runner.lora.lora_linear import LoRAContext, LoRALinear
from raylm.runner.lora.mapping import NO_SLOT, LoRAMapping, TritonBuffers, torch_segments
from raylm.runner.lora.weights import LoadedAdapter, load_adapter
from raylm.scheduler.config.engine_config import EngineConfig
from raylm.scheduler.config.lora_config import LoRAConfig
from raylm.scheduler.lora import LoRARequest

if TYPE_CHECKING:
    from raylm.runner.attention.paged_attention import AttentionMetadata
    from raylm.runner.cuda_graphs import DecodeForward
    from raylm.runner.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

ADAPTED = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
           ("mlp", "down_proj"))


class LoRAManager:
    def __init__(self, config: LoRAConfig, hf_config: dict, device: torch.device,
                 backend: str, max_tokens: int) -> None:
        """``backend``: ``triton`` (CUDA, the Triton attention backend) or ``torch``;
        ``max_tokens``: the most tokens of a step, padding rows included."""
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.context = LoRAContext(backend)
        self.buffers = (TritonBuffers(max_tokens, config.max_loras, device)
                        if backend == "triton" else None)
        if backend == "triton":
            from raylm.runner.lora.triton_ops import padded_rank

            self.rank = padded_rank(config.max_lora_rank)
        else:
            self.rank = config.max_lora_rank
        self.hooks: dict[tuple[int, str], LoRALinear] = {}
        self.known: dict[int, LoRARequest] = {}  # every adapter a request has named
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU, max_cpu_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter -> slot, LRU order
        self.stats = {"disk_loads": 0, "slot_loads": 0}

    @classmethod
    def make(cls, engine_config: EngineConfig, device: torch.device,
             attention_backend: str) -> LoRAManager | None:
        """The rank's manager, None without LoRA. The Triton kernels go with the Triton
        attention backend (CUDA; CI's TRITON_INTERPRET runs), torch's elsewhere."""
        config = engine_config.lora_config
        if config is None:
            return None
        sched = engine_config.scheduler_config
        return cls(config, engine_config.model_config.hf_config, device,
                   "triton" if attention_backend == "triton" else "torch",
                   max(sched.max_num_batched_tokens, sched.max_num_seqs))

    # ---------------------------------------------------------------- setup
    def attach(self, model: LlamaForCausalLM) -> None:
        """Give this stage's adapted linears their slots and hooks."""
        inner = model.model
        for index in range(inner.start_layer, inner.end_layer):
            layer = inner.layers[index]
            for block, name in ADAPTED:
                base = getattr(getattr(layer, block), name)
                hook = LoRALinear(base, self.config.max_loras, self.rank, self.context)
                base.lora = hook
                self.hooks[(index, name)] = hook
        nbytes = sum(h.a.numel() * h.a.element_size() + h.b.numel() * h.b.element_size()
                     for h in self.hooks.values())
        logger.info("LoRA: %d slots of rank %d on %d linears, %.1f MiB (%s kernels)",
                    self.config.max_loras, self.rank, len(self.hooks), nbytes / 2**20,
                    self.context.backend)

    def graph_forward(self, model: nn.Module) -> DecodeForward:
        """``model`` for CUDA-graph capture: the LoRA kernels always launch over the fixed
        buffers (set only on the host here: nothing inside a capture may copy), so a
        replay reads whatever slots the step wrote there."""
        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    intermediate_tensors: None) -> torch.Tensor:
            self.context.mapping = LoRAMapping(int(input_ids.shape[0]), True,
                                               buffers=self.buffers)
            return model(input_ids, positions, meta, intermediate_tensors)

        return forward

    # ---------------------------------------------------------------- requests
    def add_request(self, lora: LoRARequest | None) -> None:
        if lora is None:
            return
        known = self.known.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            # The id now names other weights: forget what was read for the old ones.
            self.host.pop(lora.lora_int_id, None)
            self.slot_of.pop(lora.lora_int_id, None)
        self.known[lora.lora_int_id] = lora

    # ---------------------------------------------------------------- one step
    def begin_step(self, row_lora_ids: np.ndarray, num_scheduled: np.ndarray,
                   num_tokens: int) -> None:
        """Place the step's adapters in slots and set the mapping every adapted linear
        reads: ``row_lora_ids`` per scheduled row (0: the base model), ``num_scheduled``
        its tokens, ``num_tokens`` the step's (padding rows, with no adapter, after)."""
        ids = np.unique(row_lora_ids[row_lora_ids > 0])
        lookup = {i: self._activate(i, ids) for i in ids.tolist()}
        row_slots = np.fromiter((lookup.get(i, NO_SLOT) for i in row_lora_ids.tolist()),
                                np.int64, row_lora_ids.size)
        token_slots = np.full(num_tokens, NO_SLOT, np.int64)
        token_slots[:int(num_scheduled.sum())] = np.repeat(row_slots, num_scheduled)
        if self.buffers is not None:
            active = self.buffers.fill(token_slots)
            self.context.mapping = LoRAMapping(num_tokens, active, buffers=self.buffers)
        else:
            seg = torch_segments(token_slots, self.device)
            self.context.mapping = LoRAMapping(num_tokens, seg is not None, torch_segments=seg)

    def _activate(self, lora_id: int, needed: np.ndarray) -> int:
        """The slot holding adapter ``lora_id``, loaded there if it is not."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if needed.size > self.config.max_loras:
            raise RuntimeError(f"a step needs {needed.size} LoRA adapters, more than "
                               f"max_loras={self.config.max_loras} (the scheduler's limit).")
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in set(needed.tolist()))
            slot = self.slot_of.pop(victim)
        adapter = self._host_adapter(lora_id)
        for key, hook in self.hooks.items():
            hook.write_slot(slot, adapter.parts.get(key))
        self.slot_of[lora_id] = slot
        self.stats["slot_loads"] += 1
        return slot

    def _host_adapter(self, lora_id: int) -> LoadedAdapter:
        adapter = self.host.get(lora_id)
        if adapter is not None:
            self.host.move_to_end(lora_id)
            return adapter
        lora = self.known.get(lora_id)
        if lora is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} was never named by a request.")
        adapter = load_adapter(lora.lora_path, self.hooks, self.hf_config,
                               self.config.max_lora_rank)
        self.stats["disk_loads"] += 1
        self.host[lora_id] = adapter
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)
        return adapter
