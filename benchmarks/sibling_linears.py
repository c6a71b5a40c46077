"""Sibling linears fused or separate: a decoder layer's q/k/v and gate/up projections as 5
int4 calls or as 2 (:mod:`asyncllm.layers.sibling_linears`), at decode row counts.

The default model's shapes (q 576x576, k/v 192x576, gate/up 1536x576; int4 group 32,
bfloat16 activations), 30 layers' worth of distinct random weights so that they come from
memory as in a decode step. Separate and fused alternate inside each repeat (the machine is
shared and noisy: compare the ratio of one run); prints the median milliseconds per 30
layers and the largest difference between the two outputs (0: each output column is the
same dot product).

Run from the repository root::

    PYTHONPATH=. python benchmarks/sibling_linears.py [--threads 2] [--rows 1 64] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncllm.layers.quant_linear import Int4Linear

SHAPES = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "gate": (1536, 576), "up": (1536, 576)}
GROUPS = (("q", "k", "v"), ("gate", "up"))


def layer() -> tuple[dict[str, Int4Linear], list[Int4Linear]]:
    """One layer's separate projections and the fused ones over the same codes."""
    codes = {}
    for name, (out, cols) in SHAPES.items():
        q = torch.randint(0, 16, (out, cols), dtype=torch.int16)
        scale, offset = torch.rand(out, cols // 32) * 0.01, -torch.rand(out, cols // 32) * 0.05
        codes[name] = (q, scale, offset)
    separate = {n: Int4Linear(*c, 32, None, torch.bfloat16) for n, c in codes.items()}
    fused = [Int4Linear.concat([separate[n] for n in group]) for group in GROUPS]
    assert all(f is not None for f in fused)
    return separate, fused  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = [layer() for _ in range(args.layers)]
    with torch.inference_mode():
        for m in args.rows:
            x = torch.randn(m, 576).bfloat16()
            sep, fused = layers[0]
            ref = torch.cat([sep[n](x) for group in GROUPS for n in group], -1)
            diff = (torch.cat([f(x) for f in fused], -1).float() - ref.float()).abs().max()
            times: dict[str, list[float]] = {"separate": [], "fused": []}
            for _ in range(args.repeats):
                t = time.perf_counter()
                for sep, _ in layers:
                    for lin in sep.values():
                        lin(x)
                times["separate"].append(time.perf_counter() - t)
                t = time.perf_counter()
                for _, fused in layers:
                    for lin in fused:
                        lin(x)
                times["fused"].append(time.perf_counter() - t)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("separate", "fused"))
            print(
                f"rows {m:3d}: separate {a:6.2f} ms, fused {b:6.2f} ms per {args.layers} "
                f"layers ({a / b:.2f}x); max |diff| {diff.item():.3g}"
            )


if __name__ == "__main__":
    main()
