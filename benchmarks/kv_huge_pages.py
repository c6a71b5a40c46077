"""Decode attention over a whole model's KV cache in 4 KiB pages against 2 MiB (transparent
huge) pages: does ``MADV_HUGEPAGE`` on the KV pool pay?

Allocates 30 layers' K and V (the default model's shapes, ``attention_kernel.BLOCKS``
blocks each, bfloat16) three times: a shared anonymous mapping (mmap's default; shmem), a
private one, and a private one advised ``MADV_HUGEPAGE``; writes every page first (steady
state), then times the C++ decode kernel over all 30 layers with scattered block tables,
alternating the three in this one process (a shared, noisy VM: compare the ratios).

Run from the repository root::

    PYTHONPATH=. python benchmarks/kv_huge_pages.py [--threads 2] [--repeats 9]

docs/tuning.md ("KV cache size") has the figures and the decision.
"""

from __future__ import annotations

import argparse
import mmap
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_kernel as ak
import kernel_at_rev

LAYERS = 30
CASES = [(64, 106, 32), (32, 600, 528), (1, 300, 0)]  # W1-, W2- and W3-like decode steps


def mapping(flags: int, huge: bool, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, n, flags=flags)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype).view(shape)
    t.copy_(torch.randn(shape).to(dtype))  # every page written: the steady state
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = kernel_at_rev.new_module("attention", "native")  # the installed kernel
    dtype, shape = torch.bfloat16, (ak.BLOCKS, ak.BS, ak.HKV, ak.D)
    anon = mmap.MAP_ANONYMOUS
    kinds = {
        "shared 4K": (mmap.MAP_SHARED | anon, False),
        "private 4K": (mmap.MAP_PRIVATE | anon, False),
        "private THP": (mmap.MAP_PRIVATE | anon, True),
    }
    caches = {
        k: [(mapping(f, h, shape, dtype), mapping(f, h, shape, dtype)) for _ in range(LAYERS)]
        for k, (f, h) in kinds.items()
    }
    rollup = Path("/proc/self/smaps_rollup").read_text()
    huge = re.search(r"AnonHugePages:\s+(\d+ kB)", rollup)
    print("AnonHugePages:", huge.group(1) if huge else "?")
    print(f"ms per {LAYERS} layers (median of {a.repeats}), threads={a.threads}")
    for batch, ctx, shared in CASES:
        q, _, _, tables, lens = ak.inputs(batch, ctx, shared, dtype)
        out = torch.empty(q.shape, dtype=dtype)

        times: dict[str, list[float]] = {k: [] for k in caches}
        for r in range(a.repeats):
            for k in list(caches) if r % 2 else list(caches)[::-1]:
                t0 = time.perf_counter()
                for _ in range(5):
                    for kc, vc in caches[k]:
                        mod.paged_decode(q, kc, vc, tables, lens, 0.125, 0, 0.0, out)
                times[k].append((time.perf_counter() - t0) / 5 * 1e3)
        cells = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in times.items())
        print(f"batch {batch:2d}, context {ctx}, shared {shared}: {cells}")


if __name__ == "__main__":
    main()
