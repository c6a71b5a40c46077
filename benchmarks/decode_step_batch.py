"""Decode step time against batch size on one engine: the floor under a request's TTFT while
others decode (it waits for the rest of the step in flight, then its own step), and the
tokens per second each batch size gives (docs/benchmarks.md, "W8").

For each round and each batch size B (order alternating between rounds): B of W1's prompts
are added and prefilled, then ``--steps`` decode steps are timed (every request computes one
token), then the requests are aborted. Prints, per B, the median decode step in ms and
B / step in tokens per second.

Run from the repository root::

    PYTHONPATH=. python benchmarks/decode_step_batch.py [--batches 1,8,16,32,48,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from asyncllm import EngineConfig, SamplingParams
from asyncllm.bench.workloads import load_prompts
from asyncllm.engine.llm_engine import LLMEngine


def decode_steps(eng: LLMEngine, batch: int, steps: int, tag: str) -> list[float]:
    """Seconds of each of ``steps`` decode steps at ``batch`` running requests."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    prompts = load_prompts()["W1"]["ids"]
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(eng.inputs.make_request(rid, prompts[i % len(prompts)], params))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or (
        eng.scheduler.waiting
    ):
        eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        eng.abort_request(rid)
    eng.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,16,32,48,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    eng = LLMEngine.from_config(EngineConfig(num_threads=args.threads))
    if eng.runner.compiled is not None:  # the steady state, not the compile
        eng.runner.compiled.wait(900)
    times: dict[int, list[float]] = {b: [] for b in batches}
    for r in range(args.rounds):
        for b in batches if r % 2 == 0 else batches[::-1]:
            times[b] += decode_steps(eng, b, args.steps, f"r{r}b{b}")
    out = {
        b: {
            "step_ms": round(1000 * statistics.median(ts), 1),
            "tokens_per_s": round(b / statistics.median(ts), 1),
        }
        for b, ts in times.items()
    }
    print(json.dumps({"settings": vars(args), "compile": eng.stats()["compile"], **out}))
    eng.stop_compute_thread()


if __name__ == "__main__":
    main()
