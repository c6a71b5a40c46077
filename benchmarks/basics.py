"""Basic figures on the default model: load time, one stream, 16 concurrent streams.

    python benchmarks/basics.py [--threads 1 2] [--repeats 3]

Prompts are W1's (../shared/bench/WORKLOADS.md): the chat-templated user message
"Write a short story about a robot number {i}.", 128 new tokens, greedy, ignore EOS.
For each torch thread count, in alternation, it reports single-stream TTFT and decode
tokens/s and the total generated tokens/s of 16 concurrent streams (medians over repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import torch

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.__main__ import run_async

PARAMS = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about a robot number {i}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


async def single(engine: AsyncEngine, prompt: list[int]) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    n = 0
    async for out in engine.stream(prompt, PARAMS):
        if first is None:
            first = time.perf_counter()
        n = out.num_generated_tokens
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


async def concurrent(engine: AsyncEngine, ps: list[list[int]]) -> float:
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, PARAMS) for p in ps))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def load_times() -> tuple[float, float]:
    """(first load in a fresh process, second load in a fresh process), seconds."""
    code = (
        "import time; t=time.perf_counter(); from asyncllm import AsyncEngine; "
        "AsyncEngine.from_pretrained('default', max_num_seqs=1); print(time.perf_counter()-t)"
    )
    times = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cold, cached = load_times()
    print(f"load (import + model + KV alloc), fresh process: {cold:.1f} s then {cached:.1f} s")
    engine = AsyncEngine.from_pretrained("default", max_num_seqs=64, max_model_len=1024)
    ps = prompts(engine.tokenizer, 16)
    results: dict[int, dict[str, list[float]]] = {
        t: {"ttft": [], "tps": [], "tps16": []} for t in args.threads
    }

    async def run() -> int:
        async with engine:
            await engine.generate(ps[0], SamplingParams(max_tokens=8))  # warm-up
            for _ in range(args.repeats):
                for t in args.threads:
                    torch.set_num_threads(t)
                    ttft, tps = await single(engine, ps[0])
                    results[t]["ttft"].append(ttft)
                    results[t]["tps"].append(tps)
                    results[t]["tps16"].append(await concurrent(engine, ps))
        return 0

    run_async(run)
    print(f"machine: {os.cpu_count()} cores; float32; block_size 16; budget 512 tokens")
    for t, r in results.items():
        print(
            f"threads={t}: single stream TTFT {statistics.median(r['ttft']):.3f} s, "
            f"decode {statistics.median(r['tps']):.1f} tokens/s; "
            f"16 streams {statistics.median(r['tps16']):.1f} tokens/s"
        )


if __name__ == "__main__":
    main()
