"""What the packed linears' row buckets cost: decode steps and a prefill, bucketed vs exact.

    python benchmarks/row_buckets.py [--model default] [--threads 1] [--reps 16]

``asyncllm.layers.cpu_linear`` pads each projection's rows to one of 48 buckets (and cuts
inputs into chunks of 256 rows) so that oneDNN's per-shape primitive caches stay small (see
its module docstring and the soak in docs/benchmarks.md). This script builds one engine and
alternates, step by step, between the buckets and exact row counts (the bucket table swapped
for the identity), so both are measured in the same minutes: median step time of decode at
batch 1, 33, 50 and 64 (60-token prompts), and of a 511-token prefill (distinct prompts, so
the prefix cache never serves one). Prints the bucketed/exact ratio of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

from asyncllm import EngineConfig, SamplingParams
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.layers import cpu_linear

_BUCKETED = list(cpu_linear._BUCKETS)
_CHUNK = cpu_linear.CHUNK_ROWS


def use_buckets(on: bool) -> None:
    """Switch the packed linears between bucketed and exact row counts."""
    cpu_linear._BUCKETS[:] = _BUCKETED if on else range(4096)
    cpu_linear.CHUNK_ROWS = _CHUNK if on else 4095


def timed_step(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def decode(engine: LLMEngine, batch: int, reps: int) -> dict[bool, float]:
    params = SamplingParams(max_tokens=4 * reps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = list(range(100 + 61 * i, 160 + 61 * i))
        engine.add_request(engine.inputs.make_request(f"d{batch}-{i}", prompt, params))
    sched = engine.scheduler
    while sched.num_waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running
    ):
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(reps):
        for on in (k % 2 == 0, k % 2 == 1):
            use_buckets(on)
            times[on].append(timed_step(engine))
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    use_buckets(True)
    return {on: statistics.median(v) for on, v in times.items()}


def prefill(engine: LLMEngine, reps: int) -> dict[bool, float]:
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(reps):
        for on in (True, False) if k % 2 == 0 else (False, True):
            use_buckets(on)
            prompt = [(7 * j + 13 * k + 5000 * on) % 40000 + 100 for j in range(512)]
            one = SamplingParams(max_tokens=1)
            engine.add_request(engine.inputs.make_request(f"p{k}{on}", prompt, one))
            times[on].append(timed_step(engine))
            while engine.has_unfinished():
                engine.step()
    use_buckets(True)
    return {on: statistics.median(v) for on, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=16)
    args = ap.parse_args()
    engine = LLMEngine.from_config(
        EngineConfig(model=args.model, max_num_batched_tokens=512, num_threads=args.threads)
    )
    rows = [(f"decode batch {b}", decode(engine, b, args.reps)) for b in (1, 33, 50, 64)]
    rows.append(("prefill 511 tokens", prefill(engine, max(2, args.reps // 3))))
    for name, t in rows:
        print(
            f"{name}: bucketed {t[True] * 1e3:.1f} ms, exact {t[False] * 1e3:.1f} ms, "
            f"ratio {t[True] / t[False]:.3f}"
        )


if __name__ == "__main__":
    main()
