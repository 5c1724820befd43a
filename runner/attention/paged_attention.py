"""Paged attention over the block-major KV cache, one module for every backend.

KV cache per layer: key and value ``[num_blocks, num_kv_heads, block_size, head_dim]``
(vLLM's layout); token ``p`` is at offset ``p % bs`` of block ``block_table[p // bs]``.
On CUDA every row runs the Triton kernel (triton_paged.py). Natively (CPU): short rows
(decodes, speculative rows) take the ragged kernel (cpu_kernel.py, or ragged.py), long rows
one ``scaled_dot_product_attention`` each. The metadata is built once per step on the
host, uploaded without a wait and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.attention.cpu_kernel import load_cpu_attention_kernel
from raylm.runner.attention.ragged import (
    RaggedTokens,
    build_ragged_tokens,
    ragged_paged_attention,
)
from raylm.runner.host_memory import huge_page_zeros
from raylm.scheduler.config import envs

if TYPE_CHECKING:
    from raylm.runner.attention.triton_paged import TileMetadata
    from raylm.runner.kv_transfer.base import KVConnectorWorker
    from raylm.runner.state_cache import StateMetadata

# Query rows up to this long take the ragged kernel (each token its own pairs); longer
# rows are prefill-like and one sdpa per row is cheaper than repeating their context.
RAGGED_MAX_QUERY_LEN = 8
# Device memory the torch ragged kernel may take per layer call: its pairs copy K/V block
# by block, so an unbounded step (128 rows x 128k context) would need tens of GiB. Tokens
# past it run in further chunks (ragged_attention.pair_chunks).
RAGGED_WORKSPACE_BYTES = 1 << 30


def ragged_bytes_per_pair(num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, elem: int) -> int:
    """Device bytes the torch ragged kernel holds per (token, block) pair at its peak: the
    pair's K and V blocks, its query copy, float32 scores (and their cast), float32
    outputs, and the mask row."""
    kv = 2 * num_kv_heads * block_size * head_dim * elem
    scores = num_heads * block_size * (4 + 2 * elem)
    out = num_heads * head_dim * (4 + 2 * elem)
    return kv + scores + out + block_size * 4


def max_ragged_pairs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     elem: int, workspace_bytes: int = RAGGED_WORKSPACE_BYTES) -> int:
    """Pairs the torch ragged kernel takes at once within ``workspace_bytes``."""
    per_pair = ragged_bytes_per_pair(num_heads, num_kv_heads, head_dim, block_size, elem)
    return max(1, workspace_bytes // per_pair)


@dataclass
class PrefillSpan:
    start: int  # token range [start, end) in the flattened batch
    end: int
    context_len: int  # tokens already in the KV cache before this chunk
    block_ids: torch.Tensor | None = None  # [nb] blocks of context + chunk; None if no context
    mask: torch.Tensor | None = None  # [q_len, context_len + q_len] bool; None if no context


@dataclass
class EqualRows:
    """Rows of one query length each whose keys are gathered at once (a diffusion
    decoder's canvases, attention/bidirectional.py): one sdpa for the step, each row's
    keys padded to the longest row's and masked past its own."""

    query_len: int
    block_ids: torch.Tensor  # [R, nb] each row's blocks, padded with block 0
    seq_len: int  # keys gathered per row: the longest row's
    mask: torch.Tensor  # [R, 1, 1, query_len, seq_len] bool: True where visible


@dataclass
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token
    ragged: RaggedTokens | None = None  # the short rows' tokens; None when there are none
    prefills: list[PrefillSpan] = field(default_factory=list)
    tiles: TileMetadata | None = None  # the Triton kernel's: every row, when it runs
    equal_rows: EqualRows | None = None  # every row at once (then no ragged, no spans)
    # False: a row's tokens see each other both ways (a diffusion canvas; built by
    # attention/bidirectional.py, every row an sdpa span with its mask).
    causal: bool = True
    # Per num_kv_heads: the cache write index [T * H]; every layer of one rank has the same
    # head count, so the first layer builds it.
    _write_index: dict[int, torch.Tensor] = field(default_factory=dict)
    # Sliding-window layers: this step's metadata for a window, built by the first layer of
    # that window (``for_window``) from the same host inputs.
    _rebuild: Callable[[int], AttentionMetadata] | None = None
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict)
    # Hybrid models: the step's rows for the Mamba2 layers (runner/state_cache.py)
    state: StateMetadata | None = None
    # KV cache groups after the first (scheduler/config/kv_cache_groups.py): each has its
    # own block table, so its own writes and reads, built by its first layer of the step.
    _group_builder: Callable[[int], AttentionMetadata] | None = None
    _groups: dict[int, AttentionMetadata] = field(default_factory=dict)

    def for_group(self, group: int) -> AttentionMetadata:
        """The step's metadata for the layers of KV cache group ``group`` (this one is
        group 0's)."""
        if group == 0:
            return self
        if group not in self._groups:
            if self._group_builder is None:
                raise ValueError(f"KV cache group {group} has no block table in this step.")
            self._groups[group] = self._group_builder(group)
        return self._groups[group]

    def for_window(self, window: int) -> AttentionMetadata:
        """The step's metadata for a layer whose tokens see only their last ``window``
        keys (themselves included): the same writes, fewer keys read."""
        if window not in self._windowed:
            if self._rebuild is None:
                raise ValueError("this step's metadata has no windowed twin (the Triton "
                                 "kernel applies a layer's window itself).")
            self._windowed[window] = self._rebuild(window)
        return self._windowed[window]

    def write_index(self, num_kv_heads: int) -> torch.Tensor:
        """Rows of the cache seen as ``[num_blocks * H * block_size, D]`` for each new
        token and head."""
        if num_kv_heads not in self._write_index:
            bs = self.block_size
            heads = torch.arange(num_kv_heads, device=self.slot_mapping.device)
            block, offset = self.slot_mapping // bs, self.slot_mapping % bs
            self._write_index[num_kv_heads] = (
                (block[:, None] * num_kv_heads + heads[None, :]) * bs
                + offset[:, None]).reshape(-1)
        return self._write_index[num_kv_heads]


