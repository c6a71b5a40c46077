"""Microbenchmark of prefill attention on CPU: the torch path against the C++ chunk kernel.

Times one layer's attention call (the K/V already written) of the torch path
(:func:`asyncllm.attention.torch_paged.paged_attention`: per sequence a gather of its
blocks and ``scaled_dot_product_attention``) and of the "cpu" backend
(:func:`asyncllm.attention.cpu_paged.paged_attention_cpu`: the C++ chunk kernel reading
K/V in place) with every chunk in the kernel ("kernel") and as the backend routes them
("routed": long chunks to the torch path, ``cpu_paged.TORCH_MIN_PAIRS``, and prefixes
that chunks share attended together first, ``cpu_paged.MIN_SHARED_PAIRS``), alternating in
this one process (a shared, noisy VM: compare the ratios of one run; medians over the
repeats), at the default model's shapes (H=9 query heads, Hkv=3
KV heads, D=64, block size 16) over scattered block tables, for the step shapes of the
workloads: W1's first step (13 prompts of 40 tokens), W3's prompt (1 x 40), W2 with prefix
caching (32 x 12 new over 528 cached; 17 x 30 over 512, its second step) and without
(1 x 512, then 1 x 28 after 512 cached), around the crossover of ``TORCH_MIN_PAIRS`` (40,
48 and 64 after 512 cached; 128 and 160 new), and a mixed step (8 prefills of 40 and 56
decodes at context 100); cases ending in "s" share their cached context's whole blocks
(prefix caching: W2's steps 17 x 28 after 512 shared tokens and 14 x 14 after 528, and
around ``MIN_SHARED_PAIRS``). Also prints the largest difference between the torch path's
and the kernel's outputs.

Run from the repository root::

    PYTHONPATH=. python benchmarks/prefill_attention.py [--threads 1 2] [--repeats 7]
        [--dtype bfloat16 float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from asyncllm.attention import cpu_paged, torch_paged

H, HKV, D, BS = 9, 3, 64, 16

#: name -> (query_lens, seq_lens[, tokens all of them share from the start])
CASES: dict[str, tuple[list[int], list[int]] | tuple[list[int], list[int], int]] = {
    "13x40": ([40] * 13, [40] * 13),
    "1x40": ([40], [40]),
    "32x12+528": ([12] * 32, [540] * 32),
    "1x512": ([512], [512]),
    "1x28+512": ([28], [540]),
    "1x40+512": ([40], [552]),
    "1x48+512": ([48], [560]),
    "1x64+512": ([64], [576]),
    "1x128": ([128], [128]),
    "1x160": ([160], [160]),
    "17x30+512": ([30] * 17, [542] * 17),  # W2's second step with prefix caching
    "8x40+56dec": ([40] * 8 + [1] * 56, [40] * 8 + [100] * 56),
    "17x28+512s": ([28] * 17, [540] * 17, 512),  # W2's second and third steps
    "14x14+528s": ([14] * 14, [542] * 14, 528),
    "8x12+512s": ([12] * 8, [524] * 8, 512),
    "16x3+512s": ([3] * 16, [515] * 16, 512),
    "32x2+256s": ([2] * 32, [258] * 32, 256),
    "4x16+256s": ([16] * 4, [272] * 4, 256),
}


def step(
    query_lens: list[int],
    seq_lens: list[int],
    shared: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, cpu_paged.CpuPagedPlan]:
    """Random query and caches, scattered block tables (the first ``shared // BS`` blocks the
    same for all), and the step's plan."""
    g = torch.Generator().manual_seed(seed)
    common = shared // BS
    need = [-(-s // BS) - common for s in seq_lens]
    blocks = sum(need) + common + 64
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, k = [], common
    for n in need:
        tables.append(perm[:common] + perm[k : k + n])
        k += n
    kc = torch.randn(blocks, BS, HKV, D, generator=g).to(dtype)
    vc = torch.randn(blocks, BS, HKV, D, generator=g).to(dtype)
    # The model hands the query rows over as a transposed view of [1, H, T, D].
    q = torch.randn(H, sum(query_lens), D, generator=g).to(dtype).transpose(0, 1)
    return q, kc, vc, cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, BS)


def per_call_us(fn: Callable[[], torch.Tensor], iters: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    return (time.perf_counter_ns() - t0) / iters / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    a = ap.parse_args()
    if not cpu_paged.available():
        raise SystemExit(f"the kernel does not build: {cpu_paged.failure()}")
    print(f"repeats={a.repeats} (medians, us per layer call)")
    head = ("dtype", "thr", "case", "torch", "kernel", "ratio", "routed", "ratio", "max|diff|")
    print("{:9} {:>3} {:>11} {:>8} {:>8} {:>6} {:>8} {:>6} {:>9}".format(*head))
    for name in a.dtype:
        dtype = getattr(torch, name)
        for threads in a.threads:
            torch.set_num_threads(threads)
            for case in a.cases:
                q_lens, s_lens, *rest = CASES[case]
                shape = (q_lens, s_lens, rest[0] if rest else 0, dtype)
                q, kc, vc, plan = step(*shape)
                routed = plan
                limits = cpu_paged.TORCH_MIN_PAIRS, cpu_paged.MIN_SHARED_PAIRS
                cpu_paged.TORCH_MIN_PAIRS = cpu_paged.MIN_SHARED_PAIRS = 1 << 62
                try:
                    plan = step(*shape)[3]  # every chunk in the kernel, no cascade
                finally:
                    cpu_paged.TORCH_MIN_PAIRS, cpu_paged.MIN_SHARED_PAIRS = limits
                fns = [
                    partial(torch_paged.paged_attention, q, kc, vc, plan.base, 0.125),
                    partial(cpu_paged.paged_attention_cpu, q, kc, vc, plan, 0.125),
                    partial(cpu_paged.paged_attention_cpu, q, kc, vc, routed, 0.125),
                ]
                diff = (fns[0]().float() - fns[1]().float()).abs().max().item()
                one = max(per_call_us(fn, 2) for fn in fns)
                iters = max(3, int(30_000 / max(one, 1.0)))  # ~30 ms per measurement
                times: list[list[float]] = [[], [], []]
                for r in range(a.repeats):  # alternate, and rotate who goes first
                    for i in range(3):
                        k = (i + r) % 3
                        times[k].append(per_call_us(fns[k], iters))
                t, k, m = (statistics.median(ts) for ts in times)
                print(
                    f"{name:9} {threads:3d} {case:>11} {t:8.0f} {k:8.0f} {t / k:6.2f} "
                    f"{m:8.0f} {t / m:6.2f} {diff:9.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
