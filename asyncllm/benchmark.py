"""The standard workloads of ../shared/bench/WORKLOADS.md, run against asyncllm.

    python -m asyncllm.benchmark W2 [W5 ...] [--repeats 3] [--prompts PATH]

Each workload is timed from the first submission to the last token received by its
streaming consumers, after one uncounted warm-up run; figures are medians over the repeats,
with the settings they were measured under. Prompts come from ``prompts.json`` (the exact
token ids the peers' figures were measured with).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncllm import AsyncEngine, SamplingParams


def find_prompts(path: str | None) -> dict[str, Any]:
    """Load prompts.json: ``path``, else ../shared/bench/prompts.json from here or the repo.

    Raises:
        FileNotFoundError: no prompts.json found.
    """
    here = pathlib.Path(__file__).resolve().parent.parent
    candidates = [pathlib.Path(path)] if path else [
        pathlib.Path.cwd() / "../shared/bench/prompts.json",
        here / "../shared/bench/prompts.json",
    ]  # fmt: skip
    for c in candidates:
        if c.is_file():
            return json.loads(c.read_text())  # type: ignore[no-any-return]
    raise FileNotFoundError(f"prompts.json not found in {[str(c) for c in candidates]}")


@dataclass
class RunResult:
    """One timed run of one workload."""

    wall_s: float
    generated_tokens: int
    ttft_s: list[float]
    outputs: list[list[int]]
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second."""
        return self.generated_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float:
        """Mean time to first token (seconds)."""
        return statistics.fmean(self.ttft_s)


async def run_batch(
    engine: AsyncEngine, prompts: Sequence[Sequence[int]], new_tokens: int
) -> RunResult:
    """Submit all prompts at once, stream them all; greedy, exactly ``new_tokens`` each."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()

    async def one(p: Sequence[int]) -> tuple[float, list[int]]:
        first = None
        ids: list[int] = []
        async for out in engine.stream(list(p), params):
            if first is None:
                first = time.perf_counter() - start
            ids.extend(out.token_ids)
        assert first is not None
        return first, ids

    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    outputs = [ids for _, ids in results]
    return RunResult(wall, sum(map(len, outputs)), [t for t, _ in results], outputs)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    """Cores, processor and torch threads, for every figure."""
    import torch

    return (
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads"
    )


def settings(engine: AsyncEngine) -> str:
    """The engine settings a figure was measured under."""
    c = engine.config
    core = engine._engine
    return (
        f"dtype {core.kv_cache.spec.dtype}, block_size {c.block_size}, max_num_seqs "
        f"{c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, KV blocks "
        f"{core.block_manager.num_total_blocks}, prefix caching {c.enable_prefix_caching}, "
        f"preemption {c.preemption_mode}"
    )


async def _timed_runs(engine: AsyncEngine, prompts: Any, new: int, repeats: int) -> list[RunResult]:
    runs = []
    async with engine:
        await run_batch(engine, prompts, new)  # warm-up, not counted
        for _ in range(repeats):
            engine.reset_prefix_cache()
            before = engine.stats()
            r = await run_batch(engine, prompts, new)
            after = engine.stats()
            r.stats = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
            runs.append(r)
    return runs


def w2(data: dict[str, Any], repeats: int) -> None:
    """W2, shared system prompt: prefix caching on vs off, alternating in one process."""
    w = data["W2"]
    prompts, new = w["ids"], w["new"]
    kw = dict(max_num_seqs=64, max_model_len=1024, kv_cache_bytes=1536 * 2**20)
    engines = {
        "on": AsyncEngine.from_pretrained("default", enable_prefix_caching=True, **kw),
        "off": AsyncEngine.from_pretrained("default", enable_prefix_caching=False, **kw),
    }
    runs: dict[str, list[RunResult]] = {"on": [], "off": []}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name] += asyncio.run(_timed_runs(engine, prompts, new, 1))
    print(f"W2 ({len(prompts)} requests, {w['common_prefix_tokens']} shared prompt tokens, "
          f"{new} new tokens); {machine()}")  # fmt: skip
    for name, rs in runs.items():
        hits = _median([r.stats["prefix_cache_hits"] for r in rs])
        queries = _median([r.stats["prefix_cache_queries"] for r in rs])
        shared = len(prompts) * w["common_prefix_tokens"]
        print(
            f"  caching {name:3s}: wall {_median([r.wall_s for r in rs]):.2f} s, mean TTFT "
            f"{_median([r.mean_ttft_s for r in rs]):.3f} s, hit rate {hits / queries:.1%} of "
            f"prompt tokens, {hits / shared:.1%} of shared-prefix tokens from cache"
        )
        print(f"    {settings(engines[name])}")
    on, off = runs["on"], runs["off"]
    print(f"  TTFT off/on: {_median([r.mean_ttft_s for r in off]) / _median([r.mean_ttft_s for r in on]):.1f}x; "  # noqa: E501
          f"outputs equal: {on[0].outputs == off[0].outputs}")  # fmt: skip


def w1_w5(data: dict[str, Any], repeats: int) -> None:
    """W1 (offline throughput) and W5 (W1 with a KV cache for 25% of its peak), alternating."""
    w = data["W1"]
    prompts, new = w["ids"], w["new"]
    peak_tokens = sum(len(p) + new for p in prompts)
    probe = AsyncEngine.from_pretrained("default", max_num_seqs=64, max_model_len=1024)
    per_token = probe._engine.kv_cache.spec.bytes_per_token
    del probe
    engines = {
        "W1": AsyncEngine.from_pretrained(
            "default", max_num_seqs=64, max_model_len=1024,
            kv_cache_bytes=int(peak_tokens * per_token * 1.1),
        ),
        "W5": AsyncEngine.from_pretrained(
            "default", max_num_seqs=64, max_model_len=1024,
            kv_cache_bytes=max(int(peak_tokens * per_token * 0.25), 1024 * per_token),
        ),
    }  # fmt: skip
    runs: dict[str, list[RunResult]] = {"W1": [], "W5": []}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name] += asyncio.run(_timed_runs(engine, prompts, new, 1))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"W1/W5 ({len(prompts)} requests, {new} new tokens, peak {peak_tokens} tokens); "
          f"{machine()}; peak RSS {rss:.0f} MiB")  # fmt: skip
    for name, rs in runs.items():
        s = rs[-1].stats
        print(
            f"  {name}: {_median([r.tokens_per_s for r in rs]):.1f} tokens/s, wall "
            f"{_median([r.wall_s for r in rs]):.1f} s, preemptions {s['num_preemptions']}, "
            f"blocks swapped out {s['num_swapped_out_blocks']} / in {s['num_swapped_in_blocks']}"
            f", recomputed tokens {s['num_recomputed_tokens']}"
        )
        print(f"    {settings(engines[name])}")
    print(f"  W5 outputs equal W1's: {runs['W5'][0].outputs == runs['W1'][0].outputs}")


WORKLOADS = {"W2": w2, "W1W5": w1_w5}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the named workloads and print their figures."""
    ap = argparse.ArgumentParser(prog="python -m asyncllm.benchmark")
    ap.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default=None, help="path of prompts.json")
    args = ap.parse_args(argv)
    data = find_prompts(args.prompts)
    for name in args.workloads:
        WORKLOADS[name](data, args.repeats)


if __name__ == "__main__":
    main()
