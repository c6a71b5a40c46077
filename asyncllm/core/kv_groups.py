"""Layer groups of a hybrid KV cache: layers that share block tables, and what each keeps.

A model whose layers all attend over their whole context keeps one block table per
request for all its layers (:class:`KVGroups` of one group). A model with sliding-window
layers (Gemma 2/3, Cohere 2, Mistral v0.1, Phi-3, Qwen2 with ``max_window_layers``) gets a
group per ``g`` layers of one kind (as vLLM v1's hybrid KV-cache manager): the layers of
each window (0: full attention) are cut in order into groups of ``g`` layers, ``g`` the
fewest layers of any one kind (Gemma 3 270M: 3 full and 15 sliding layers, so 6 groups of
3: one full, five of window 512). All groups draw from one pool of physical blocks; a block
holds ``g`` layers' K/V (the cache's ``g`` *slots*: slot ``s`` is layer ``s`` of whichever
group holds the block), and each request has one block table per group.

A sliding group needs only the blocks that a token still to be computed can see: the query
at position ``p`` sees positions ``p - window + 1 .. p``, so once ``n`` tokens are computed
the blocks wholly before position ``n - window + 1`` are never read again and go back to the
pool (:meth:`KVGroups.first_live_block`). Their table entries stay as placeholders (kept
positional: token ``i`` is still in entry ``i // block_size``) that no kernel reads.

Pure Python, integers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    """The layer groups of a KV cache.

    Attributes:
        windows: per group, its layers' sliding window in tokens (0: full attention).
        layers: per group, its layers in slot order (group ``i``'s layer ``layers[i][s]``
            keeps its K/V in slot ``s`` of the group's blocks).
    """

    windows: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]

    @staticmethod
    def single(num_layers: int) -> KVGroups:
        """One full-attention group of all ``num_layers`` layers (a model without windows)."""
        return KVGroups((0,), (tuple(range(num_layers)),))

    @staticmethod
    def of_windows(layer_windows: Sequence[int], max_model_len: int | None = None) -> KVGroups:
        """Group layers by window (``layer_windows[i]``: layer ``i``'s window, 0 for none).

        A window of at least ``max_model_len`` tokens never drops a position and counts as
        none. Layers of a single kind make one group; otherwise each kind is cut, in layer
        order, into groups of ``g`` layers, ``g`` the number of layers of the rarest kind
        (a kind's last group may hold fewer).

        Raises:
            ValueError: no layers, or a negative window.
        """
        if not layer_windows:
            raise ValueError("a KV cache needs at least one layer")
        if min(layer_windows) < 0:
            raise ValueError(f"negative sliding window in {list(layer_windows)}")
        kinds: dict[int, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            if max_model_len is not None and w >= max_model_len:
                w = 0
            kinds.setdefault(w, []).append(layer)
        g = min(len(v) for v in kinds.values())
        windows: list[int] = []
        layers: list[tuple[int, ...]] = []
        for w in sorted(kinds):  # full attention (0) first
            members = kinds[w]
            for i in range(0, len(members), g):
                windows.append(w)
                layers.append(tuple(members[i : i + g]))
        return KVGroups(tuple(windows), tuple(layers))

    @property
    def num_groups(self) -> int:
        """Groups (block tables per request)."""
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Layers whose K/V one block holds (the largest group)."""
        return max(len(members) for members in self.layers)

    @property
    def num_layers(self) -> int:
        """Layers in all groups."""
        return sum(len(members) for members in self.layers)

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or a sliding one: tables are per group and windows free."""
        return len(self.windows) > 1 or self.windows[0] > 0

    def layer_slots(self) -> list[tuple[int, int]]:
        """Per layer (by index), its ``(group, slot)``."""
        where = [(0, 0)] * self.num_layers
        for group, members in enumerate(self.layers):
            for slot, layer in enumerate(members):
                where[layer] = (group, slot)
        return where

    def first_live_block(self, group: int, start: int, block_size: int) -> int:
        """The first block of ``group``'s table that a token at position ``start`` or later
        still reads (0 for a full group): the blocks before it lie wholly before
        ``start - window + 1``."""
        w = self.windows[group]
        if w <= 0 or start < w:
            return 0
        return (start - w + 1) // block_size

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds at once, computed in
        chunks of at most ``chunk`` tokens: every block in a full group; in a sliding group
        those its chunk's first query sees back to, through the chunk's last token."""
        every = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            if w <= 0:
                total += every
            else:
                # blocks from (s - w + 1) // bs through (s + c - 1) // bs
                total += min(every, (chunk + w - 2) // block_size + 2)
        return total

    def describe(self) -> str:
        """E.g. "6 groups of 3 layers (1 full, 5 window 512)", "1 group of 30 layers (full)"."""
        kinds: dict[int, int] = {}
        for w in self.windows:
            kinds[w] = kinds.get(w, 0) + 1
        parts = [f"{n} full" if w == 0 else f"{n} window {w}" for w, n in sorted(kinds.items())]
        n = self.num_groups
        sizes = sorted({len(members) for members in self.layers}, reverse=True)
        size = " or ".join(str(s) for s in sizes) + (" layer" if sizes == [1] else " layers")
        if n == 1:
            w = self.windows[0]
            return f"1 group of {size} ({'full' if w == 0 else f'window {w}'})"
        return f"{n} groups of {size} ({', '.join(parts)})"
