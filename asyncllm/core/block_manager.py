"""Paged KV cache bookkeeping: a pool of physical blocks and a block table per request.

Pure Python, integers only. The worker owns the tensors; this module only decides which
physical block (an index into the first dimension of the K/V cache tensors) holds which
tokens. Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size`` (PagedAttention, Kwon et al., SOSP 2023).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: double free, freeing an unknown block, or a broken invariant."""


class BlockPool:
    """A fixed set of ``num_blocks`` physical blocks with reference counts.

    A block is free exactly when its reference count is zero; free blocks are handed out
    first-in first-out so that recently freed blocks are reused last.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with reference count zero."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            BlockPoolError: fewer than ``n`` blocks are free (callers check ``num_free`` first).
        """
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches zero becomes free.

        Raises:
            BlockPoolError: a block id is out of range or already free (double free).
        """
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"block {b} out of range [0, {self.num_blocks})")
            if self._ref_counts[b] <= 0:
                raise BlockPoolError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        """The number of block tables holding ``block``."""
        return self._ref_counts[block]

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless every block is either free exactly once or referenced."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a block is in the free queue twice")
        for b in range(self.num_blocks):
            in_free = self._ref_counts[b] == 0
            if self._ref_counts[b] < 0:
                raise BlockPoolError(f"block {b} has negative reference count")
            if in_free != (b in free):
                raise BlockPoolError(f"block {b}: ref count {self._ref_counts[b]} vs free queue")


class BlockManager:
    """Block tables of the requests that hold KV cache, over one :class:`BlockPool`.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Free physical blocks."""
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        """All physical blocks."""
        return self.pool.num_blocks

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks the request needs so that its table covers ``num_tokens`` tokens."""
        held = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to cover ``num_tokens`` tokens.

        Returns:
            False, changing nothing, when too few blocks are free.
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, logical order (the live list; do not mutate)."""
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            # Tail first: with prefix caching the tail is the least reusable part.
            self.pool.free(reversed(table))

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless reference counts equal the block tables' holdings."""
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for b in table:
                counts[b] += 1
        for b, c in enumerate(counts):
            if c != self.pool.ref_count(b):
                raise BlockPoolError(
                    f"block {b}: {c} tables hold it, ref count says {self.pool.ref_count(b)}"
                )