def head_rows(block_ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """``[..., nb]`` block ids -> ``[..., H, nb]`` rows of the cache viewed as
    ``[num_blocks * H, block_size, D]``: (block b, head h) is row ``b * H + h``."""
    return block_ids.unsqueeze(-2) * heads.numel() + heads[:, None]


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str, latent: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (key, value) cache ``[num_blocks, num_kv_heads, block_size, head_dim]``;
    ``latent`` (multi-head latent attention): one tensor, returned as both. Zeros, not
    empty: masked positions of a partly filled block are still multiplied (by a
    zero weight), and 0 * NaN garbage would poison the attention output. On the CPU in
    huge pages (see ``huge_page_zeros``): decode reads scattered blocks."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)

    def zeros() -> torch.Tensor:
        if torch.device(device).type == "cpu":
            return huge_page_zeros(shape, dtype, envs.cpu_kv_prefault())
        return torch.zeros(shape, dtype=dtype, device=device)

    key = zeros()
    return (key, key) if latent else (key, zeros())


class HostUpload:
    """Host int64 arrays gathered for one upload: a step's metadata crosses to the device
    in a single copy (pinned and non-blocking on CUDA), then is sliced there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[np.ndarray] = []
        self._size = 0

    def add(self, array: np.ndarray) -> tuple[int, int]:
        start = self._size
        self._parts.append(np.asarray(array, dtype=np.int64).reshape(-1))
        self._size += self._parts[-1].size
        return start, self._size

    def upload(self) -> torch.Tensor:
        host = torch.from_numpy(np.concatenate(self._parts) if self._parts
                                else np.empty(0, np.int64))
        if self.device.type == "cpu":
            return host
        # The caching host allocator keeps the pinned buffer alive until the copy is done.
        return host.pin_memory().to(self.device, non_blocking=True)


def resolve_attention_backend(device: torch.device, requested: str | None = None) -> str:
    """``triton`` or ``native`` for this rank (envs.attention_backend; auto: Triton on
    CUDA where it imports)."""
    requested = requested or envs.attention_backend()
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "native"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "native"
    return "triton"


def build_attention_metadata(
    query_start_loc: np.ndarray,  # [B + 1] cumulative query lengths
    seq_lens: np.ndarray,  # [B] context + this step's tokens
    slot_mapping: torch.Tensor,  # [T] on the device
    block_table: np.ndarray | torch.Tensor,  # [B, nb] host block ids (a CPU tensor is taken)
    block_size: int,
    cpu_kernel: bool | None = None,
    max_pairs: int | None = None,
    backend: str = "native",
    window: int = 0,
) -> AttentionMetadata:
    """``cpu_kernel``: whether the short rows may take the C++ kernel (default: on CPU);
    they do when it is available. ``max_pairs``: the torch kernel's chunk (max_ragged_pairs).
    ``backend``: ``triton`` builds the Triton kernel's tiles for every row instead.
    ``window`` > 0: every token sees only its last ``window`` keys, itself included (a
    sliding-window layer; ``for_window`` of the plain metadata builds it when needed)."""
    device = slot_mapping.device
    if backend == "triton":
        from raylm.runner.attention.triton_paged import build_tiles

        table = block_table.numpy() if isinstance(block_table, torch.Tensor) else block_table
        return AttentionMetadata(num_tokens=int(query_start_loc[-1]), block_size=block_size,
                                 slot_mapping=slot_mapping,
                                 tiles=build_tiles(query_start_loc, seq_lens, table, device))
    cpu_kernel = (device.type == "cpu" if cpu_kernel is None else cpu_kernel) and \
        load_cpu_attention_kernel()
    table = block_table.numpy() if isinstance(block_table, torch.Tensor) else block_table
    if window < 0:
        raise ValueError(f"window must be positive (0: none), got {window}.")
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_tokens = int(query_start_loc[-1])
    query_lens = np.diff(query_start_loc)
    meta = AttentionMetadata(num_tokens=num_tokens, block_size=block_size,
                             slot_mapping=slot_mapping)
    if window == 0:
        def rebuild(w: int) -> AttentionMetadata:
            return build_attention_metadata(query_start_loc, seq_lens, slot_mapping, table,
                                            block_size, cpu_kernel, max_pairs, backend, w)

        meta._rebuild = rebuild
    pack = HostUpload(device)
    short = np.flatnonzero(query_lens <= RAGGED_MAX_QUERY_LEN)
    finish_ragged = None
    if short.size:
        finish_ragged = build_ragged_tokens(query_start_loc, seq_lens, table, short,
                                            block_size, num_tokens, pack, pairs=not cpu_kernel,
                                            max_pairs=max_pairs, window=window)
    # Long rows: few per step (bounded by the token budget), one sdpa each.
    spans: list[tuple[PrefillSpan, tuple[int, int] | None]] = []
    for row in np.flatnonzero(query_lens > RAGGED_MAX_QUERY_LEN).tolist():
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        seq_len = int(seq_lens[row])
        span = PrefillSpan(start, end, seq_len - (end - start))
        spans.append((span, pack.add(table[row, :-(-seq_len // block_size)])
                      if span.context_len > 0 else None))
    uploaded = pack.upload()
    if finish_ragged is not None:
        meta.ragged = finish_ragged(uploaded)
    for span, where in spans:
        seq_len = span.context_len + span.end - span.start
        if where is not None:
            span.block_ids = uploaded[where[0]:where[1]]
        if where is not None or 0 < window < span.end - span.start:
            q_pos = torch.arange(span.context_len, seq_len, device=device)
            k_pos = torch.arange(seq_len, device=device)[None, :]
            span.mask = k_pos <= q_pos[:, None]
            if window > 0:
                span.mask &= k_pos > q_pos[:, None] - window
        meta.prefills.append(span)
    return meta


def _gather(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of the (block, head) ``rows`` [..., H, nb] of a
    ``[num_blocks, H, bs, D]`` cache, as ``[..., H, length, D]`` (each (.., head) slab
    contiguous; on CPU index_select is much faster than advanced indexing)."""
    num_blocks, num_heads, bs, head_dim = cache.shape
    out = cache.view(num_blocks * num_heads, bs, head_dim).index_select(0, rows.reshape(-1))
    nb = rows.shape[-1]
    return out.view(*rows.shape[:-1], nb * bs, head_dim)[..., :length, :]


class Attention(nn.Module):
    """Attention over the paged KV cache for one layer (this rank's heads only)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None,
                 latent_cache: bool = False) -> None:
        super().__init__()
        # Multi-head latent attention (runner/models/mla.py): the cache holds one tensor,
        # the key, whose leading channels are also the value; no value is written.
        self.latent_cache = latent_cache
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attn_logit_softcapping must be positive or null, got {softcap}.")
        # Gemma 2: each score capped to softcap * tanh(score / softcap) before the softmax.
        self.softcap = softcap or 0.0
        # Each token sees only its last sliding_window keys, itself included (transformers'
        # window); None: every earlier key.
        self.sliding_window = sliding_window
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = scale
        # (key_cache, value_cache), bound by the model runner once the cache is allocated.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # A KV connector's worker side and this layer's index in the cache list (bound with
        # the cache when one is configured): waited on before the cache is touched.
        self.kv_connector: KVConnectorWorker | None = None
        self.layer_index = 0
        # Its decoder layer's index in the model, and the KV cache group whose block table
        # it reads (bound with the cache; scheduler/config/kv_cache_groups.py).
        self.decoder_layer = 0
        self.kv_group = 0

    @property
    def kv_tensors(self) -> int:
        """Cache tensors per layer: 2 (key, value), or 1 for a latent cache."""
        return 1 if self.latent_cache else 2

    def cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """This layer's KV cache bytes per block."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.kv_tensors * block_size * self.num_kv_heads * self.head_dim * elem

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq * D]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound; call initialize_kv_cache() first.")
        key_cache, value_cache = self.kv_cache
        if self.kv_group:
            meta = meta.for_group(self.kv_group)
        connector = self.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_index)
        if meta.tiles is not None:
            from raylm.runner.attention import triton_paged

            triton_paged.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
            if connector is not None:
                connector.save_kv_layer(self.layer_index)
            return triton_paged.paged_attention(query, key_cache, value_cache, meta.tiles,
                                                self.scale, self.sliding_window or 0,
                                                self.softcap)
        write = meta.write_index(self.num_kv_heads)
        tokens = (-1, self.head_dim)
        key_cache.view(tokens).index_copy_(0, write, key.reshape(tokens))
        if not self.latent_cache:
            value_cache.view(tokens).index_copy_(0, write, value.reshape(tokens))
        if connector is not None:
            connector.save_kv_layer(self.layer_index)
        if self.sliding_window is not None:
            meta = meta.for_window(self.sliding_window)
        if meta.equal_rows is not None:
            return self._equal_rows(query, key_cache, value_cache, meta.equal_rows)
        ragged = meta.ragged
        idx = None if ragged is None else ragged.token_index
        if ragged is not None and idx is None:  # every token is ragged
            return ragged_paged_attention(query, key_cache, value_cache, ragged, self.scale,
                                          self.softcap)
        out = query.new_empty((query.shape[0], self.num_heads * self.head_dim))
        if ragged is not None and idx is not None:  # idx is set whenever ragged is, here
            out.index_copy_(0, idx, ragged_paged_attention(
                query.index_select(0, idx), key_cache, value_cache, ragged, self.scale,
                self.softcap))
        for span in meta.prefills:
            out[span.start:span.end] = self._prefill(query, key, value, key_cache, value_cache,
                                                     span)
        return out

    def _equal_rows(self, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, rows: EqualRows) -> torch.Tensor:
        """Every row's queries against its keys gathered from the cache, in one sdpa."""
        num_rows, q_len = rows.block_ids.shape[0], rows.query_len
        q = query.reshape(num_rows, q_len, self.num_kv_heads, self.num_queries_per_kv,
                          self.head_dim).permute(0, 2, 3, 1, 4)
        heads = torch.arange(self.num_kv_heads, device=rows.block_ids.device)
        cache_rows = head_rows(rows.block_ids, heads)  # [R, Hkv, nb]
        shape = (num_rows, self.num_kv_heads, self.num_queries_per_kv, rows.seq_len,
                 self.head_dim)
        k = _gather(key_cache, cache_rows, rows.seq_len).unsqueeze(2).expand(shape)
        v = _gather(value_cache, cache_rows, rows.seq_len).unsqueeze(2).expand(shape)
        if self.softcap:
            o = _softcapped_attention(q, k, v, rows.mask, self.scale, self.softcap)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.mask, scale=self.scale)
        return o.permute(0, 3, 1, 2, 4).reshape(num_rows * q_len,
                                                self.num_heads * self.head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 span: PrefillSpan) -> torch.Tensor:
        q_len = span.end - span.start
        q = query[span.start:span.end].reshape(
            q_len, self.num_kv_heads, self.num_queries_per_kv, self.head_dim).permute(1, 2, 0, 3)
        if span.block_ids is None:  # [S, Hkv, D] -> [Hkv, S, D]
            k = key[span.start:span.end].transpose(0, 1)
            v = value[span.start:span.end].transpose(0, 1)
        else:
            heads = torch.arange(self.num_kv_heads, device=span.block_ids.device)
            rows = head_rows(span.block_ids, heads)
            seq_len = span.context_len + q_len
            k, v = _gather(key_cache, rows, seq_len), _gather(value_cache, rows, seq_len)
        # [Hkv, S, D] -> [Hkv, G, S, D] as a stride-0 view over the G query heads of each KV
        # head (no copy; equal shapes keep every sdpa backend eligible).
        shape = (self.num_kv_heads, self.num_queries_per_kv, k.shape[1], self.head_dim)
        k = k.unsqueeze(1).expand(shape)
        v = v.unsqueeze(1).expand(shape)
        if self.softcap:
            o = _softcapped_attention(q, k, v, span.mask, self.scale, self.softcap)
        elif span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=self.scale)
        return o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads * self.head_dim)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None, scale: float, softcap: float
                          ) -> torch.Tensor:
    """sdpa with each score capped to softcap * tanh(score / softcap) first (sdpa has no
    cap): scores and softmax in float32. ``mask``: sdpa's (True or 0: visible) or None for
    causal over the last q rows."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    q_len, kv_len = s.shape[-2], s.shape[-1]
    if mask is None:
        rows = torch.arange(q_len, device=s.device)[:, None] + (kv_len - q_len)
        visible = torch.arange(kv_len, device=s.device)[None, :] <= rows
        s = s.masked_fill(~visible, float("-inf"))
    elif mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
