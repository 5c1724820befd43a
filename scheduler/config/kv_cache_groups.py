"""KV cache groups: which layers share a block table, and which cache tensor each uses.

A model whose attention layers differ in window (Gemma 2 and 3: sliding layers beside
global ones; Qwen2 with ``max_window_layers``) keeps one block table per group of layers
of one window, all drawn from one block pool (docs/architecture.md §20). A sliding group
gives back the blocks that fell out of its window while a global group keeps all of
them, so a sliding layer holds only its window's worth of KV.

Every group has the same number of layers, ``num_tensors``: the i-th layer of every
group writes the i-th cache tensor, so a block id means one page in each of those
tensors and a block of any group costs the same bytes. A window kind whose layer count
is not a multiple of that size leaves its last group short (its unused tensors' pages
go unread). A model with one window kind, or none, keeps one group of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # each group's window (None: every earlier key)
    # Per attention layer, in layer order: (its group, its cache tensor)
    layer_slots: tuple[tuple[int, int], ...]
    num_tensors: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @classmethod
    def single(cls, num_layers: int, window: int | None) -> KVCacheGroups:
        """One block table for every layer: tensor i is layer i's."""
        return cls((window,), tuple((0, i) for i in range(num_layers)), num_layers)

    @classmethod
    def of(cls, layer_windows: list[int | None] | tuple[int | None, ...]) -> KVCacheGroups:
        """Groups for attention layers with these windows: full attention first, then
        each window in order of first appearance, each cut into groups of the smallest
        kind's layer count."""
        kinds: dict[int | None, list[int]] = {}
        if None in layer_windows:
            kinds[None] = []
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) <= 1:
            return cls.single(len(layer_windows), layer_windows[0] if layer_windows else None)
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        slots: list[tuple[int, int]] = [(0, 0)] * len(layer_windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for tensor, layer in enumerate(layers[start:start + size]):
                    slots[layer] = (len(windows), tensor)
                windows.append(window)
        return cls(tuple(windows), tuple(slots), size)
