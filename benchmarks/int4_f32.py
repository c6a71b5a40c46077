"""The int4 layer's float32 paths against torch's bfloat16 int4 kernel: time per call and
error against the exact product (float64), for the default model's layer shapes.

    python benchmarks/int4_f32.py [--threads 1] [--rows 1 2 4 8 16 32]

Paths (``asyncllm::int4_linear``, the C++ kernel): "bf16-torch" (bfloat16 scales and rows,
torch's int4 kernel), "f32-gemv" (float32 scales and rows, ``csrc/int4_gemv_f32.cpp``),
"f32-dequant" (float32: dequantize, then one float32 GEMM). Weights in cache, best of 5
repeats of 5 calls; the quoted figures are in ``asyncllm/layers/quant_linear.py``
(``INT4_F32_MAX_ROWS``) and docs/tuning.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from asyncllm.kernels import native

GROUP = 32
SHAPES = [(1536, 576), (576, 1536), (192, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = ap.parse_args()
    if native.module("int4") is None:
        raise SystemExit(f"the int4 kernel is not installed: {native.failure('int4')}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for n, k in SHAPES:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        s, z = torch.rand(k // GROUP, n) * 0.01, torch.randn(k // GROUP, n) * 0.01
        sz32 = torch.stack([s, z], -1).contiguous()
        sz16 = sz32.bfloat16()
        w = (q - 8).double() * s.T.double().repeat_interleave(GROUP, 1)
        w += z.T.double().repeat_interleave(GROUP, 1)
        for m in args.rows:
            x = torch.randn(m, k)
            exact = x.double() @ w.T
            paths = {  # (scales, max_rows): few-row kernels up to max_rows
                "bf16-torch": (sz16, 64),
                "f32-gemv": (sz32, 64),
                "f32-dequant": (sz32, 0),
            }
            out = []
            for name, (sz, max_rows) in paths.items():

                def call(
                    args: tuple = (x, packed, sz, None, GROUP, k, n, max_rows, 0),
                ) -> torch.Tensor:
                    y: torch.Tensor = torch.ops.asyncllm.int4_linear(*args)
                    return y

                err = ((call().double() - exact).abs().max() / exact.abs().max()).item()
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(5):
                        call()
                    best = min(best, (time.perf_counter() - t) / 5)
                out.append(f"{name}={best * 1e6:.0f}us (err {err:.1e})")
            print(f"{n}x{k} rows {m}: " + "  ".join(out))


if __name__ == "__main__":
    main()
