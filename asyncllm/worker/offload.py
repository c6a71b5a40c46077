"""KV block copies that ride along with a step: swap out to and in from a CPU block pool.

The CPU pool mirrors the device cache's layout, one K and one V tensor per slot (per layer
without layer groups: :mod:`asyncllm.worker.kv_cache`) of shape
``[num_cpu_blocks, block_size, num_kv_heads, head_dim]``, in pinned memory when the device is
CUDA (so copies can overlap) and plain memory otherwise. Each direction is one gather and one
scatter per slot and per K/V for the whole step, never a copy per block from Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncllm.worker.kv_cache import KVCache


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
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        pin = kv_cache.key_slots[0].device.type == "cuda"
        self.key_blocks = [
            torch.empty(shape, dtype=spec.dtype, pin_memory=pin) for _ in range(spec.num_slots)
        ]
        self.value_blocks = [
            torch.empty(shape, dtype=spec.dtype, pin_memory=pin) for _ in range(spec.num_slots)
        ]

    @property
    def num_bytes(self) -> int:
        """Bytes reserved for all CPU blocks."""
        return self.num_blocks * self.kv_cache.spec.bytes_per_block

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Do one step's copies: ``swap_out`` (device block, CPU block) pairs first, then
        ``swap_in`` (CPU block, device block) pairs."""
        device = self.kv_cache.key_slots[0].device
        if swap_out:
            dev = _ids([d for d, _ in swap_out], device)
            cpu = _ids([c for _, c in swap_out], torch.device("cpu"))
            for src, dst in zip(
                self.kv_cache.key_slots + self.kv_cache.value_slots,
                self.key_blocks + self.value_blocks,
                strict=True,
            ):
                dst.index_copy_(0, cpu, src.index_select(0, dev).to("cpu"))
        if swap_in:
            cpu = _ids([c for c, _ in swap_in], torch.device("cpu"))
            dev = _ids([d for _, d in swap_in], device)
            for src, dst in zip(
                self.key_blocks + self.value_blocks,
                self.kv_cache.key_slots + self.kv_cache.value_slots,
                strict=True,
            ):
                moved = src.index_select(0, cpu).to(dst.device, non_blocking=True)
                dst.index_copy_(0, dev, moved)


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
