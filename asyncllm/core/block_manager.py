"""Paged KV cache bookkeeping: block tables over a pool of physical blocks, prefix caching.

Pure Python, integers and bytes only. The worker owns the tensors; this module only decides
which physical block (an index into the first dimension of the K/V cache tensors) holds which
tokens. Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size`` (PagedAttention, Kwon et al., SOSP 2023); with layer groups
(:mod:`asyncllm.core.kv_groups`) a request has one such table per group.

Automatic prefix caching (as in vLLM; hashes and the pool in
:mod:`asyncllm.core.block_pool`): a request's prompt is matched block by block against the
hashes of blocks already computed; hits are shared by reference count instead of being
computed again. With a host tier (:mod:`asyncllm.core.host_store`) a block the pool evicts
is kept in host memory, and a lookup that misses the pool but hits the host tier gets a new
block that the worker fills by a swap in before the step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from asyncllm.core.block_pool import BlockPool, BlockPoolError, hash_block, prompt_block_hashes
from asyncllm.core.host_store import HostPrefixStore
from asyncllm.core.kv_groups import KVGroups

__all__ = [
    "PLACEHOLDER",
    "BlockManager",
    "BlockPool",
    "BlockPoolError",
    "PrefixHit",
    "TokenSource",
    "hash_block",
    "longest_hit",
    "prompt_block_hashes",
]


class TokenSource(Protocol):
    """Anything that hands out a slice of a request's tokens (prompt then output)."""

    def token_ids(self, start: int, stop: int) -> list[int]: ...


