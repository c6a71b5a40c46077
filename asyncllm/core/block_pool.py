"""The pool of physical KV blocks: reference counts, a free queue, and the prefix cache's
hashes.

Automatic prefix caching (as in vLLM): every full block gets a hash that chains the hash of
the block before it, the block's token ids, and the request's optional ``cache_salt`` (in the
first block, so it reaches every later one). A freed block keeps its hash and stays in the
free queue, least recently freed first; it serves hits until it is handed out again, which
evicts it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: double free, freeing an unknown block, or a broken invariant."""


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """SHA-256 of (parent hash, salt of the first block, token ids): 32 bytes.

    SHA-256 makes collisions negligible (unlike Python's ``hash()`` of a tuple, which is 64-bit
    and seeded per process).
    """
    h = hashlib.sha256()
    if parent is None:
        # surrogatepass: any Python str is a valid salt, lone surrogates included.
        h.update(b"root" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass"))
    else:
        h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    max_blocks: int | None = None,
) -> list[bytes]:
    """The chained hashes of the blocks of a prompt that the prefix cache can serve: the full
    blocks among its first ``len(token_ids) - 1`` tokens (the last token is always computed,
    as :meth:`BlockManager.find_cached_prefix` says), at most ``max_blocks`` of them.

    The same hashes :class:`BlockManager` gives the prompt's blocks (same ``block_size``,
    :func:`hash_block` chain, ``salt`` in the first block), so a router outside the engine
    can tell which replica's cache holds a prompt's prefix.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = max(len(token_ids) - 1, 0) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes: list[bytes] = []
    for i in range(n):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes


class BlockPool:
    """A fixed set of ``num_blocks`` physical blocks with reference counts and hashes.

    A block is in the free queue exactly when its reference count is zero. The queue is
    ordered least recently freed first; :meth:`allocate` takes from its head and evicts the
    cached hash of a block it takes.

    With ``num_groups`` layer groups (:mod:`asyncllm.core.kv_groups`) the cache is keyed
    per group: a block is cached as ``(group, hash)``, the group whose table computed it
    (the same tokens give the same hash in every group, but each group's layers hold their
    own K/V).

    Raises:
        ValueError: ``num_blocks`` or ``num_groups`` < 1.
    """

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 1 or num_groups < 1:
            raise ValueError(f"num_blocks and num_groups must be >= 1: {num_blocks}, {num_groups}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._groups = [0] * num_blocks  # the group a cached block's hash belongs to
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.num_evictions = 0
        #: Called as ``on_evict(block, group, hash)`` when :meth:`allocate` evicts a cached
        #: block (the host tier keeps it: :mod:`asyncllm.core.host_store`); None: lost.
        self.on_evict: Callable[[int, int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks with reference count zero (cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (in use or free)."""
        return sum(len(c) for c in self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, least recently freed first, each with reference count 1.

        Raises:
            BlockPoolError: fewer than ``n`` blocks are free (callers check ``num_free`` first).
        """
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hashes[b]
            if h is not None:  # evict: its old contents are about to be overwritten
                del self._cached[self._groups[b]][h]
                if self.on_evict is not None:
                    self.on_evict(b, self._groups[b], h)
                self._hashes[b] = None
                self.num_evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def lookup(self, block_hash: bytes, group: int = 0) -> int | None:
        """The block holding ``block_hash`` for ``group``, or None."""
        return self._cached[group].get(block_hash)

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block, taking cached free blocks out of the free queue."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                if self._hashes[b] is None:
                    raise BlockPoolError(f"sharing free uncached block {b}")
                del self._free[b]
            self._ref_counts[b] += 1

    def set_hash(self, block: int, block_hash: bytes, group: int = 0) -> bool:
        """Register a full, computed block of ``group`` under ``block_hash``.

        Returns:
            False when another block already holds that hash (this one stays uncached).
        """
        cached = self._cached[group]
        if self._hashes[block] is not None or block_hash in cached:
            return False
        self._hashes[block] = block_hash
        self._groups[block] = group
        cached[block_hash] = block
        return True

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches zero joins the tail
        of the free queue (keeping its hash, so it can still be hit).

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
                self._free[b] = None

    def evict_free_cached(self) -> int:
        """Drop the hashes of all free blocks (blocks in use keep theirs); returns how many."""
        dropped = 0
        for b in self._free:
            h = self._hashes[b]
            if h is not None:
                del self._cached[self._groups[b]][h]
                self._hashes[b] = None
                dropped += 1
        return dropped

    def ref_count(self, block: int) -> int:
        """The number of block tables holding ``block``."""
        return self._ref_counts[block]

    def block_hash(self, block: int) -> bytes | None:
        """The hash a block is cached under, or None."""
        return self._hashes[block]

    def hash_group(self, block: int) -> int | None:
        """The group a block is cached for, or None when it carries no hash."""
        return None if self._hashes[block] is None else self._groups[block]

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless free queue, reference counts and hashes agree."""
        for b in range(self.num_blocks):
            rc = self._ref_counts[b]
            if rc < 0:
                raise BlockPoolError(f"block {b} has negative reference count")
            if (rc == 0) != (b in self._free):
                raise BlockPoolError(f"block {b}: ref count {rc} vs free queue")
            h = self._hashes[b]
            if h is not None and self._cached[self._groups[b]].get(h) != b:
                raise BlockPoolError(f"block {b}: hash not mapped back to it")
        if self.num_cached != sum(h is not None for h in self._hashes):
            raise BlockPoolError("cached-hash map and block hashes disagree")
