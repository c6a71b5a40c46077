"""Weight-only quantized linear kernels against float32 and bfloat16 at the decode shapes.

For each of the default model's projection shapes (out x in: 576x576, 192x576, 1536x576,
576x1536 and the 49152x576 LM head) and row counts (1 and 64), times one ``y = x W^T``:

* ``f32-packed``: float32 weight reordered for oneDNN (``PackedLinear``, the float32 engine);
* ``bf16-packed``: bfloat16 weight reordered for oneDNN, bfloat16 activations;
* ``int8-f32`` / ``int8-bf16``: ``aten._weight_int8pack_mm`` (per-output-channel scales);
* ``int4-f32`` / ``int4-bf16``: ``aten._weight_int4pack_mm_for_cpu`` (group 32, scale and
  zero point), float32 or bfloat16 activations;
* ``bf16-plain``: ``F.linear`` on a plain bfloat16 weight (no oneDNN reorder);
* ``dequant-bf16``: only the C++ dequantization of the int4 weight to a bfloat16 ``W^T``
  (:mod:`asyncllm.kernels.int4_dequant`), the many-row path's overhead;
* ``int4dq-bf16``: the many-row path of ``Int4Linear``: that dequantization, then one
  ``torch.mm`` (``--rows 1 2 4 8 16 64`` gives the crossover with ``int4-bf16``).

Each candidate cycles through enough distinct weights (>= 32 MiB of them, at least 2) that
they do not sit in cache, as in a real decode step. Candidates are interleaved in a
shuffled order inside every repeat (the machine is shared and noisy) and the table gives
the median microseconds per call, and each candidate's ratio to ``f32-packed``.

Run: ``python benchmarks/quant_kernels.py --threads 1 2 --repeats 7``; the int4 crossover
(docs/tuning.md): ``python benchmarks/quant_kernels.py --threads 2 --rows 1 2 4 8 16 64
--candidates int4-bf16 int4dq-bf16 dequant-bf16 bf16-packed``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from asyncllm.kernels import int4_dequant, native

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
TARGET_BYTES = 32 << 20


def _int4_pack(w: torch.Tensor, group: int, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1)
    zero = lo + 8 * scale
    sz = torch.stack([scale.T, zero.T], -1).contiguous().to(act)
    return packed, sz


def _int8_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def _int4_kernel():  # type: ignore[no-untyped-def]
    mod = int4_dequant.kernel()
    if mod is None:
        raise SystemExit(f"the int4 kernel is unavailable: {native.failure('int4') or 'off'}")
    return mod


def build(name: str, n: int, k: int, copies: int):  # type: ignore[no-untyped-def]
    """A list of ``copies`` callables x -> y for candidate ``name``, and its activation dtype."""
    fns = []
    act = torch.bfloat16 if "bf16" in name else torch.float32
    for _ in range(copies):
        w = torch.randn(n, k) * 0.05
        if name == "f32-packed":
            p = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            fns.append(
                lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
        elif name == "bf16-packed":
            p = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
            fns.append(
                lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
        elif name.startswith("int8"):
            q, s = _int8_pack(w)
            s = s.to(act)
            fns.append(lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s))
        elif name == "bf16-plain":
            wb = w.bfloat16()
            fns.append(lambda x, wb=wb: torch.nn.functional.linear(x, wb))
        elif name in ("dequant-bf16", "int4dq-bf16"):
            p, sz = _int4_pack(w, 32, act)
            if name == "dequant-bf16":
                wt = torch.empty(k, n, dtype=act)
                kern = _int4_kernel().int4_dequant_t
                fns.append(lambda x, p=p, sz=sz, wt=wt, kern=kern: kern(p, sz, 32, wt))
            else:  # the layer's op, which dequantizes above max_rows rows (0 here)
                _int4_kernel()  # loads the kernel, which registers the op's CPU kernel
                op = torch.ops.asyncllm.int4_linear.default
                fns.append(lambda x, p=p, sz=sz, op=op: op(x, p, sz, None, 32, k, n, 0, 0))
        elif name.startswith("int4"):
            p, sz = _int4_pack(w, 32, act)
            fns.append(
                lambda x, p=p, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)
            )
        else:
            raise ValueError(name)
    return fns, act


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--candidates",
        nargs="+",
        default=["f32-packed", "bf16-packed", "int8-f32", "int8-bf16", "int4-f32", "int4-bf16"],
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    results: dict[tuple[int, int, tuple[int, int], str], list[float]] = {}
    for n, k in SHAPES:
        copies = max(2, TARGET_BYTES // (n * k * 4))
        built = {c: build(c, n, k, copies) for c in args.candidates}
        for threads in args.threads:
            torch.set_num_threads(threads)
            for m in args.rows:
                xs = {dt: torch.randn(m, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
                for fns, act in built.values():  # warm-up: JIT, page faults
                    for f in fns:
                        f(xs[act])
                for _ in range(args.repeats):
                    order = list(built)
                    random.shuffle(order)
                    for c in order:
                        fns, act = built[c]
                        x = xs[act]
                        t0 = time.perf_counter()
                        for f in fns:
                            f(x)
                        dt = (time.perf_counter() - t0) / len(fns)
                        results.setdefault((threads, m, (n, k), c), []).append(dt * 1e6)
                print(_row(results, threads, m, n, k, args.candidates), flush=True)
        del built
    print(
        f"\ntorch {torch.__version__}, median us per call over {args.repeats} interleaved repeats"
    )
    print("(ratio to the first candidate)\n")
    print("| threads | rows | out x in | " + " | ".join(args.candidates) + " |")
    print("|" + "---|" * (3 + len(args.candidates)))
    for threads in args.threads:
        for m in args.rows:
            for n, k in SHAPES:
                print(_row(results, threads, m, n, k, args.candidates))


def _row(results, threads, m, n, k, candidates):  # type: ignore[no-untyped-def]
    med = {c: statistics.median(results[(threads, m, (n, k), c)]) for c in candidates}
    base = med[candidates[0]]
    cells = [f"{med[c]:.0f} ({med[c] / base:.2f})" for c in candidates]
    return f"| {threads} | {m} | {n}x{k} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
