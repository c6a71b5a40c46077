"""W8, a shared chat bot: one tenant sends bursts, the others one request a second each;
the quiet tenants' TTFT with fair shares between tenants, without them, and on an idle
engine; throughput against W1 (docs/benchmarks.md, "W8").

The workload (``prompts.json``'s W1 prompts, greedy, EOS ignored):

* tenant ``burst``: ``--bursts`` bursts of 64 requests (W1's prompts, ``--burst-new``
  tokens each), one every ``--burst-every`` seconds from t = 0;
* tenants ``quiet-1`` .. ``quiet-7``: each one request a second (W1's prompts cycled,
  ``--quiet-new`` tokens), tenant k at t = k/7 + j, until the last burst's time plus
  ``--burst-every`` seconds.

Variants, alternating per round on one loaded engine (default settings, ``--threads``):

* ``idle``: the quiet requests alone (their TTFT on an otherwise idle engine);
* ``tenants``: every request with its ``tenant=`` (the scheduler's fair shares);
* ``one tenant``: the same requests without ``tenant=`` (first come, first served, as
  before tenants and as engines without them serve it);
* ``W1``: 64 requests at once, ``--burst-new`` tokens (the throughput reference).

Run from the repository root::

    PYTHONPATH=. python benchmarks/w8_tenants.py [--rounds 2] [--threads 2]

Prints one JSON object: per variant and round the quiet requests' TTFT (p50, p90, p99,
max, seconds), the burst's, generated tokens per second over the wall (first arrival to
last token), the mean step time, and the ratios the issue's targets name: quiet p99 TTFT
over idle p99, and tokens per second over W1's; preemptions per variant.
``--budget``: ``max_num_batched_tokens``; ``--no-one-tenant`` leaves that variant out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bench.workloads import load_prompts

QUIET = 7


def requests(args: argparse.Namespace, variant: str) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, tenant, prompt ids, new tokens) of one variant."""
    w1 = load_prompts()["W1"]["ids"]
    out: list[tuple[float, str, list[int], int]] = []
    if variant == "W1":
        return [(0.0, "burst", w1[i % len(w1)], args.burst_new) for i in range(64)]
    end = (args.bursts - 1) * args.burst_every + args.burst_every
    if variant != "idle":
        for b in range(args.bursts):
            out += [(b * args.burst_every, "burst", w1[i % len(w1)], args.burst_new)
                    for i in range(64)]  # fmt: skip
    j = 0
    for k in range(QUIET):
        t = k / QUIET
        while t < end:
            out.append((t, f"quiet-{k + 1}", w1[(j * 7 + k) % len(w1)], args.quiet_new))
            t += 1.0
            j += 1
    return sorted(out, key=lambda r: r[0])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def run(engine: AsyncEngine, reqs: list[Any], use_tenants: bool) -> dict[str, Any]:
    """Send the requests at their arrival times; TTFT per tenant kind and throughput."""
    ttft: dict[str, list[float]] = {"quiet": [], "burst": []}
    tokens = 0
    start = time.perf_counter()
    last = start

    async def one(arrival: float, tenant: str, ids: list[int], new: int) -> None:
        nonlocal tokens, last
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        sent = time.perf_counter()
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        first = None
        async for out in engine.stream(ids, params, tenant=tenant if use_tenants else ""):
            if out.token_ids and first is None:
                first = time.perf_counter()
                ttft["burst" if tenant == "burst" else "quiet"].append(first - sent)
            tokens += len(out.token_ids)
        last = max(last, time.perf_counter())

    steps, preempted = engine.core.num_steps, engine.core.scheduler.num_preemptions
    await asyncio.gather(*(one(*r) for r in reqs))
    steps = engine.core.num_steps - steps
    res: dict[str, Any] = {
        "tokens_per_s": round(tokens / (last - start), 1),
        "mean_step_ms": round(1000 * (last - start) / max(steps, 1), 1),
        "preemptions": engine.core.scheduler.num_preemptions - preempted,
    }
    for kind, xs in ttft.items():
        if xs:
            res[f"{kind}_ttft_s"] = {
                "p50": round(statistics.median(xs), 4),
                "p90": round(_pct(xs, 0.9), 4),
                "p99": round(_pct(xs, 0.99), 4),
                "max": round(max(xs), 4),
                "n": len(xs),
            }
    return res


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engine = AsyncEngine.from_pretrained(
        args.model, num_threads=args.threads, max_num_batched_tokens=args.budget
    )
    core = engine.core
    if core.runner.compiled is not None:  # measure the steady state, not the compile
        core.runner.compiled.wait(900)
    variants = ["idle", "tenants", *(["one tenant"] if args.one_tenant else []), "W1"]
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    async with engine:
        # Warm-up: every prompt once, a few tokens.
        await run(engine, [(0.0, "w", ids, 4) for _, _, ids, _ in requests(args, "W1")], False)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                reqs = requests(args, "idle" if v == "idle" else "W1" if v == "W1" else "mix")
                t = time.perf_counter()
                rounds[v].append(await run(engine, reqs, v == "tenants"))
                print(f"round {r} {v}: {time.perf_counter() - t:.1f} s {rounds[v][-1]}",
                      file=sys.stderr, flush=True)  # fmt: skip
                core.reset_prefix_cache()
    out: dict[str, Any] = {"settings": vars(args), "rounds": rounds, "ratios": []}
    for r in range(args.rounds):
        idle = rounds["idle"][r]["quiet_ttft_s"]["p99"]
        w1 = rounds["W1"][r]["tokens_per_s"]
        out["ratios"].append({
            v: {"quiet_p99_over_idle_p99": round(rounds[v][r]["quiet_ttft_s"]["p99"] / idle, 2),
                "tokens_per_s_over_w1": round(rounds[v][r]["tokens_per_s"] / w1, 3)}
            for v in variants if v not in ("idle", "W1")
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--burst-every", type=float, default=30.0)
    ap.add_argument("--burst-new", type=int, default=128)
    ap.add_argument("--quiet-new", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--no-one-tenant", dest="one_tenant", action="store_false",
                    help="leave out the first-come-first-served variant")  # fmt: skip
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main_async(args)), indent=1))


if __name__ == "__main__":
    main()
