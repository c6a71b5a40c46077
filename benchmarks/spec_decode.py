"""Speculative decoding (n-gram / prompt lookup) on the default model: one stream, greedy,
tokens per second and acceptance rate with speculation on and off.

Two prompts of the kind speculation is for (text of this file, not from any data set):

* ``edit``: a paragraph and the request to repeat it with one word changed;
* ``w7``: an agent turn (issue 40's W7): a tool result of ~1,500 tokens (an order table)
  and the request to quote the rows of one status unchanged.

The two engines (``speculative_tokens=0`` and ``=k``) live in one process and their runs
alternate (a shared, noisy machine: compare the ratio of one run). Greedy outputs are
token-identical, checked here too. Tokens per second is the decode rate: 1 / the output's
mean TPOT (first to last token; the prompt's prefill is left out).

Run from the repository root::

    PYTHONPATH=. python benchmarks/spec_decode.py [--k 4] [--rounds 3] [--threads 1]
        [--max-tokens 192] [--prompts edit w7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.engine.streams import collect

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at six. He wound the "
    "clockwork that turned the great lens, trimmed the wick, and wrote the weather in a "
    "leather book: wind from the west, a grey sea, two fishing boats returning late. When "
    "the fog rolled in he rang the bell by hand, once every minute, until the morning light "
    "came back over the cliffs and the boats could see the harbour again."
)

STATUSES = ("shipped", "delayed", "packed", "returned")
ITEMS = ("steel bolts M6", "copper wire 2mm", "oak planks", "LED strips", "glass jars")
NAMES = ("Ana Ruiz", "Ben Okafor", "Chen Wei", "Dara Walsh", "Eli Novak", "Femi Adeyemi")


def tool_result(rows: int = 60) -> str:
    """A deterministic order table, as a tool call would return it."""
    lines = ["order | customer | item | qty | status"]
    for i in range(rows):
        lines.append(
            f"{1040 + i} | {NAMES[(7 * i) % len(NAMES)]} | {ITEMS[(3 * i) % len(ITEMS)]} | "
            f"{(37 * i) % 200 + 5} | {STATUSES[(5 * i) % 7 % len(STATUSES)]}"
        )
    return "\n".join(lines)


PROMPTS = {
    "edit": f"{PARAGRAPH}\n\nRepeat the paragraph above exactly, but replace 'six' with "
    "'seven'. Write only the paragraph.",
    "w7": f"The inventory tool returned:\n\n{tool_result()}\n\nCopy every row whose status "
    "is 'delayed' exactly as it appears above, one per line, with the header line first.",
}


async def _run(engine: AsyncEngine, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stream = engine.chat([{"role": "user", "content": prompt}], params)
    out = await collect(stream, params.output_kind)  # type: ignore[arg-type]
    assert out.metrics is not None and out.metrics.mean_tpot is not None
    return out.token_ids, 1.0 / out.metrics.mean_tpot


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    args = ap.parse_args()
    common = dict(compile=False, num_threads=args.threads, max_num_batched_tokens=512)
    off = AsyncEngine.from_pretrained("default", **common)  # type: ignore[arg-type]
    on = AsyncEngine.from_pretrained("default", speculative_tokens=args.k, **common)  # type: ignore[arg-type]
    print(f"default model, greedy, 1 stream, compile off, {args.threads} thread(s), k={args.k}")
    async with off, on:
        for name in args.prompts:
            prompt = PROMPTS[name]
            rates: dict[str, list[float]] = {"off": [], "on": []}
            before = on.stats()
            outputs = set()
            for _ in range(args.rounds):
                for label, engine in (("off", off), ("on", on)):
                    ids, rate = await _run(engine, prompt, args.max_tokens)
                    rates[label].append(rate)
                    outputs.add(tuple(ids))
            after = on.stats()
            drafts = int(after["spec_num_draft_tokens"]) - int(before["spec_num_draft_tokens"])
            acc = int(after["spec_num_accepted_tokens"]) - int(before["spec_num_accepted_tokens"])
            steps = int(after["spec_num_steps"]) - int(before["spec_num_steps"])
            off_r, on_r = statistics.median(rates["off"]), statistics.median(rates["on"])
            print(
                f"{name}: {len(next(iter(outputs)))} tokens, identical={len(outputs) == 1}; "
                f"off {off_r:.1f} tok/s, on {on_r:.1f} tok/s, speedup {on_r / off_r:.2f}x; "
                f"acceptance {acc}/{drafts} = {acc / max(drafts, 1):.2f}, "
                f"{steps} verifications, rates off {[round(r, 1) for r in rates['off']]} "
                f"on {[round(r, 1) for r in rates['on']]}"
            )


if __name__ == "__main__":
    asyncio.run(main())
