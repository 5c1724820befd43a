"""Metadata for rows whose query tokens see each other both ways: a diffusion decoder's
canvas (runner/models/diffusion_gemma.py, docs/architecture.md §23).

Each row's tokens are written to their slots like any other row's, then every token of the
row reads the row's whole context and all of the row's tokens. Every row runs as one sdpa
span with an explicit mask (the ragged kernels and the Triton kernel are causal by
construction), so this is the native path on every device. The diffusion encoder's causal
rows take the same spans (``causal=True``): sdpa's sums, as transformers' encoder has them,
which the canvases' self-conditioning would amplify from the ragged kernel's last bits.
"""

from __future__ import annotations

import numpy as np
import torch

from raylm.runner.attention.paged_attention import (
    AttentionMetadata,
    EqualRows,
    HostUpload,
    PrefillSpan,
)


def build_bidirectional_metadata(
    query_start_loc: np.ndarray,  # [B + 1] cumulative query lengths
    seq_lens: np.ndarray,  # [B] context + this step's tokens
    slot_mapping: torch.Tensor,  # [T] on the device
    block_table: np.ndarray | torch.Tensor,  # [B, nb] host block ids
    block_size: int,
    window: int = 0,
    causal: bool = False,
) -> AttentionMetadata:
    """``window`` > 0: a row's tokens see the context keys its first token would see
    under that window (the last ``window - 1`` before it), and every token of the row.
    ``causal``: each token sees its row's earlier tokens and itself only (within its own
    last ``window`` keys), every row still an sdpa span."""
    if window < 0:
        raise ValueError(f"window must be positive (0: none), got {window}.")
    table = block_table.numpy() if isinstance(block_table, torch.Tensor) else block_table
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    device = slot_mapping.device
    meta = AttentionMetadata(num_tokens=int(query_start_loc[-1]), block_size=block_size,
                             slot_mapping=slot_mapping, causal=causal)
    if window == 0:
        def rebuild(w: int) -> AttentionMetadata:
            return build_bidirectional_metadata(query_start_loc, seq_lens, slot_mapping,
                                                table, block_size, w, causal)

        meta._rebuild = rebuild
    query_lens = np.diff(query_start_loc)
    if not causal and len(query_lens) > 1 and (query_lens == query_lens[0]).all():
        meta.equal_rows = _equal_rows(query_lens, seq_lens, table, block_size, window, device)
        return meta
    pack = HostUpload(device)
    spans = []
    for row in range(len(seq_lens)):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        seq_len = int(seq_lens[row])
        spans.append((PrefillSpan(start, end, seq_len - (end - start)),
                      pack.add(table[row, :-(-seq_len // block_size)])))
    uploaded = pack.upload()
    for span, (lo, hi) in spans:
        seq_len = span.context_len + span.end - span.start
        # Always gathered from the cache with a mask: a span without one is causal.
        span.block_ids = uploaded[lo:hi]
        k_pos = torch.arange(seq_len, device=device)[None, :]
        # Each query's last key: its own position (causal), or the row's last.
        q_pos = torch.arange(span.context_len, seq_len, device=device)[:, None]
        last = q_pos if causal else torch.full_like(q_pos, seq_len - 1)
        # A window counts back from the query itself (causal) or the row's first token.
        first = (q_pos if causal else torch.full_like(q_pos, span.context_len)) - window
        visible = (k_pos <= last) & (k_pos > first if window else k_pos >= 0)
        span.mask = visible
        meta.prefills.append(span)
    return meta


def _equal_rows(query_lens: np.ndarray, seq_lens: np.ndarray, table: np.ndarray,
                block_size: int, window: int, device: torch.device) -> EqualRows:
    """Canvases of one width: every row's keys in one padded gather, masked per row."""
    q_len = int(query_lens[0])
    seq_len = int(seq_lens.max())
    nb = -(-seq_len // block_size)
    blocks = np.zeros((len(seq_lens), nb), dtype=np.int64)
    cols = min(nb, table.shape[1])
    blocks[:, :cols] = table[:, :cols]
    k_pos = np.arange(seq_len)[None, :]
    visible = k_pos < seq_lens[:, None]
    if window:
        visible &= k_pos > (seq_lens - q_len)[:, None] - window
    mask = np.broadcast_to(visible[:, None, None, None, :],
                           (len(seq_lens), 1, 1, q_len, seq_len))
    return EqualRows(query_len=q_len, block_ids=torch.from_numpy(blocks).to(device),
                     seq_len=seq_len, mask=torch.from_numpy(np.ascontiguousarray(mask)).to(device))