class PrefixHit:
    """The longest cached prefix found for a request (:meth:`BlockManager.find_cached_prefix`):
    ``len(hit)`` whole blocks, and per layer group the blocks serving them.

    Attributes:
        tables: per group, ``len(hit)`` block ids; a sliding group's entries before its
            ``live_from`` are placeholders (the window of the first token to compute does
            not reach them) and are not shared. An entry ``-1 - slot`` (negative) is a hit
            of the host tier in its ``slot``: :meth:`BlockManager.allocate` gives it a new
            block and plans the swap in.
        live_from: per group, the first entry that is a block of the cache.
        num_disk_blocks: after :meth:`BlockManager.allocate`, the blocks (positions) of
            the host hits that the disk tier had read into the host store.
    """

    __slots__ = ("live_from", "num_disk_blocks", "tables")

    def __init__(self, tables: list[list[int]], live_from: list[int]) -> None:
        self.tables = tables
        self.live_from = live_from
        self.num_disk_blocks = 0

    def __len__(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    def live_blocks(self) -> Iterator[int]:
        """The device pool's blocks the hit shares (placeholders and host hits left out)."""
        for table, lo in zip(self.tables, self.live_from, strict=True):
            yield from (b for b in table[lo:] if b >= 0)

    def host_entries(self) -> list[tuple[int, int, int]]:
        """``(group, entry, slot)`` of the hits served by the host tier."""
        return [
            (g, i, -1 - table[i])
            for g, (table, lo) in enumerate(zip(self.tables, self.live_from, strict=True))
            for i in range(lo, len(table))
            if table[i] < 0
        ]

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the prefix (positions) that at least one group loads from the host."""
        return len({i for _, i, _ in self.host_entries()})


#: What a sliding group's table holds for a block it freed (a valid block id, so that a
#: table copied into a kernel's tensor stays in range: no kernel reads such an entry).
PLACEHOLDER = 0


class BlockManager:
    """Block tables of the requests that hold KV cache, over one :class:`BlockPool`.

    With layer groups (:class:`~asyncllm.core.kv_groups.KVGroups`) each request holds one
    table per group, all drawn from the one pool; a sliding group's blocks behind its window
    go back to the pool as the request advances (:meth:`free_behind_window`), and a prefix
    hit needs, in a sliding group, only the blocks that the window of its first computed
    token reaches (:meth:`find_cached_prefix`).

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_caching: match and register full blocks by hash (prefix caching).
        groups: the layer groups; None: one full-attention group.
        host_store: the host tier that keeps the blocks the pool evicts (None: they are
            lost); only with ``enable_caching``.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        groups: KVGroups | None = None,
        host_store: HostPrefixStore | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups if groups is not None else KVGroups.single(1)
        self.num_groups = self.groups.num_groups
        #: The sliding groups (their blocks behind the window are freed).
        self.sliding = tuple(g for g, w in enumerate(self.groups.windows) if w > 0)
        self.pool = BlockPool(num_blocks, self.num_groups)
        self.host_store = host_store if enable_caching else None
        if self.host_store is not None:
            self.pool.on_evict = self.host_store.spill
        # Per request, per group: its block table, and the first entry that is not a
        # placeholder (always 0 in a full group).
        self._tables: dict[str, list[list[int]]] = {}
        self._live: dict[str, list[int]] = {}
        # Per request, the hashes of its full blocks in order (computed lazily).
        self._hashes: dict[str, list[bytes]] = {}
        # Per request, how many of its leading blocks are registered in the pool.
        self._registered: dict[str, int] = {}
        #: ``(block, group, hash)`` of the blocks registered since the engine last took
        #: them (for the disk tier's write-through); None: not collected.
        self.new_cached: list[tuple[int, int, bytes]] | None = None

    @property
    def reads_disk(self) -> bool:
        """Whether a disk tier stands behind the host tier."""
        return self.host_store is not None and self.host_store.disk is not None

    def fetch_from_disk(
        self, request_id: str, tokens: TokenSource, num_tokens: int, salt: str | None
    ) -> bool:
        """Start reading, into the host tier, the request's next prompt blocks that only
        the disk tier holds (:meth:`HostPrefixStore.prefetch`); True while any is being read
        (the request waits for them rather than computing them)."""
        store = self.host_store
        if store is None or store.disk is None:
            return False
        hashes = self.block_hashes(request_id, tokens, salt, num_tokens - 1)
        k = len(longest_hit(self.pool, self.groups, hashes, self.block_size, store))
        keys = [
            (g, h)
            for h in hashes[k:]
            for g in range(self.num_groups)
            if self.pool.lookup(h, g) is None
        ]
        return store.prefetch(keys)

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
    ) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` made of full blocks: ``k`` blocks such
        that every full group has blocks ``0..k-1`` cached and every sliding group those
        that the window of position ``k * block_size`` reaches.

        The last token is never covered (it must be computed to produce logits), so a prompt
        that is a whole number of blocks leaves its last block to be computed into a fresh one.
        Changes nothing but the request's hash list.
        """
        if not self.enable_caching:
            return PrefixHit([[] for _ in range(self.num_groups)], [0] * self.num_groups)
        hashes = self.block_hashes(request_id, tokens, salt, num_tokens - 1)
        return longest_hit(self.pool, self.groups, hashes, self.block_size, self.host_store)

    def _first_live(self, group: int, start: int) -> int:
        return self.groups.first_live_block(group, start, self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int, start: int | None = None) -> int:
        """New blocks the request needs so that its tables cover ``num_tokens`` tokens (in a
        sliding group, only from the first block that position ``start``'s window reaches,
        when it holds none yet)."""
        n = -(-num_tokens // self.block_size)
        tables = self._tables.get(request_id)
        total = 0
        for g in range(self.num_groups):
            held = len(tables[g]) if tables else 0
            if start is not None and g in self.sliding:
                held = max(held, self._first_live(g, start))
            total += max(0, n - held)
        return total

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached: PrefixHit | Sequence[int] = (),
        *,
        write_from: int | None = None,
        copies: list[tuple[int, int]] | None = None,
    ) -> bool:
        """Grow the request's block tables to cover ``num_tokens`` tokens.

        Args:
            cached: for a request holding no blocks yet, the prefix found by
                :meth:`find_cached_prefix` (or, with one group, its blocks); they are
                shared, not copied.
            write_from: the first position the step writes. If it falls inside a block that
                other tables share (a forked, partly filled block), that block is copied on
                write: a new block replaces it in this table and ``(old, new)`` is appended to
                ``copies`` for the worker to copy before the step. For a request holding no
                blocks yet, a sliding group starts at the first block this position's window
                reaches (placeholders before it).

        Returns:
            False, changing nothing, when too few blocks are free.
        """
        tables = self._tables.get(request_id)
        if tables is None or not tables[0]:  # every group grows alike: none holds a block
            return self._allocate_new(request_id, num_tokens, cached, write_from)
        if cached:
            raise BlockPoolError(f"{request_id}: cached prefix given to a request with blocks")
        n = -(-num_tokens // self.block_size)
        need = 0
        for table in tables:
            if n > len(table):
                need += n - len(table)
        cows = self._shared_write_blocks(request_id, tables, write_from)
        if need + len(cows) > self.pool.num_free:
            return False
        for g, i in cows:
            (new,) = self.pool.allocate(1)
            old = tables[g][i]
            self.pool.free([old])
            tables[g][i] = new
            if copies is None:
                raise BlockPoolError("copy-on-write needs a copies list")
            copies.append((old, new))
        if need:
            fresh = self.pool.allocate(need)
            at = 0
            for table in tables:
                k = n - len(table)
                if k > 0:
                    table.extend(fresh[at : at + k])
                    at += k
        return True

    def _allocate_new(
        self,
        request_id: str,
        num_tokens: int,
        cached: PrefixHit | Sequence[int],
        write_from: int | None,
    ) -> bool:
        """:meth:`allocate` for a request that holds no blocks yet."""
        hit: PrefixHit | None = None
        if cached:
            hit = cached if isinstance(cached, PrefixHit) else PrefixHit([list(cached)], [0])
        G = self.num_groups
        k = 0 if hit is None else len(hit)
        n = -(-num_tokens // self.block_size)
        skip = [0] * G
        if write_from is not None:
            for g in self.sliding:
                skip[g] = max(0, self._first_live(g, write_from) - k)
        need = [max(0, n - k - skip[g]) for g in range(G)]
        total = sum(need)
        reclaimed = (
            0 if hit is None else sum(1 for b in hit.live_blocks() if self.pool.ref_count(b) == 0)
        )
        host = [] if hit is None else hit.host_entries()
        if total + reclaimed + len(host) > self.pool.num_free:
            return False
        if hit is None:
            tables: list[list[int]] = [[] for _ in range(G)]
            live = [0] * G
        else:
            self.pool.share(hit.live_blocks())
            tables = [list(t) for t in hit.tables]
            live = list(hit.live_from)
            if host:
                hit.num_disk_blocks = self._load_host_hits(tables, host)
        for g in self.sliding:
            if skip[g]:
                tables[g].extend([PLACEHOLDER] * skip[g])
                live[g] = len(tables[g])
        if total:
            fresh = self.pool.allocate(total)
            at = 0
            for g in range(G):
                tables[g].extend(fresh[at : at + need[g]])
                at += need[g]
        self._tables[request_id] = tables
        self._live[request_id] = live
        return True

    def _load_host_hits(self, tables: list[list[int]], host: list[tuple[int, int, int]]) -> int:
        """Give each host hit ``(group, entry, slot)`` a new block (cached under its hash
        at once: the swap in runs before any forward reads it) and plan its swap in; returns
        the positions among them that the disk tier had supplied."""
        store = self.host_store
        if store is None:
            raise BlockPoolError("a host hit without a host store")
        for _, _, slot in host:
            store.pin(slot)  # the allocation below may spill into the store: keep these
        from_disk = set()
        for (g, i, slot), block in zip(host, self.pool.allocate(len(host)), strict=True):
            (group, block_hash), disk = store.load(slot, block)
            if group != g or not self.pool.set_hash(block, block_hash, g):
                raise BlockPoolError(f"host slot {slot}: not a free hash of group {g}")
            tables[g][i] = block
            if disk:
                from_disk.add(i)
        return len(from_disk)

    def _shared_write_blocks(
        self, request_id: str, tables: list[list[int]], write_from: int | None
    ) -> list[tuple[int, int]]:
        """``(group, entry)`` of the partly filled blocks at ``write_from`` that other tables
        share (to copy on write)."""
        bs = self.block_size
        if write_from is None or not write_from % bs:
            return []
        i = write_from // bs
        live = self._live[request_id]
        ref_count = self.pool.ref_count
        shared = []
        for g, table in enumerate(tables):
            if live[g] <= i < len(table) and ref_count(table[i]) > 1:
                shared.append((g, i))
        return shared

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` (holding no blocks) the parent's blocks, shared by reference."""
        if self._tables.get(child_id):
            raise BlockPoolError(f"{child_id} already holds blocks")
        tables = [list(t) for t in self._tables.get(parent_id, ())]
        if not tables:
            return
        live = list(self._live[parent_id])
        for table, lo in zip(tables, live, strict=True):
            self.pool.share(table[lo:])
        self._tables[child_id] = tables
        self._live[child_id] = live

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
        tables = self._tables[request_id]
        live = self._live[request_id]
        hashes = self.block_hashes(request_id, tokens, salt, num_computed)
        for g, table in enumerate(tables):
            for i in range(max(done, live[g]), full):
                if self.pool.set_hash(table[i], hashes[i], g) and self.new_cached is not None:
                    self.new_cached.append((table[i], g, hashes[i]))
        self._registered[request_id] = full

    def free_behind_window(self, request_id: str, num_computed: int) -> None:
        """Return to the pool the sliding groups' blocks that no token from position
        ``num_computed`` on can see (they keep their hashes: cached until evicted)."""
        if not self.sliding:
            return
        tables = self._tables.get(request_id)
        if not tables:
            return
        live = self._live[request_id]
        for g in self.sliding:
            table = tables[g]
            lo = min(self._first_live(g, num_computed), len(table))
            if lo > live[g]:
                dead = table[live[g] : lo]
                table[live[g] : lo] = [PLACEHOLDER] * len(dead)
                live[g] = lo
                self.pool.free(dead)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Return to the pool the request's blocks past those its first ``num_tokens``
        tokens need: speculative decoding allocated them for proposals that were rejected
        (they hold no accepted K/V and were never registered in the prefix cache)."""
        tables = self._tables.get(request_id)
        if not tables:
            return
        keep = -(-num_tokens // self.block_size)
        for table, live in zip(tables, self._live[request_id], strict=True):
            cut = max(keep, live)
            if len(table) > cut:
                tail = table[cut:]
                del table[cut:]
                self.pool.free(reversed(tail))

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's physical block ids in ``group``, logical order (the live list; do
        not mutate; a sliding group's entries before :meth:`live_from` are placeholders)."""
        tables = self._tables.get(request_id)
        return tables[group] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's tables, one per group (empty when it holds none; do not mutate)."""
        return self._tables.get(request_id, [])

    def live_from(self, request_id: str, group: int) -> int:
        """The first entry of the request's ``group`` table that holds a block."""
        live = self._live.get(request_id)
        return live[group] if live else 0

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks of the cache the request's tables hold (in ``group``, or all groups)."""
        tables = self._tables.get(request_id)
        if not tables:
            return 0
        live = self._live[request_id]
        groups = range(self.num_groups) if group is None else (group,)
        return sum(len(tables[g]) - live[g] for g in groups)

    def live_blocks(self, request_id: str, start: int, num_blocks: int) -> list[int]:
        """Group after group, the request's blocks among its first ``num_blocks`` entries
        that a token from position ``start`` on reads: what a preemption swaps out (and what
        :meth:`allocate` with ``write_from=start`` gives a request swapped back in).

        Raises:
            BlockPoolError: one of them was freed.
        """
        out: list[int] = []
        for g, table in enumerate(self._tables.get(request_id, ())):
            lo = self._first_live(g, start)
            if lo < self._live[request_id][g] or num_blocks > len(table):
                raise BlockPoolError(f"{request_id}: group {g} does not hold {lo}..{num_blocks}")
            out.extend(table[lo:num_blocks])
        return out

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (no-op if it holds none)."""
        self._hashes.pop(request_id, None)
        self._registered.pop(request_id, None)
        tables = self._tables.pop(request_id, None)
        live = self._live.pop(request_id, None)
        if tables and live:
            for table, lo in zip(tables, live, strict=True):
                # Tail first: the tail is the least shared part, so it is evicted first.
                self.pool.free(reversed(table[lo:]))

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless reference counts equal the block tables' holdings and
        every cached block is held only by tables of the group it is cached for."""
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for rid, tables in self._tables.items():
            for g, table in enumerate(tables):
                for b in table[self._live[rid][g] :]:
                    counts[b] += 1
                    if self.pool.hash_group(b) not in (None, g):
                        raise BlockPoolError(f"block {b}: cached for another group than {g}")
        for b, c in enumerate(counts):
            if c != self.pool.ref_count(b):
                raise BlockPoolError(
                    f"block {b}: {c} tables hold it, ref count says {self.pool.ref_count(b)}"
                )


