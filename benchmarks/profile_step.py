"""Profile asyncllm's decode step at a given batch (torch.profiler), and A/B two settings.

    python benchmarks/profile_step.py [--batch 64] [--threads 1] [--steps 10]
    python benchmarks/profile_step.py --ab packed     # oneDNN-packed linears vs plain nn.Linear
    python benchmarks/profile_step.py --ab attention  # the C++ decode attention vs the torch path
    python benchmarks/profile_step.py --ab compile    # EngineConfig.compile=True vs False
    python benchmarks/profile_step.py --ab dtype      # bfloat16 vs float32 (weights and KV)
    python benchmarks/profile_step.py --ab int4rows   # int4 many-row path (dequant + GEMM) vs not

W1's prompts (64 chat-templated "Write a short story about a robot number {i}."), greedy,
128 tokens, on the default model. The prompts are prefilled first; the profile then covers
decode steps only, where every request of the batch computes one token. ``--ab`` builds two
engines on two copies of the model, one with the optimization switched off
(``ASYNCLLM_CPU_PACKED_LINEAR=0``, ``attention_backend="torch"``,
read at each call, so set around each of its steps; for ``int4rows``,
``quant_linear.INT4_KERNEL_MAX_ROWS`` raised past any batch around the "off" steps; or
``compile=False``; the compiled engine is waited for until its compile ended; for ``dtype``,
one in bfloat16 and one in float32), and alternates their steps (the ratio of medians is
robust to other load on the machine). ``--dtype`` sets the engines' dtype (but for ``--ab
dtype``); ``--inductor cpp_wrapper=True`` (repeatable) sets an Inductor option before the
compiled engine compiles.
This is the script behind the step-time notes of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import time

import torch
import torch._inductor.config as inductor_config

from asyncllm import SamplingParams
from asyncllm.bench.workloads import load_prompts
from asyncllm.config import EngineConfig
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.layers import quant_linear


def engine_at_batch(
    batch: int,
    threads: int,
    context: int = 0,
    dtype: str = "auto",
    compile: bool = False,
    quantization: str | None = "auto",
    attention_backend: str = "auto",
) -> LLMEngine:
    """An engine with ``batch`` W1 requests whose prompts are computed and which decoded
    until their contexts hold ``context`` tokens (at least 2 decode steps)."""
    eng = LLMEngine.from_config(
        EngineConfig(
            max_model_len=1024,
            kv_cache_bytes=2**30,
            num_threads=threads,
            dtype=dtype,  # type: ignore[arg-type]
            compile=compile,
            quantization=quantization,  # type: ignore[arg-type]
            attention_backend=attention_backend,  # type: ignore[arg-type]
        )
    )
    compiled = eng.runner.compiled
    if compiled is not None:
        compiled.wait()
        print(f"compiled in {compiled.seconds:.0f} s: {compiled.error or 'ok'}")
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(load_prompts()["W1"]["ids"][:batch]):
        eng.add_request(eng.inputs.make_request(f"r{i}", ids, params))
    while any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.requests.values()
    ):
        eng.step()
    steps = max(2, context - max(len(r.prompt_token_ids) for r in eng.scheduler.running))
    for _ in range(steps):
        eng.step()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=0, help="decode until contexts hold this")
    ap.add_argument(
        "--ab", choices=["packed", "attention", "compile", "dtype", "int4rows"], default=None
    )
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (not with --ab dtype)")
    ap.add_argument("--quantization", default="auto", help="EngineConfig.quantization; none")
    ap.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set torch._inductor.config.KEY (a Python literal) before compiling; repeatable",
    )
    args = ap.parse_args()
    for item in args.inductor:
        key, _, value = item.partition("=")
        setattr(inductor_config, key, ast.literal_eval(value))
    quant = None if args.quantization == "none" else args.quantization
    if args.ab == "dtype":
        engines = {
            name: engine_at_batch(args.batch, args.threads, args.context, dtype, quantization=quant)
            for name, dtype in (("on", "bfloat16"), ("off", "float32"))
        }
    elif args.ab:
        var = {
            "packed": "ASYNCLLM_CPU_PACKED_LINEAR",
            "attention": "ASYNCLLM_UNUSED",  # attention_backend="torch" below
            "compile": "ASYNCLLM_UNUSED",
            "int4rows": "ASYNCLLM_UNUSED",
        }
        engines = {}
        for name, flag in (("on", "1"), ("off", "0")):
            os.environ[var[args.ab]] = flag
            engines[name] = engine_at_batch(
                args.batch,
                args.threads,
                args.context,
                args.dtype,
                compile=args.ab == "compile" and flag == "1",
                quantization=quant,
                attention_backend="torch" if args.ab == "attention" and flag == "0" else "auto",
            )
        os.environ.pop(var[args.ab])
    if args.ab:
        max_rows = quant_linear.INT4_KERNEL_MAX_ROWS
        times: dict[str, list[float]] = {k: [] for k in engines}
        for i in range(2 * args.steps):
            for name in list(engines)[:: 1 if i % 2 else -1]:
                if args.ab == "int4rows":  # read per call: set it per step
                    quant_linear.INT4_KERNEL_MAX_ROWS = max_rows if name == "on" else 1 << 30
                t = time.perf_counter()
                engines[name].step()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"{k}: {v * 1e3:.1f} ms per decode step at batch {args.batch}")
        print(f"{args.ab} on / off: {med['on'] / med['off']:.3f}")
        return
    eng = engine_at_batch(args.batch, args.threads, args.context, args.dtype, quantization=quant)
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step = (time.perf_counter() - t) / args.steps
    print(f"batch {args.batch}, {args.threads} thread(s): {step * 1e3:.1f} ms per decode step")

    def profiled() -> torch.profiler.profile:
        # On the compute thread, where the steps run (the profiler records its own thread).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                eng.step()
        return prof

    prof = eng.compute_thread.call(profiled)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
