"""Several agents share one long system prompt: prefix caching computes it once.

    python examples/agents_shared_prefix.py --model default --agents 6 --system-tokens 1500

A planner agent answers first; then the worker agents run concurrently, each with the same
system prompt (a long "handbook") and its own task. The script runs this twice, on an
engine with prefix caching on and on one with it off, and prints per agent the time to
first token (TTFT) and the prompt tokens served from the cache, then the engine's
prefix-cache counters.

With caching on, the handbook's full KV blocks are computed by the planner's request and
shared (by reference, not copied) by every worker, so the workers prefill only their own
task: their TTFT drops and ``prefix_cache_hits`` counts the shared tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from asyncllm import AsyncEngine, SamplingParams

HANDBOOK = (
    "Section {i}. Every agent of the Orbital Logistics team follows these rules. Answer "
    "in short, precise sentences. Cite the section number of the rule you rely on. Never "
    "invent shipment numbers; when a number is missing, ask for it. Escalate safety "
    "issues to the duty officer at once. Prefer metric units and UTC times. "
)
TASKS = [
    "You are the planner. Split the job 'move 40 crates from dock A to orbit B' into steps.",
    "You are the safety checker. List the risks of moving crates between docks.",
    "You are the scheduler. Propose a UTC timetable for three shuttle trips.",
    "You are the inventory clerk. Say which records you need before the move.",
    "You are the communications officer. Draft a two-line status update.",
    "You are the budget analyst. Name the three biggest costs of the move.",
    "You are the quality reviewer. Say how to verify each crate arrived intact.",
    "You are the weather officer. Say which conditions would delay a launch.",
]


def build_system_prompt(tokenizer: Any, num_tokens: int) -> str:
    """The handbook, repeated section by section up to about ``num_tokens`` tokens."""
    text, i = "", 1
    while True:
        more = text + HANDBOOK.format(i=i)
        if len(tokenizer.encode(more)) > num_tokens and text:
            return text
        text, i = more, i + 1


async def run_agents(
    engine: AsyncEngine, system: str, num_agents: int, max_tokens: int
) -> list[dict[str, Any]]:
    """The planner first, then the workers concurrently; one result per agent."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def agent(i: int) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": TASKS[i % len(TASKS)]},
        ]
        text = []
        async for out in engine.chat(messages, params):
            text.append(out.text)
            last = out
        assert last.metrics is not None
        return {
            "agent": i,
            "ttft_s": last.metrics.ttft,
            "prompt_tokens": last.num_prompt_tokens,
            "cached_tokens": last.num_cached_tokens,
            "text": "".join(text),
        }

    results = [await agent(0)]
    results += await asyncio.gather(*(agent(i) for i in range(1, num_agents)))
    return results


def run(args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    """Build an engine (prefix caching on or off), run the agents, report."""
    config: dict[str, Any] = {"enable_prefix_caching": caching, "max_num_seqs": args.agents}
    if args.kv_cache_mb:
        config["kv_cache_bytes"] = args.kv_cache_mb * 2**20
    if args.max_model_len:
        config["max_model_len"] = args.max_model_len
    engine = AsyncEngine.from_pretrained(args.model, **config)
    system = build_system_prompt(engine.tokenizer, args.system_tokens)

    async def main() -> list[dict[str, Any]]:
        async with engine:
            return await run_agents(engine, system, args.agents, args.max_tokens)

    agents = asyncio.run(main())
    stats = engine.stats()
    workers = [a["ttft_s"] for a in agents[1:] if a["ttft_s"] is not None]
    return {
        "caching": caching,
        "agents": agents,
        "worker_mean_ttft_s": statistics.mean(workers) if workers else None,
        "prefix_cache_queries": stats["prefix_cache_queries"],
        "prefix_cache_hits": stats["prefix_cache_hits"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "free_blocks_after": stats["num_free_blocks"],
        "total_blocks": stats["num_total_blocks"],
    }


def report(result: dict[str, Any]) -> None:
    mode = "on " if result["caching"] else "off"
    print(f"\nprefix caching {mode}")
    print(f"  {'agent':>5} {'TTFT':>9} {'prompt':>7} {'cached':>7}  answer")
    for a in result["agents"]:
        role = "planner" if a["agent"] == 0 else f"{a['agent']:>5}"
        answer = a["text"].replace("\n", " ")[:50]
        print(
            f"  {role:>5} {a['ttft_s']:8.3f}s {a['prompt_tokens']:>7} "
            f"{a['cached_tokens']:>7}  {answer}"
        )
    mean = result["worker_mean_ttft_s"]
    print(
        f"  workers' mean TTFT {mean:.3f} s | prefix cache: "
        f"{result['prefix_cache_hits']} of {result['prefix_cache_queries']} prompt tokens "
        f"hit ({result['prefix_cache_hit_rate']:.0%})"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    parser.add_argument("--agents", type=int, default=6, help="planner + workers")
    parser.add_argument("--system-tokens", type=int, default=1500, help="system prompt length")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    if args.agents < 2:
        parser.error("--agents must be at least 2 (a planner and a worker)")

    results = {}
    for caching in (True, False):
        results["on" if caching else "off"] = result = run(args, caching)
        report(result)
        gc.collect()  # free the first engine's KV cache before the second one is allocated
    on, off = results["on"]["worker_mean_ttft_s"], results["off"]["worker_mean_ttft_s"]
    if on and off:
        print(f"\nworkers' TTFT with caching: {on / off:.0%} of without")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