def longest_hit(
    pool: BlockPool,
    groups: KVGroups,
    hashes: Sequence[bytes],
    block_size: int,
    store: HostPrefixStore | None = None,
) -> PrefixHit:
    """The longest prefix of ``hashes`` (chained block hashes) that ``pool``, or else the
    host tier ``store`` (entries ``-1 - slot``), serves for every group (see
    :meth:`BlockManager.find_cached_prefix`)."""
    G = groups.num_groups
    k = len(hashes)

    def lookup(h: bytes, g: int) -> int | None:
        b = pool.lookup(h, g)
        if b is None and store is not None:
            slot = store.lookup(h, g)
            return None if slot is None else -1 - slot
        return b

    found: list[list[int | None]] = []
    for g, w in enumerate(groups.windows):
        look: list[int | None] = []
        if w <= 0:  # a full group: its hits must be contiguous from the first block
            for h in hashes[:k]:
                b = lookup(h, g)
                if b is None:
                    break
                look.append(b)
            k = len(look)
        else:
            look = [lookup(h, g) for h in hashes[:k]]
        found.append(look)
    # Per sliding group, the last miss at or before each entry (-1: none).
    last_miss: dict[int, list[int]] = {}
    for g, w in enumerate(groups.windows):
        if w > 0:
            miss, marks = -1, []
            for i, b in enumerate(found[g][:k]):
                if b is None:
                    miss = i
                marks.append(miss)
            last_miss[g] = marks
    while k > 0 and any(
        marks[k - 1] >= groups.first_live_block(g, k * block_size, block_size)
        for g, marks in last_miss.items()
    ):
        k -= 1
    live = [groups.first_live_block(g, k * block_size, block_size) for g in range(G)]
    tables: list[list[int]] = []
    for g in range(G):
        blocks = found[g][live[g] : k]
        tables.append([PLACEHOLDER] * live[g] + [b for b in blocks if b is not None])
    return PrefixHit(tables, live)
