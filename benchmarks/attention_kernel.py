"""Microbenchmark of the C++ paged decode attention kernel: an old source against the new.

Builds the attention kernel's C++ at a git revision (``--old``, default ``main``; see
``kernel_at_rev.py``: ``csrc/paged_attention.cpp``, or before that the source the Python
module held) and takes this checkout's installed module (``asyncllm._kernels._attention_*``,
built by ``setup.py``: after editing ``csrc/``, ``python setup.py build_ext --inplace``
first), then alternates calls of both in this one process (a shared, noisy VM: compare the
ratios of one run, medians over the repeats) at the default model's shapes (H=9 query
heads, Hkv=3 KV heads, D=64, block size 16) over a cache of ~2900 blocks with scattered
block tables. Also prints the largest difference between the two outputs on the same random
inputs (same computation up to summation order).

Run from the repository root::

    PYTHONPATH=. python benchmarks/attention_kernel.py [--old main] [--threads 2]
        [--repeats 7] [--isa native|avx2|avx512_bf16]

``--isa`` picks the instruction-set variant of both (``native``: the one the engine loads
here; ``avx2``: the path of a machine without AVX-512), the old one compiled with that
variant's flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_at_rev

#: (batch, context tokens, tokens of it that all the batch's sequences share from the start):
#: W3, W1 (its chat template's first 32 tokens shared), longer W1 contexts, W2 without and
#: with its 528-token shared system prompt (cascade attention in the new kernel), W7's
#: decode alone and with 4 speculative rows (5 rows of one sequence's positions).
CASES = [(1, 100, 0), (64, 100, 32), (64, 256, 0), (32, 570, 0), (32, 570, 528), (1, 1750, 0),
         (5, 1750, 1744)]  # fmt: skip
H, HKV, D, BS, BLOCKS = 9, 3, 64, 16, 2900


def inputs(batch: int, ctx: int, shared: int, dtype: torch.dtype, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    spread = torch.randint(ctx - 10, ctx + 11, (batch,), generator=g).tolist()
    lens = [ctx] if batch == 1 else spread
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(BLOCKS, generator=g)  # scattered, not contiguous
    m = max(need)
    tables = torch.zeros(batch, m, dtype=torch.long)
    common = shared // BS  # whole blocks: what prefix caching shares
    tables[:, :common] = perm[:common]
    k = common
    for i, n in enumerate(need):
        tables[i, common:n] = perm[k : k + n - common]
        k += n - common
    kc = torch.randn(BLOCKS, BS, HKV, D, generator=g).to(dtype)
    vc = torch.randn(BLOCKS, BS, HKV, D, generator=g).to(dtype)
    # The model hands the query rows over as a transposed view of [1, H, T, D].
    q = torch.randn(H, batch, D, generator=g).to(dtype).transpose(0, 1)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.long)


def per_call_us(mod: Any, args: tuple[Any, ...], out: torch.Tensor, iters: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        mod.paged_decode(*args, 0.125, 0, 0.0, out)
    return (time.perf_counter_ns() - t0) / iters / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="main", help="git revision of the old kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", choices=kernel_at_rev.ISAS, default="native")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = kernel_at_rev.old_module("attention", a.old, a.isa)
    new = kernel_at_rev.new_module("attention", a.isa)
    print(f"old={a.old} new=worktree threads={a.threads} isa={a.isa} repeats={a.repeats}")
    head = ("dtype", "B", "ctx", "shared", "old us", "new us", "ratio", "max|diff|")
    print("{:9} {:>3} {:>4} {:>6} {:>9} {:>9} {:>6} {:>10}".format(*head))
    for dtype in (torch.bfloat16, torch.float32):
        for batch, ctx, shared in CASES:
            q, kc, vc, tables, lens = inputs(batch, ctx, shared, dtype)
            args = (q, kc, vc, tables, lens)
            o_old, o_new = torch.empty(q.shape, dtype=dtype), torch.empty(q.shape, dtype=dtype)
            old.paged_decode(*args, 0.125, 0, 0.0, o_old)
            new.paged_decode(*args, 0.125, 0, 0.0, o_new)
            diff = (o_old.float() - o_new.float()).abs().max().item()
            one = per_call_us(old, args, o_old, 3)
            iters = max(5, int(20_000 / max(one, 1.0)))  # ~20 ms per measurement
            t_old, t_new = [], []
            for r in range(a.repeats):  # alternate, and alternate who goes first
                pair = [(old, o_old, t_old), (new, o_new, t_new)]
                for mod, out, ts in pair if r % 2 == 0 else pair[::-1]:
                    ts.append(per_call_us(mod, args, out, iters))
            mo, mn = statistics.median(t_old), statistics.median(t_new)
            name = str(dtype).removeprefix("torch.")
            print(
                f"{name:9} {batch:3d} {ctx:4d} {shared:6d} {mo:9.1f} {mn:9.1f} {mo / mn:6.2f} "
                f"{diff:10.2e}"
            )


if __name__ == "__main__":
    main()
