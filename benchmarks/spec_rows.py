"""Where speculative verification rows stop paying: a step of B decode rows against a step
of B requests with k proposals each (B * (k + 1) rows), on the default model.

Builds an engine (``compile=False``: the eager step; the ratio is what matters), gives B
fake requests a 256-token context each in the KV cache (its contents are irrelevant to the
timing) and times :meth:`ModelRunner.execute` of hand-made plans, alternating plain and
speculative plans of the same B, medians over the repeats. Speculation at batch B pays while
the tokens a verification yields on average exceed the printed ratio.

Run from the repository root::

    PYTHONPATH=. python benchmarks/spec_rows.py [--batches 1 2 4 8 16 32] [--k 4]
        [--repeats 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from asyncllm.config import EngineConfig
from asyncllm.core.plan import ScheduledChunk, SchedulerOutput
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.sampling_params import SamplingParams

CONTEXT = 256


def _plan(engine: LLMEngine, batch: int, k: int) -> SchedulerOutput:
    bm = engine.block_manager
    params = SamplingParams(temperature=0.0)
    chunks = []
    for b in range(batch):
        rid = f"r{b}"
        if not bm.block_tables(rid):
            assert bm.allocate(rid, CONTEXT + 1 + 8)
        proposals = tuple(100 + i for i in range(k))
        chunks.append(
            ScheduledChunk(
                request_id=rid,
                token_ids=[42, *proposals],
                start_pos=CONTEXT,
                block_tables=[list(t) for t in bm.block_tables(rid)],
                sample=True,
                num_output_tokens=0,
                params=params,
                spec_token_ids=proposals,
            )
        )
    return SchedulerOutput(chunks=chunks)


def _time(engine: LLMEngine, plan: SchedulerOutput) -> float:
    t0 = time.perf_counter()
    engine.compute_thread.call(lambda: engine.runner.execute(plan))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    config = EngineConfig(
        compile=False, num_threads=args.threads, max_num_batched_tokens=1024, max_num_seqs=64
    )
    engine = LLMEngine.from_config(config)
    print(f"default model, eager, {args.threads} threads, context {CONTEXT}, k={args.k}")
    print("B    plain ms   spec ms   ratio   (rows: B vs B*(k+1))")
    for batch in args.batches:
        plain, spec = _plan(engine, batch, 0), _plan(engine, batch, args.k)
        for p in (plain, spec):  # warm-up
            _time(engine, p)
        a, b = [], []
        for _ in range(args.repeats):
            a.append(_time(engine, plain))
            b.append(_time(engine, spec))
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"{batch:<4} {ma:9.2f} {mb:9.2f} {mb / ma:7.2f}")
    engine.stop_compute_thread()


if __name__ == "__main__":
    main()
