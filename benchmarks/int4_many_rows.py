"""The int4 layer's many-row path, old against new, in one process: ``Int4Linear`` at M rows.

Candidates (``--candidates``), each one ``y = x W^T`` of the default model's projection shapes
(out x in: 576x576, 192x576, 1536x576, 576x1536; group 32, activations and scales in
``--dtype``: bfloat16, or float32 as a float32 model's int4 layers run):

* ``old``: the int4 op as built from ``--ref`` (default ``main``; its C++ source is read with
  ``git show`` and built as its own module, op ``asyncllm_old::int4_linear``: see
  ``kernel_at_rev.py``), its many-row path forced (``max_rows=0``); with ``--dtype
  float32`` only a ``--ref`` that has the tile-major float32 scales (``Int4Linear``'s layout
  now) computes the right values;
* ``new``: this checkout's op (``asyncllm::int4_linear``, the installed kernel: after editing
  ``csrc/``, ``python setup.py build_ext --inplace`` first), many-row path forced
  (``max_rows=0``);
* ``int4``: torch's int4 kernel (this checkout's op with ``max_rows`` above any M), for the
  crossover :data:`asyncllm.layers.quant_linear.INT4_KERNEL_MAX_ROWS`;
* ``m<rows>``: the new many-row path with work items of that many rows, through the
  extension's ``int4_mm`` (``m0``: the old way in the new build: the whole weight
  dequantized, then one ``at::mm``), to pick the row tile.

Each candidate cycles through enough distinct weights (>= ``--mib`` MiB of int4 codes per
shape, default 48) that they do not stay in cache, as in a decode step that reads all layers.
Candidates run in a shuffled order inside each repeat (the machine is shared and noisy:
compare ratios within one run); the table gives median microseconds per call and each
candidate's ratio to the first one; a second table the fastest repeat (less sensitive to
other load).

Run (about 10 minutes on 2 cores)::

    PYTHONPATH=. python benchmarks/int4_many_rows.py --threads 2 --repeats 7
    PYTHONPATH=. python benchmarks/int4_many_rows.py --rows 64 512 --candidates old m16 m64 m0
    PYTHONPATH=. python benchmarks/int4_many_rows.py --rows 2 4 8 16 32 --candidates int4 new old
    PYTHONPATH=. python benchmarks/int4_many_rows.py --dtype float32 --rows 64 512 \
        --candidates m0 m64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_at_rev

from asyncllm.kernels import int4_dequant
from asyncllm.layers.quant_linear import Int4Linear

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
GROUP = 32


def old_op(ref: str) -> Callable[..., torch.Tensor]:
    """The int4 op as ``ref`` has it, built as ``asyncllm_old::int4_linear``."""
    kernel_at_rev.old_module("int4", ref, "native")
    return torch.ops.asyncllm_old.int4_linear.default  # type: ignore[no-any-return]


def pack(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int4 weight [n, k] in the layer's layout for ``dtype`` (``Int4Linear``'s:
    float32 scales tile-major): (packed, scales and zeros)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(n, k // GROUP) * 0.01 + 1e-3
    layer = Int4Linear(q, scale, torch.randn(n, k // GROUP) * 0.01, GROUP, None, dtype)
    return layer.packed, layer.scales_and_zeros


def candidate(name: str, n: int, k: int, old: Callable[..., torch.Tensor] | None):  # type: ignore[no-untyped-def]
    """x, packed, sz -> y for candidate ``name``."""
    new = torch.ops.asyncllm.int4_linear.default
    if name == "old":
        assert old is not None
        return lambda x, p, sz: old(x, p, sz, None, GROUP, k, n, 0, 0)
    if name == "new":
        return lambda x, p, sz: new(x, p, sz, None, GROUP, k, n, 0, 0)
    if name == "int4":
        return lambda x, p, sz: new(x, p, sz, None, GROUP, k, n, 1 << 30, 0)
    if name.startswith("m"):
        mm, mt = int4_dequant.kernel().int4_mm, int(name[1:])
        return lambda x, p, sz: mm(x, p, sz, GROUP, n, mt)
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mib", type=int, default=48, help="MiB of int4 codes per shape")
    ap.add_argument("--ref", default="main", help="the git ref whose kernel is 'old'")
    ap.add_argument("--candidates", nargs="+", default=["old", "new"])
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if int4_dequant.kernel() is None:
        raise SystemExit("this checkout's int4 kernel is unavailable")
    old = old_op(args.ref) if "old" in args.candidates else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    med: dict[tuple[tuple[int, ...], int, str], float] = {}
    best: dict[tuple[tuple[int, ...], int, str], float] = {}
    for n, k in shapes:
        weights = [pack(n, k, dtype) for _ in range(max(2, (args.mib << 20) // (n * k // 2)))]
        fns = {c: candidate(c, n, k, old) for c in args.candidates}
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            times: dict[str, list[float]] = {c: [] for c in fns}
            for f in fns.values():  # warm-up: oneDNN primitives, page faults, scratch
                for p, sz in weights:
                    f(x, p, sz)
            for _ in range(args.repeats):
                order = list(fns)
                random.shuffle(order)
                for c in order:
                    t0 = time.perf_counter()
                    for p, sz in weights:
                        fns[c](x, p, sz)
                    times[c].append((time.perf_counter() - t0) / len(weights) * 1e6)
            for c in fns:
                med[((n, k), m, c)] = statistics.median(times[c])
                best[((n, k), m, c)] = min(times[c])
            print(_row(med, (n, k), m, args.candidates), flush=True)
        del weights
    for stat, table in (("median", med), ("fastest", best)):
        print(f"\ntorch {torch.__version__}, {args.threads} threads, {stat} us per call over "
              f"{args.repeats} interleaved repeats (ratio to {args.candidates[0]})\n")  # fmt: skip
        print("| out x in | rows | " + " | ".join(args.candidates) + " |")
        print("|" + "---|" * (2 + len(args.candidates)))
        for n, k in shapes:
            for m in args.rows:
                print(_row(table, (n, k), m, args.candidates))


def _row(med, shape, m, candidates):  # type: ignore[no-untyped-def]
    base = med[(shape, m, candidates[0])]
    cells = [f"{med[(shape, m, c)]:.0f} ({med[(shape, m, c)] / base:.2f})" for c in candidates]
    return f"| {shape[0]}x{shape[1]} | {m} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
