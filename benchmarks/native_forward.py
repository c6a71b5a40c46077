"""The C++ forward (``asyncllm/worker/native_forward.py``) against the modeling code's
compiled forward, step for step: hand-made plans of B decode rows, and of B requests with k
speculative proposals each, timed through ``ModelRunner.execute`` with the two paths
alternating in one process (medians over the repeats). Then, at batch 1, the C++ step
beside the same step's linear layers alone (each layer's op called once from Python, in
the engine's compute thread): how much of the step is its weights' kernels.

Run from the repository root (the first run compiles the modeling code's forward, about a
minute on 2 cores)::

    PYTHONPATH=. python benchmarks/native_forward.py [--model default] [--batches 1 4 16 64]
        [--k 4] [--repeats 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from spec_rows import CONTEXT, _plan, _time  # benchmarks/spec_rows.py

from asyncllm.config import EngineConfig
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.worker import native_forward

SWITCH = "ASYNCLLM_NATIVE_FORWARD"


def _engine(args: argparse.Namespace) -> tuple[LLMEngine, Any]:
    """An engine on the modeling code with its forward compiled, and the model's C++ forward."""
    os.environ[SWITCH] = "0"
    try:
        config = EngineConfig(
            model=args.model,
            compile=True,
            num_threads=args.threads,
            max_num_batched_tokens=1024,
            max_num_seqs=64,
        )
        engine = LLMEngine.from_config(config)
    finally:
        del os.environ[SWITCH]
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.wait(900) and compiled.ready, "no compiled forward"
    native = native_forward.build(engine.runner.model)
    assert native is not None, native_forward.unsupported_reason(engine.runner.model)
    return engine, native


def _linears(model: Any) -> list[tuple[Any, torch.Tensor]]:
    """Each layer the C++ forward calls at one row (fused siblings once), with an input."""
    mods: list[Any] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj):
            mods.append(getattr(m, "fused", m))
    mods.append(model.lm_head)
    return [(m, torch.randn(1, m.in_features)) for m in mods]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine, native = _engine(args)
    runner = engine.runner
    print(f"{args.model}, {args.threads} threads, context {CONTEXT}; ms per step, medians")
    print("B    k   rows  compiled   C++     C++/compiled")
    for batch in args.batches:
        for k in (0, args.k):
            plan = _plan(engine, batch, k)
            times: dict[str, list[float]] = {"compiled": [], "native": []}
            for i in range(args.repeats + 1):  # the first round warms up
                for name in times:
                    runner.native = native if name == "native" else None
                    t = _time(engine, plan)
                    if i:
                        times[name].append(t * 1e3)
            a, b = (statistics.median(times[n]) for n in ("compiled", "native"))
            print(f"{batch:<4} {k:<3} {batch * (k + 1):<5} {a:8.2f} {b:8.2f} {b / a:8.2f}")
    runner.native = native
    layers = _linears(runner.model)

    def sweep() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for m, x in layers:
                m(x)
        return time.perf_counter() - t0

    plan = _plan(engine, 1, 0)
    step, lin = [], []
    for _ in range(args.repeats):
        step.append(_time(engine, plan))
        lin.append(engine.compute_thread.call(sweep))
    s, w = statistics.median(step) * 1e3, statistics.median(lin) * 1e3
    print(f"batch 1: C++ step {s:.2f} ms (sampling included), its {len(layers)} linear layers")
    print(f"alone {w:.2f} ms ({w / s:.0%} of the step)")
    engine.stop_compute_thread()


if __name__ == "__main__":
    main()
