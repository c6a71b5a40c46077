"""The int4 layer's float32 paths against torch's bfloat16 int4 kernel: time per call and
error against the exact product (float64), for the default model's layer shapes; and a
decode step's worth of them from memory (``--sweep``).

    python benchmarks/int4_f32.py [--threads 1] [--rows 1 2 4 8 16 32]
    python benchmarks/int4_f32.py --sweep [--threads 2] [--repeats 21]

Paths (``asyncllm::int4_linear``, the C++ kernel, on ``Int4Linear``'s buffers): "bf16-torch"
(bfloat16 scales and rows, torch's int4 kernel), "f32-gemv" (float32 scales and rows,
``csrc/int4_gemv_f32.cpp``), "f32-dequant" (float32: dequantize, then one float32 GEMM).
Weights in cache, best of 5 repeats of 5 calls; the quoted figures are in
``asyncllm/layers/quant_linear.py`` (``INT4_F32_MAX_ROWS``) and docs/tuning.md.

``--sweep``: one row through 30 layers of each of the default model's fused shapes (q/k/v
960x576, o 576x576, gate/up 3072x576, down 576x1536: 106M weights, as a decode step reads
them, too many to stay in cache), float32; prints the median and fastest milliseconds per
sweep. To compare two checkouts, run it under each (``PYTHONPATH=<tree>``) alternately:
the layers are built by that checkout's ``Int4Linear``, so each gets its own layout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncllm.kernels import native
from asyncllm.layers.quant_linear import Int4Linear

GROUP = 32
SHAPES = [(1536, 576), (576, 1536), (192, 576)]
SWEEP_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _layers(
    n: int, k: int, dtypes: tuple[torch.dtype, ...]
) -> tuple[list[Int4Linear], torch.Tensor]:
    """One random int4 weight [n, k] as a layer per dtype, and the weight in float64."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    s, o = torch.rand(n, k // GROUP) * 0.01, torch.randn(n, k // GROUP) * 0.01
    w = q.double() * s.double().repeat_interleave(GROUP, 1) + o.double().repeat_interleave(GROUP, 1)
    return [Int4Linear(q, s, o, GROUP, None, dtype) for dtype in dtypes], w


def _op(layer: Int4Linear, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    args = (layer.packed, layer.scales_and_zeros, None, GROUP)
    sizes = (layer.in_features, layer.out_features, max_rows, 0)
    y: torch.Tensor = torch.ops.asyncllm.int4_linear(x, *args, *sizes)
    return y


def sweep(repeats: int) -> None:
    layers = [_layers(n, k, (torch.float32,))[0][0] for _ in range(30) for n, k in SWEEP_SHAPES]
    xs = [torch.randn(1, layer.in_features) for layer in layers]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for layer, x in zip(layers, xs, strict=True):
            _op(layer, x, 64)
        times.append(time.perf_counter() - t)
    print(
        f"sweep: median {statistics.median(times) * 1e3:.3f} ms, fastest {min(times) * 1e3:.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    if native.module("int4") is None:
        raise SystemExit(f"the int4 kernel is not installed: {native.failure('int4')}")
    torch.set_num_threads(args.threads or (2 if args.sweep else 1))
    torch.manual_seed(0)
    if args.sweep:
        return sweep(args.repeats)
    for n, k in SHAPES:
        (bf16, f32), w = _layers(n, k, (torch.bfloat16, torch.float32))
        for m in args.rows:
            x = torch.randn(m, k)
            exact = x.double() @ w.T
            paths = {  # (layer, max_rows): few-row kernels up to max_rows
                "bf16-torch": (bf16, 64),
                "f32-gemv": (f32, 64),
                "f32-dequant": (f32, 0),
            }
            out = []
            for name, (layer, max_rows) in paths.items():
                err = (
                    (_op(layer, x, max_rows).double() - exact).abs().max() / exact.abs().max()
                ).item()
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(5):
                        _op(layer, x, max_rows)
                    best = min(best, (time.perf_counter() - t) / 5)
                out.append(f"{name}={best * 1e6:.0f}us (err {err:.1e})")
            print(f"{n}x{k} rows {m}: " + "  ".join(out))


if __name__ == "__main__":
    main()
