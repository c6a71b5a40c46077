"""The second tier of the prefix cache: full blocks evicted from the device pool, kept in
host memory (the bookkeeping; the worker's CPU offload pool holds the tensors).

When the device pool hands out a free block that still carries a prefix-cache hash (an
eviction, :meth:`BlockPool.allocate`), the block's K/V is first copied to a slot of the
host store, keyed by ``(group, chained hash)`` (the chained hash already covers the cache
salt: :func:`~asyncllm.core.block_pool.hash_block`, so tenants never share a slot). A
prefix lookup that misses the device pool and hits the store gets new device blocks and
copies the slots back in (swap in) instead of recomputing them; the blocks then serve as
ordinary cached pool blocks. Like the host tiers of SGLang's HiCache and vLLM's CPU
offloading connector.

The slots are blocks of the CPU :class:`~asyncllm.core.block_pool.BlockPool` that
preemption swaps out to: the store holds at most ``max_blocks`` of them, its own LRU
order decides which one a new block replaces, and it gives up its least recently used
slots whenever a swap out needs room (:meth:`HostPrefixStore.make_room`), so preemption
by offload never loses to the store.

Ordering within one step: the copies the store plans (device -> slot on eviction, slot ->
device on a hit) join the step's ``swap_out`` and ``swap_in`` lists, which the worker runs
before the forward pass (``swap_out`` first), so an evicted block is read before anything
writes it. A slot written or read in the current step is pinned: it is neither reused nor
released until the next step is planned.

A third tier (:class:`DiskTier`, files in ``EngineConfig.prefix_cache_dir``) feeds this one:
a prompt whose next blocks miss both the pool and the store but exist as files has them
read into store slots by the disk tier's thread (:meth:`HostPrefixStore.prefetch`); the
request waits a step or two for them (never for a file that failed to load) and then hits
the store.

Pure Python, integers and bytes only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from asyncllm.core.block_pool import BlockPool, BlockPoolError

Key = tuple[int, bytes]
"""``(layer group, chained block hash)``."""


class DiskTier(Protocol):
    """What the store needs from a disk tier (:mod:`asyncllm.worker.disk_tier`)."""

    def has(self, key: Key) -> bool:
        """Whether a file for ``key`` exists (its content is checked only when read)."""
        ...

    def request_load(self, key: Key, slot: int) -> None:
        """Read ``key``'s file into host ``slot`` in the background."""
        ...

    def completed(self) -> list[tuple[Key, int, bool]]:
        """The loads finished since the last call: ``(key, slot, loaded)``; a slot whose
        file was missing, torn, corrupt or foreign comes back with ``loaded`` False."""
        ...


