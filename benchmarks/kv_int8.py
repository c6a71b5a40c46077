"""The int8 KV cache against the model-dtype cache: how many 2k-token sequences one KV budget
holds, and W1-like decode throughput (64 chat requests at once, 128 tokens each).

Builds one engine per KV layout (``kv_cache_dtype`` "auto" and "int8", the same dtype,
budget and compile setting) in this process, waits for both to be compiled where compile
is on, then alternates W1-like runs between them (a shared, noisy VM: compare the ratio).
Prints each engine's blocks, the sequences of ``--context`` tokens its pool holds at once,
each run's generated tokens per second and the median ratio int8 / auto.

Run from the repository root::

    PYTHONPATH=. python benchmarks/kv_int8.py [--dtype bfloat16] [--rounds 3] [--threads 2]

docs/tuning.md ("int8 KV cache") has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from asyncllm import AsyncEngine, SamplingParams


async def _ready(engine: AsyncEngine) -> None:
    """Wait until the engine's compiled forward is ready (or compile is off or failed)."""
    while engine.stats()["compile"] == "compiling":
        await asyncio.sleep(1.0)


async def _w1(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of all ``prompts`` at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def _prompts(engine: AsyncEngine, n: int) -> list[list[int]]:
    tok = engine.core.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about a robot number {i}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


async def main(a: argparse.Namespace) -> None:
    common: dict[str, Any] = dict(
        dtype=a.dtype, kv_cache_bytes=int(a.kv_gib * 2**30), max_model_len=a.context,
        max_num_seqs=a.requests, compile=a.compile, num_threads=a.threads,
    )  # fmt: skip
    engines = {kv: AsyncEngine.from_pretrained(a.model, kv_cache_dtype=kv, **common)
               for kv in ("auto", "int8")}  # fmt: skip
    for kv, e in engines.items():
        s = e.stats()
        blocks, bs = int(s["num_total_blocks"]), e.core.block_manager.block_size
        print(f"{kv}: {s['kv_layout']}, {s['kv_bytes_per_token']} bytes per token, "
              f"{blocks * bs // a.context} sequences of {a.context} tokens at once")  # fmt: skip
    rates: dict[str, list[float]] = {kv: [] for kv in engines}
    async with engines["auto"], engines["int8"]:
        for e in engines.values():
            await _ready(e)
        prompts = _prompts(engines["auto"], a.requests)
        for e in engines.values():  # warm-up
            await _w1(e, prompts[:8], 8)
        for r in range(a.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for kv in order:
                rates[kv].append(await _w1(engines[kv], prompts, a.max_tokens))
                print(f"round {r} {kv}: {rates[kv][-1]:.1f} tokens/s", flush=True)
    ratios = [q / b for q, b in zip(rates["int8"], rates["auto"], strict=True)]
    print(f"int8 / auto: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compile", default="auto", type=lambda s: {"true": True, "false": False}.get(s.lower(), s)
    )
    asyncio.run(main(p.parse_args()))
