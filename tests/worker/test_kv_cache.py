"""The KV cache's host memory: zero-filled, committed page by page as blocks are written."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from asyncllm.worker.kv_cache import KVCache, KVCacheSpec, zeros_on_demand


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``' pages in memory, by ``mincore(2)``: the tensors' own pages, not
    the process's RSS, which other tests' freed memory (same xdist worker) moved by -226 MB
    in one CI run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    total = 0
    for t in tensors:
        lo = t.data_ptr() // page * page
        n = -(-(t.data_ptr() + t.numel() * t.element_size() - lo) // page)
        vec = ctypes.create_string_buffer(n)
        if libc.mincore(lo, n * page, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        total += sum(b & 1 for b in vec.raw) * page
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_demand_is_a_writable_zero_tensor(dtype):
    t = zeros_on_demand((3, 16, 2, 8), dtype, torch.device("cpu"))
    assert t.shape == (3, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[1, 3] = 2.5
    assert float(t.sum()) == 2.5 * 16


@pytest.mark.skipif(sys.platform != "linux", reason="calls mincore(2)")
def test_an_unused_kv_cache_takes_no_resident_memory():
    """A 512 MiB cache adds next to nothing to the resident set until blocks are written;
    writing a quarter of one layer's blocks commits about that much (huge pages aside)."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                       block_size=16)  # fmt: skip
    num_blocks = (512 << 20) // spec.bytes_per_block
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    pool = cache.key_slots + cache.value_slots
    assert cache.num_bytes >= 500 << 20
    assert _resident_bytes(pool) < 32 << 20
    layer = cache.key_caches[0]
    layer[: num_blocks // 4].fill_(1.0)
    grown = _resident_bytes(pool)
    quarter = layer.numel() * layer.element_size() // 4
    assert quarter <= grown < quarter + (32 << 20)
    assert torch.count_nonzero(cache.value_caches[-1]) == 0


def _mapped_kib(lo: int, hi: int, field: str) -> int:
    """``field`` summed over the /proc/self/smaps entries that overlap ``[lo, hi)``. The kernel
    may split one mapping into several entries, or merge it with an adjacent private anonymous
    mapping into one entry that reaches past the range (then the sum counts that neighbour's
    pages too)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < b
            elif inside and head == field + ":":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_the_kv_cache_is_private_memory_not_shmem():
    """The pool was a shared anonymous mapping (mmap's default): shmem, not anonymous memory,
    and shared with a forked child. Its written pages are now private anonymous memory (CI
    saw the mapping merged with a neighbour: the entries overlapping it are counted)."""
    t = zeros_on_demand((512, 16, 2, 512), torch.float32, torch.device("cpu"))  # 32 MiB
    t.fill_(1.0)
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    assert _mapped_kib(lo, hi, "Anonymous") >= 32 << 10


def test_kv_budget_the_host_cannot_reserve_is_a_value_error(tiny_llama_dir, make_engine):
    """A budget past the address space (1 PiB; 2**60 bytes for the bare helper) raised the
    mapping's bare ``OSError`` (ENOMEM); now a ValueError naming ``kv_cache_bytes``, raised
    while the engine is built."""
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        zeros_on_demand((2**28, 2**30), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cannot reserve .*kv_cache_bytes"):
        make_engine(tiny_llama_dir, quantization=None, kv_cache_bytes=2**50)
