"""The int4 few-row kernel (``csrc/int4_gemv.cpp``) against torch's int4 kernel
(``aten._weight_int4pack_mm_for_cpu``) at decode row counts, through the layer's op.

The default model's fused shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536;
int4 group 32, bfloat16 activations), 30 layers' worth of distinct random weights so that
they come from memory as in a decode step. The two kernels alternate inside each repeat (the
machine is shared and noisy: compare the ratio of one run; ``INT4_GEMV_MAX_ROWS`` picks the
kernel); prints the median milliseconds per pass over the 30 layers and the largest
difference between the two outputs relative to the output's largest value.

Run from the repository root::

    PYTHONPATH=. python benchmarks/int4_gemv.py [--threads 2] [--rows 1 2 3 4] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncllm.layers import quant_linear
from asyncllm.layers.quant_linear import Int4Linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def layer() -> list[Int4Linear]:
    """One decoder layer's projections with random codes, scales and offsets."""
    out = []
    for rows, cols in SHAPES.values():
        q = torch.randint(0, 16, (rows, cols), dtype=torch.int16)
        scale, offset = torch.rand(rows, cols // 32) * 0.01, -torch.rand(rows, cols // 32) * 0.05
        out.append(Int4Linear(q, scale, offset, 32, None, torch.bfloat16))
    return out


def one_pass(layers: list[list[Int4Linear]], xs: dict[int, torch.Tensor], gemv_rows: int) -> float:
    """Seconds for every layer's projections with the few-row kernel up to ``gemv_rows``."""
    quant_linear.INT4_GEMV_MAX_ROWS = gemv_rows
    start = time.perf_counter()
    for projections in layers:
        for lin in projections:
            lin(xs[lin.in_features])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = [layer() for _ in range(args.layers)]
    print(f"threads {args.threads}, {args.layers} layers, ms per pass (median of {args.repeats})")
    print("rows  torch int4  few-row  speedup  max rel diff")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            diff = 0.0
            for lin in layers[0]:
                quant_linear.INT4_GEMV_MAX_ROWS = 0
                ref = lin(xs[lin.in_features]).float()
                quant_linear.INT4_GEMV_MAX_ROWS = m
                got = lin(xs[lin.in_features]).float()
                diff = max(diff, ((got - ref).abs().max() / ref.abs().max()).item())
            times: dict[int, list[float]] = {0: [], m: []}
            for _ in range(args.repeats):
                for gemv_rows in times:
                    times[gemv_rows].append(one_pass(layers, xs, gemv_rows))
            torch_ms, gemv_ms = (statistics.median(times[k]) * 1e3 for k in (0, m))
            speedup = torch_ms / gemv_ms
            print(f"{m:4d}  {torch_ms:10.2f}  {gemv_ms:7.2f}  {speedup:6.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
