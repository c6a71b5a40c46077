"""Paged KV cache bookkeeping: a pool of physical blocks, block tables, prefix caching.

Pure Python, integers and bytes only. The worker owns the tensors; this module only decides
which physical block (an index into the first dimension of the K/V cache tensors) holds which
tokens. Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size`` (PagedAttention, Kwon et al., SOSP 2023).

Automatic prefix caching (as in vLLM): every full block gets a hash that chains the hash of
the block before it, the block's token ids, and the request's optional ``cache_salt`` (in the
first block, so it reaches every later one). A request's prompt is matched block by block
against the hashes of blocks already computed; hits are shared by reference count instead of
being computed again. A freed block keeps its hash and stays in the free queue, least recently
freed first; it serves hits until it is handed out again, which evicts it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol


class TokenSource(Protocol):
    """Anything that hands out a slice of a request's tokens (prompt then output)."""

    def token_ids(self, start: int, stop: int) -> list[int]: ...


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

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with reference count zero (cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (in use or free)."""
        return len(self._cached)

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
                del self._cached[h]
                self._hashes[b] = None
                self.num_evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block, taking cached free blocks out of the free queue."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                if self._hashes[b] is None:
                    raise BlockPoolError(f"sharing free uncached block {b}")
                del self._free[b]
            self._ref_counts[b] += 1

    def set_hash(self, block: int, block_hash: bytes) -> bool:
        """Register a full, computed block under ``block_hash``.

        Returns:
            False when another block already holds that hash (this one stays uncached).
        """
        if self._hashes[block] is not None or block_hash in self._cached:
            return False
        self._hashes[block] = block_hash
        self._cached[block_hash] = block
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
                del self._cached[h]
                self._hashes[b] = None
                dropped += 1
        return dropped

    def ref_count(self, block: int) -> int:
        """The number of block tables holding ``block``."""
        return self._ref_counts[block]

    def block_hash(self, block: int) -> bytes | None:
        """The hash a block is cached under, or None."""
        return self._hashes[block]

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless free queue, reference counts and hashes agree."""
        for b in range(self.num_blocks):
            rc = self._ref_counts[b]
            if rc < 0:
                raise BlockPoolError(f"block {b} has negative reference count")
            if (rc == 0) != (b in self._free):
                raise BlockPoolError(f"block {b}: ref count {rc} vs free queue")
            h = self._hashes[b]
            if h is not None and self._cached.get(h) != b:
                raise BlockPoolError(f"block {b}: hash not mapped back to it")
        if len(self._cached) != sum(h is not None for h in self._hashes):
            raise BlockPoolError("cached-hash map and block hashes disagree")


class BlockManager:
    """Block tables of the requests that hold KV cache, over one :class:`BlockPool`.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_caching: match and register full blocks by hash (prefix caching).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # Per request, the hashes of its full blocks in order (computed lazily).
        self._hashes: dict[str, list[bytes]] = {}
        # Per request, how many of its leading blocks are registered in the pool.
        self._registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Free physical blocks (cached blocks with no holder count as free)."""
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        """All physical blocks."""
        return self.pool.num_blocks

    def block_hashes(
        self, request_id: str, tokens: TokenSource, salt: str | None, num_tokens: int
    ) -> list[bytes]:
        """Hashes of (at least) the full blocks among the first ``num_tokens`` tokens, kept
        per request and extended as it grows, so each block is hashed once."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens.token_ids(i * bs, (i + 1) * bs), salt))
        return hashes

    def find_cached_prefix(
        self, request_id: str, tokens: TokenSource, num_tokens: int, salt: str | None
    ) -> list[int]:
        """The blocks of the longest cached prefix of ``token_ids`` made of full blocks.

        The last token is never covered (it must be computed to produce logits), so a prompt
        that is a whole number of blocks leaves its last block to be computed into a fresh one.
        Changes nothing but the request's hash list.
        """
        if not self.enable_caching:
            return []
        hashes = self.block_hashes(request_id, tokens, salt, num_tokens - 1)
        hits: list[int] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks the request needs so that its table covers ``num_tokens`` tokens."""
        held = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached: Sequence[int] = (),
        *,
        write_from: int | None = None,
        copies: list[tuple[int, int]] | None = None,
    ) -> bool:
        """Grow the request's block table to cover ``num_tokens`` tokens.

        Args:
            cached: for a request holding no blocks yet, the prefix blocks found by
                :meth:`find_cached_prefix`; they are shared, not copied.
            write_from: the first position the step writes. If it falls inside a block that
                other tables share (a forked, partly filled block), that block is copied on
                write: a new block replaces it in this table and ``(old, new)`` is appended to
                ``copies`` for the worker to copy before the step.

        Returns:
            False, changing nothing, when too few blocks are free.
        """
        table = self._tables.get(request_id)
        if cached and table:
            raise BlockPoolError(f"{request_id}: cached prefix given to a request with blocks")
        need = max(0, -(-num_tokens // self.block_size) - len(table or cached))
        reclaimed = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        cow = -1
        if table and write_from is not None and write_from % self.block_size:
            i = write_from // self.block_size
            if i < len(table) and self.pool.ref_count(table[i]) > 1:
                cow = i
        if need + reclaimed + (cow >= 0) > self.pool.num_free:
            return False
        if table is None:
            table = self._tables[request_id] = []
        if cached:
            self.pool.share(cached)
            table.extend(cached)
        if cow >= 0:
            (new,) = self.pool.allocate(1)
            old = table[cow]
            self.pool.free([old])
            table[cow] = new
            if copies is None:
                raise BlockPoolError("copy-on-write needs a copies list")
            copies.append((old, new))
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` (holding no blocks) the parent's blocks, shared by reference."""
        if self._tables.get(child_id):
            raise BlockPoolError(f"{child_id} already holds blocks")
        table = list(self._tables.get(parent_id, ()))
        self.pool.share(table)
        self._tables[child_id] = table

    def cache_full_blocks(
        self, request_id: str, tokens: TokenSource, salt: str | None, num_computed: int
    ) -> None:
        """Register the request's blocks that are full and computed (``num_computed`` tokens
        have their K/V in the cache) so that later requests can hit them."""
        if not self.enable_caching:
            return
        done = self._registered.get(request_id, 0)
        full = num_computed // self.block_size
        if full <= done:
            return
        table = self._tables[request_id]
        hashes = self.block_hashes(request_id, tokens, salt, num_computed)
        for i in range(done, full):
            self.pool.set_hash(table[i], hashes[i])
        self._registered[request_id] = full

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, logical order (the live list; do not mutate)."""
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        self._hashes.pop(request_id, None)
        self._registered.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            # Tail first: the tail is the least shared part, so it is evicted first.
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
