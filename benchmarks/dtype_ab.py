"""float32 against bfloat16 on this CPU: the default model's projections (oneDNN-packed, as
the engine runs them) and the C++ decode attention, at decode batches 1 and 64.

    python benchmarks/dtype_ab.py [--threads 1] [--repeats 21]

Each case holds 30 distinct weights (one per layer, as a decode step reads them: they do not
fit in cache), and the two dtypes alternate call by call; the table gives the median
microseconds per call and the float32 / bfloat16 ratio. The numbers behind docs/tuning.md's
"bfloat16 on CPU" table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from asyncllm.attention import cpu_paged
from asyncllm.layers.cpu_linear import PackedLinear
from asyncllm.worker.device import cpu_bf16_reason

#: The default model's (SmolLM2-135M) projections: name, out, in, copies per step.
SHAPES = [
    ("q/o_proj", 576, 576, 30),
    ("k/v_proj", 192, 576, 30),
    ("gate/up_proj", 1536, 576, 30),
    ("down_proj", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
]


def linear_case(out_f: int, in_f: int, copies: int, rows: int, dtype: torch.dtype) -> Callable:
    layers = [PackedLinear(nn.Linear(in_f, out_f, bias=False).to(dtype)) for _ in range(copies)]
    x = torch.randn(rows, in_f).to(dtype)
    it = iter(range(1 << 62))
    return lambda: layers[next(it) % copies](x)


def attention_case(batch: int, context: int, dtype: torch.dtype) -> Callable:
    bs, hkv, heads, dim, layers = 16, 3, 9, 64, 30
    per = -(-context // bs)
    caches = [(torch.randn(batch * per, bs, hkv, dim).to(dtype),) * 2 for _ in range(layers)]
    tables = torch.arange(batch * per).view(batch, per)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, dim).to(dtype)
    it = iter(range(1 << 62))

    def run() -> torch.Tensor:
        k, v = caches[next(it) % layers]
        return cpu_paged.decode_attention(q, k, v, tables, lens, 0.125)

    return run


def ab(make: Callable[[torch.dtype], Callable], calls: int, repeats: int) -> tuple[float, float]:
    fns = {dt: make(dt) for dt in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for r in range(repeats):
            for dt in list(fns)[:: 1 if r % 2 else -1]:
                t = time.perf_counter()
                for _ in range(calls):
                    fns[dt]()
                times[dt].append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bfloat16 native: {cpu_bf16_reason()}; {args.threads} thread(s)")
    print("| case | rows | float32 us | bfloat16 us | float32 / bfloat16 |")
    print("| --- | --- | --- | --- | --- |")
    for name, out_f, in_f, copies in SHAPES:
        for rows in (1, 64):
            f, b = ab(
                lambda dt, o=out_f, i=in_f, c=copies, r=rows: linear_case(o, i, c, r, dt),
                calls=max(copies, 3),
                repeats=args.repeats,
            )
            print(f"| {name} {out_f}x{in_f} | {rows} | {f:.0f} | {b:.0f} | {f / b:.2f} |")
    if cpu_paged.available():
        for batch in (1, 64):
            f, b = ab(lambda dt, n=batch: attention_case(n, 128, dt), 30, args.repeats)
            print(f"| decode attention, 128-token contexts | {batch} | {f:.0f} | {b:.0f} | "
                  f"{f / b:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