class HostPrefixStore:
    """Which prefix blocks live in which slot of the host (CPU) block pool, LRU ordered.

    Args:
        pool: the CPU block pool the slots are taken from (shared with preemption swap).
        max_blocks: the most slots the store holds at once (capped at the pool's size).

    Attributes:
        spills: this step's ``(device block, slot)`` copies of evicted blocks.
        loads: this step's ``(slot, device block)`` copies of host hits.
        num_stored: blocks copied into the store so far.
        num_dropped: evicted blocks the store had no slot for (lost, as without it).
        num_loaded: blocks copied back to the device pool (host hits).
        disk: the disk tier behind the store (None: none).
        num_disk_loaded: blocks read from the disk tier into the store.
        num_disk_failed: disk reads that failed (the key is not asked for again).

    Raises:
        ValueError: ``max_blocks`` < 1.
    """

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.pool = pool
        self.max_blocks = min(max_blocks, pool.num_blocks)
        self._slots: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self._keys: dict[int, Key] = {}
        self._pinned: set[int] = set()
        self.spills: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []
        self.num_stored = 0
        self.num_dropped = 0
        self.num_loaded = 0
        self.disk: DiskTier | None = None
        self._pending: dict[Key, int] = {}  # disk reads in flight, into these slots
        self._from_disk: set[int] = set()  # slots read from disk, not yet loaded
        self._failed: set[Key] = set()
        self.num_disk_loaded = 0
        self.num_disk_failed = 0

    def __len__(self) -> int:
        """Slots the store holds (disk reads in flight included)."""
        return len(self._slots) + len(self._pending)

    def lookup(self, block_hash: bytes, group: int = 0) -> int | None:
        """The slot holding ``(group, block_hash)``, or None (changes nothing)."""
        return self._slots.get((group, block_hash))

    def key(self, slot: int) -> Key:
        """The ``(group, hash)`` a held slot stores.

        Raises:
            KeyError: the store does not hold ``slot``.
        """
        return self._keys[slot]

    def spill(self, device_block: int, group: int, block_hash: bytes) -> None:
        """Keep a block the device pool is evicting: plan its copy into a slot (a free one
        of the pool while under ``max_blocks``, else the least recently used unpinned one).
        A key already stored is only marked as recently used; with no slot to take the
        block is dropped."""
        key = (group, block_hash)
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if key in self._pending:
            return  # being read from disk already
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._slots[key] = slot
        self._keys[slot] = key
        self._pinned.add(slot)
        self.spills.append((device_block, slot))
        self.num_stored += 1

    def _take_slot(self) -> int | None:
        if len(self) < self.max_blocks and self.pool.num_free > 0:
            return self.pool.allocate(1)[0]
        for key, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[key]
                del self._keys[slot]
                self._from_disk.discard(slot)
                return slot
        return None

    def pin(self, slot: int) -> None:
        """Keep ``slot`` (a hit about to be loaded) from being reused in this step."""
        self._pinned.add(slot)

    def load(self, slot: int, device_block: int) -> tuple[Key, bool]:
        """Plan the copy of a held slot into ``device_block`` (a host hit); the slot stays
        stored (most recently used) and pinned for the step. Returns its key, and whether
        this is the first load of a block read from the disk tier (a disk hit)."""
        key = self._keys[slot]
        self._slots.move_to_end(key)
        self._pinned.add(slot)
        self.loads.append((slot, device_block))
        self.num_loaded += 1
        from_disk = slot in self._from_disk
        self._from_disk.discard(slot)
        return key, from_disk

    def prefetch(self, keys: list[Key]) -> bool:
        """Have the disk tier read into slots those of ``keys`` (a prompt's next blocks, in
        order) that the store lacks and the disk holds, up to the first that neither holds.
        True while any of them is being read (the request should wait)."""
        disk = self.disk
        waiting = False
        for key in keys:
            if key in self._slots:
                continue
            if key in self._pending:
                waiting = True
                continue
            if key in self._failed or disk is None or not disk.has(key):
                break
            slot = self._take_slot()
            if slot is None:
                break
            self._pending[key] = slot
            disk.request_load(key, slot)
            waiting = True
        return waiting

    def make_room(self, n: int) -> bool:
        """Give least recently used unpinned slots back to the pool until it has ``n``
        free blocks (for a swap out). False, changing nothing, when even all of them would
        not make ``n``."""
        short = n - self.pool.num_free
        if short <= 0:
            return True
        victims = [s for s in self._slots.values() if s not in self._pinned][:short]
        if len(victims) < short:
            return False
        self._drop(victims)
        return True

    def _drop(self, slots: list[int]) -> None:
        for slot in slots:
            del self._slots[self._keys.pop(slot)]
            self._from_disk.discard(slot)
        self.pool.free(slots)

    def new_step(self) -> None:
        """The previous step's copies are done: unpin every slot; take in the disk reads
        that finished (a failed one gives its slot back)."""
        self._pinned.clear()
        if self.disk is None or not self._pending:
            return
        for key, slot, ok in self.disk.completed():
            del self._pending[key]
            if ok and key not in self._slots:
                self._slots[key] = slot
                self._keys[slot] = key
                self._from_disk.add(slot)
                self.num_disk_loaded += 1
                continue
            if not ok:
                self._failed.add(key)
                self.num_disk_failed += 1
            self.pool.free([slot])

    def drain(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Move this step's planned copies into the plan's swap lists."""
        swap_out.extend(self.spills)
        swap_in.extend(self.loads)
        self.spills = []
        self.loads = []

    def clear(self) -> int:
        """Forget every unpinned slot (giving it back to the pool); returns how many."""
        dropped = [s for s in self._slots.values() if s not in self._pinned]
        self._drop(dropped)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless the slot map is a bijection within ``max_blocks``
        and every held slot is a block the pool counts as taken exactly once."""
        if len(self) > self.max_blocks or len(self._keys) != len(self._slots):
            raise BlockPoolError(f"store holds {len(self._slots)} slots, {len(self._keys)} keys")
        for key, slot in self._slots.items():
            if self._keys.get(slot) != key:
                raise BlockPoolError(f"slot {slot}: key not mapped back to it")
        held = [*self._slots.values(), *self._pending.values()]
        if len(set(held)) != len(held) or not self._from_disk <= set(self._keys):
            raise BlockPoolError("a slot held twice, or a disk mark on a slot not held")
        for slot in held:
            if self.pool.ref_count(slot) != 1:
                raise BlockPoolError(f"slot {slot}: ref count {self.pool.ref_count(slot)}")
