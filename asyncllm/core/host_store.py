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

Pure Python, integers and bytes only.
"""

from __future__ import annotations

from collections import OrderedDict

from asyncllm.core.block_pool import BlockPool, BlockPoolError

Key = tuple[int, bytes]
"""``(layer group, chained block hash)``."""


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

    def __len__(self) -> int:
        """Slots the store holds."""
        return len(self._slots)

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
        if len(self._slots) < self.max_blocks and self.pool.num_free > 0:
            return self.pool.allocate(1)[0]
        for key, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[key]
                del self._keys[slot]
                return slot
        return None

    def pin(self, slot: int) -> None:
        """Keep ``slot`` (a hit about to be loaded) from being reused in this step."""
        self._pinned.add(slot)

    def load(self, slot: int, device_block: int) -> Key:
        """Plan the copy of a held slot into ``device_block`` (a host hit); the slot stays
        stored (most recently used) and pinned for the step. Returns its key."""
        key = self._keys[slot]
        self._slots.move_to_end(key)
        self._pinned.add(slot)
        self.loads.append((slot, device_block))
        self.num_loaded += 1
        return key

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
        for slot in victims:
            del self._slots[self._keys.pop(slot)]
        self.pool.free(victims)
        return True

    def new_step(self) -> None:
        """The previous step's copies are done: unpin every slot."""
        self._pinned.clear()

    def drain(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Move this step's planned copies into the plan's swap lists."""
        swap_out.extend(self.spills)
        swap_in.extend(self.loads)
        self.spills = []
        self.loads = []

    def clear(self) -> int:
        """Forget every unpinned slot (giving it back to the pool); returns how many."""
        dropped = [s for s in self._slots.values() if s not in self._pinned]
        for slot in dropped:
            del self._slots[self._keys.pop(slot)]
        self.pool.free(dropped)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless the slot map is a bijection within ``max_blocks``
        and every held slot is a block the pool counts as taken exactly once."""
        if len(self._slots) > self.max_blocks or len(self._keys) != len(self._slots):
            raise BlockPoolError(f"store holds {len(self._slots)} slots, {len(self._keys)} keys")
        for key, slot in self._slots.items():
            if self._keys.get(slot) != key:
                raise BlockPoolError(f"slot {slot}: key not mapped back to it")
            if self.pool.ref_count(slot) != 1:
                raise BlockPoolError(f"slot {slot}: ref count {self.pool.ref_count(slot)}")
