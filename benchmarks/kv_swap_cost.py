"""What a host-tier hit's swap in costs next to the step that carries it: the question
whether to overlap the copy with the forward (issue 39; docs/tuning.md, "The prefix cache's
host and disk tiers").

On one engine of ``--model`` (its default precision and KV dtype, the compiled forward when
``--compile`` resolves to it), measures:

* the swap in alone (``CPUOffloadPool.swap``: one gather and one scatter per K/V tensor for
  all blocks, host pool -> device pool, both sides' pages touched before) of ``n`` blocks,
  median of ``--reps``;
* W2 (``prompts.json``: 32 prompts sharing 528 tokens, all at once, 32 greedy tokens each)
  stepped by the engine itself, with prefix caching: the steps' wall (the first one,
  mostly prefill, and the decode steps at 32 sequences) and what recomputing one block of
  16 prompt tokens costs (the first prompt's 512-token chunk, per block).

Run from the repository root::

    PYTHONPATH=. python benchmarks/kv_swap_cost.py [--model default] [--threads 2]
        [--compile auto|true|false] [--reps 20]

Prints one line per block count, then the step times.
"""

from __future__ import annotations

import argparse
import statistics
import time

from asyncllm import EngineConfig, SamplingParams
from asyncllm.bench.asyncllm_engine import wait_for_compile
from asyncllm.bench.workloads import load_prompts
from asyncllm.core.plan import SchedulerOutput
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.worker.step_timing import StepTimings


def swap_in_seconds(engine: LLMEngine, n: int, reps: int) -> float:
    """Median seconds of one swap in of ``n`` blocks (host blocks 0..n-1 to device blocks
    0..n-1 of an idle engine: the blocks are free and hold no prefix)."""
    off = engine.offload
    if off is None:
        raise SystemExit("the engine has no CPU offload pool")
    pairs = [(i, i) for i in range(n)]
    off.swap(pairs, [])  # touch both sides' pages first
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        engine.compute_thread.call(lambda: off.swap([], pairs))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def w2_steps(engine: LLMEngine) -> list[tuple[int, float]]:
    """``(tokens, seconds)`` of every step of W2 on ``engine``."""
    data = load_prompts()["W2"]
    params = SamplingParams(max_tokens=int(data["new"]), temperature=0.0, ignore_eos=True)
    steps: list[tuple[int, float]] = []

    def observe(timings: StepTimings, plan: SchedulerOutput) -> None:
        steps.append((plan.num_batched_tokens, timings.end - timings.start))

    engine.step_observer = observe
    for i, prompt in enumerate(data["ids"]):
        for r in engine.inputs.make_requests(f"w2-{i}", prompt, params):
            engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    engine.step_observer = None
    return steps


def main(a: argparse.Namespace) -> None:
    config = EngineConfig(model=a.model, max_model_len=1024, num_threads=a.threads,
                          compile=a.compile)  # fmt: skip
    engine = LLMEngine.from_config(config)
    wait_for_compile(engine)
    s = engine.stats()
    spec = engine.kv_cache.spec
    print(f"model {a.model}: {s['precision']}, KV {spec.kv_dtype_name}, "
          f"{spec.bytes_per_block} bytes per block of {engine.config.block_size}, "
          f"compile {s['compile']}")  # fmt: skip
    for n in (1, 4, 16, 33, 64):
        sec = swap_in_seconds(engine, n, a.reps)
        print(f"swap in {n:3d} blocks: {sec * 1e3:7.2f} ms ({sec / n * 1e6:6.0f} us per block, "
              f"{n * spec.bytes_per_block / sec / 1e9:5.2f} GB/s)")  # fmt: skip
    w2_steps(engine)  # warm-up
    engine.reset_prefix_cache()
    steps = w2_steps(engine)
    first_tokens, first_s = steps[0]
    decodes = [sec for tok, sec in steps if tok == 32]
    print(f"W2 first step: {first_tokens} tokens in {first_s * 1e3:.0f} ms "
          f"({first_s / (first_tokens / engine.config.block_size) * 1e3:.1f} ms per block "
          f"of prompt tokens computed); decode steps at 32 sequences: median "
          f"{statistics.median(decodes) * 1e3:.0f} ms ({len(decodes)} steps)")  # fmt: skip
    engine.stop_compute_thread()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--compile", default="auto", type=lambda s: {"true": True, "false": False}.get(s.lower(), s)
    )
    main(p.parse_args())
