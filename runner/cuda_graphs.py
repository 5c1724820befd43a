"""CUDA graphs for decode steps: the model's forward captured once per batch bucket.

An eager decode step launches ~60 kernels per layer, and on a GPU the host's launch time
exceeds the device's work; a graph replays them in one launch. A decode step (every row
one token) is padded to a bucket (InputPreparer.enable_padding) and runs over fixed buffers:
input ids, positions, slots and the Triton kernel's tile metadata live at the addresses the
graph was captured with. Steps with a prefill, drafts or PP run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from raylm.runner.attention.paged_attention import AttentionMetadata

if TYPE_CHECKING:
    from raylm.runner.prepare_inputs import InputPreparer

logger = logging.getLogger(__name__)

# A single-stage model's decode forward: (input ids, positions, metadata, no intermediate
# tensors) -> hidden states. The model itself, or LoRAManager.graph_forward's wrapper.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, None], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 after, and ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return sorted({b for b in sizes if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured forward per bucket, replayed over the preparer's fixed buffers.

    ``forward(num_rows, meta)`` runs the model on the first ``num_rows`` entries of those
    buffers; ``views(num_rows)`` returns the metadata a capture records (the Triton tile
    buffers' views and the slot buffer's slice). Graphs share one memory pool and are
    captured largest first, so the smaller ones reuse its memory."""

    def __init__(self, forward: Callable[[int, AttentionMetadata], torch.Tensor],
                 views: Callable[[int], AttentionMetadata], buckets: list[int],
                 buffers: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self._forward = forward
        self._views = views
        self.buckets = sorted(buckets)
        self._buffers = buffers  # the input tensors the capture read (checked at replay)
        self._captured_buffers: tuple[int, ...] = ()  # their data_ptr()s
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.replays = 0  # steps that ran as a graph (tests, benchmarks)

    def capture(self, device: torch.device) -> None:
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(device)
        pool = torch.cuda.graph_pool_handle()
        self._captured_buffers = tuple(b.data_ptr() for b in self._buffers())
        for size in reversed(self.buckets):
            meta = self._views(size)
            self._forward(size, meta)  # warm-up: lazy initialisations stay out of the graph
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size, meta)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = max(0, free_before - free_after)
        logger.info("captured %d CUDA graphs for decode batches %s in %.1f s, %.0f MiB",
                    len(self._graphs), self.buckets, self.capture_seconds,
                    self.memory_bytes / (1 << 20))

    def replay(self, num_rows: int) -> torch.Tensor | None:
        """The captured forward's output for a step padded to ``num_rows`` (a bucket),
        after its inputs were written into the buffers; None when there is no such graph
        or the buffers moved since the capture (the step then runs eagerly)."""
        entry = self._graphs.get(num_rows)
        if entry is None or tuple(b.data_ptr() for b in self._buffers()) != self._captured_buffers:
            return None
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out


def setup_decode_padding(preparer: InputPreparer, model: DecodeForward, device: torch.device,
                         max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                         capture: bool) -> DecodeGraphs | None:
    """Pad the preparer's decode steps to buckets (the Triton kernel's metadata in fixed
    buffers); with ``capture``, capture the model's forward for each bucket."""
    buckets = decode_buckets(max_num_seqs)
    tile_buffers = None
    if preparer.attention_backend == "triton":
        from raylm.runner.attention.triton_paged import TileBuffers

        tile_buffers = TileBuffers(max(buckets), max_blocks_per_seq, device)
    preparer.enable_padding(buckets, scratch_block, tile_buffers)
    if not capture:
        return None
    graphs = DecodeGraphs(
        forward=lambda n, meta: model(preparer.input_ids[:n], preparer.positions[:n], meta,
                                      None),
        views=preparer.dummy_decode, buckets=buckets,
        buffers=lambda: (preparer.input_ids, preparer.positions, preparer.slot_mapping))
    try:
        with torch.inference_mode():
            graphs.capture(device)
    except Exception as e:  # a forward that cannot be captured still serves, eagerly
        logger.error("CUDA graph capture failed, decode steps run eagerly: %r", e)
        return None
    return graphs
