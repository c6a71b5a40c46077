"""KV block copies that ride along with a step: swap out to and in from a CPU block pool.

The CPU pool mirrors the device cache's layout, one K and one V tensor per slot (per layer
without layer groups: :mod:`asyncllm.worker.kv_cache`) of shape
``[num_cpu_blocks, *spec.block_shape]`` (an int8 cache's scales inside its rows), in pinned
memory when the device is CUDA (so copies can overlap) and plain memory otherwise. Each
direction is one gather and one scatter per slot and per K/V for the whole step, never a copy
per block from Python (:func:`~asyncllm.worker.kv_cache.copy_blocks_between`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncllm.worker.kv_cache import KVCache, copy_blocks_between


class CPUOffloadPool:
    """The CPU side of preemption by offload.

    Args:
        kv_cache: the device cache whose blocks are swapped.
        num_blocks: CPU blocks per slot (>= 1).

    Memory is reserved but not touched here: a CPU block is only read after it was written.
    """

    def __init__(self, kv_cache: KVCache, num_blocks: int) -> None:
        spec = kv_cache.spec
        self.kv_cache = kv_cache
        self.num_blocks = num_blocks
        shape = (num_blocks, *spec.block_shape)
        dtype = spec.storage_dtype
        pin = kv_cache.key_slots[0].device.type == "cuda"
        self.key_blocks = [
            torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(spec.num_slots)
        ]
        self.value_blocks = [
            torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(spec.num_slots)
        ]

    def block_tensors(self) -> list[torch.Tensor]:
        """The CPU pool's per-block tensors, matching :meth:`KVCache.block_tensors`."""
        return self.key_blocks + self.value_blocks

    @property
    def num_bytes(self) -> int:
        """Bytes reserved for all CPU blocks."""
        return self.num_blocks * self.kv_cache.spec.bytes_per_block

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Do one step's copies: ``swap_out`` (device block, CPU block) pairs first, then
        ``swap_in`` (CPU block, device block) pairs."""
        device_side = self.kv_cache.block_tensors()
        if swap_out:
            copy_blocks_between(
                device_side,
                self.block_tensors(),
                [d for d, _ in swap_out],
                [c for _, c in swap_out],
            )
        if swap_in:
            copy_blocks_between(
                self.block_tensors(), device_side, [c for c, _ in swap_in], [d for _, d in swap_in]
            )
