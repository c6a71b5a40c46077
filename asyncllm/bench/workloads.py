"""The standard workloads (../shared/bench/WORKLOADS.md) as request lists, plus W6, W1J and W7.

A workload is a list of requests ``[prompt token ids, max_tokens, arrival seconds]``; every
request is greedy and ignores EOS (but W1J's), so it generates exactly ``max_tokens`` tokens. Prompt
token ids come from ``prompts.json`` (a copy of ../shared/bench/prompts.json ships with the
package: the exact ids the peers' published figures were measured with).

| id | requests | prompt | new tokens |
|----|----------|--------|------------|
| W1 | 64 at once | W1's chat-templated "Write a short story about a robot number {i}." | 128 |
| W1J | as W1, each under :data:`W1J_SCHEMA` (structured outputs) | W1's | <= 128, EOS on |
| W2 | 32 at once | W2's 528 shared prompt tokens + a distinct question | 32 (cache on, off) |
| W3 | 1 | W1's prompt 0 | 128 |
| W4 | Poisson arrivals at ``rate`` per second for ``duration`` s | W1's, cycled | 64 |
| W5 | as W1 | as W1, KV cache sized to 25% of the batch's peak tokens | 128 |
| W6 | 64 at once | W1's | 16 + (37 i mod 241) for request i |
| W7 | 1 | a 26-entry logbook, and "copy 5 entries with one word changed" | 256 |
| C4, C16 | 4 / 16 at once | W1's first | 128 (the concurrency sweep with W3 = 1 and W1 = 64) |

``quick=True`` shrinks each one to run in seconds (fewer requests and tokens); quick figures
are smoke checks, not comparable to full ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROMPTS_FILE = pathlib.Path(__file__).with_name("prompts.json")
SHARED_PROMPTS = pathlib.Path("../shared/bench/prompts.json")

ALL = ("W1", "W1J", "W2", "W3", "W4", "W5", "W6", "W7", "C4", "C16")
DEFAULT = ALL

#: W1J's JSON schema: a small record of the story W1's prompt asks for (typed fields, an
#: enum, an array), as an agent would ask for one.
W1J_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "robot_number": {"type": "integer", "minimum": 0},
        "mood": {"type": "string", "enum": ["happy", "sad", "curious", "brave"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "story": {"type": "string"},
    },
    "required": ["title", "robot_number", "mood", "tags", "story"],
    "additionalProperties": False,
}


@dataclass
class Workload:
    """One workload: its requests and how to run it.

    Attributes:
        name: "W1".."W6", "C4", "C16".
        requests: ``[ids, max_tokens, arrival_s]`` per request.
        variants: run once per variant: "on" / "off" is the prefix cache (W2); "" otherwise.
        kv_fraction: for W5, the KV cache as a fraction of the batch's peak tokens.
        description: one line for the report.
        params: figures that define it (rate, duration...), reported with the results.
        structured_outputs: every request's ``StructuredOutputsParams`` fields (W1J), or None.
        ignore_eos: requests generate exactly ``max_tokens`` (False: EOS ends them too, as
            it ends a constrained request once its JSON is complete, in asyncllm and vLLM).
    """

    name: str
    requests: list[list[Any]]
    description: str
    variants: tuple[str, ...] = ("",)
    kv_fraction: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    structured_outputs: dict[str, Any] | None = None
    ignore_eos: bool = True

    @property
    def peak_tokens(self) -> int:
        """Prompt plus generated tokens of all requests: the batch's KV need at its peak."""
        return sum(len(r[0]) + r[1] for r in self.requests)

    @property
    def online(self) -> bool:
        """Requests arrive over time (not all at once)."""
        return any(r[2] > 0 for r in self.requests)

    def warmup(self) -> list[list[Any]]:
        """The uncounted warm-up: the same prompts at once, 8 new tokens each (at most 64
        requests, and no more than 4096 prompt tokens beyond the first request)."""
        out: list[list[Any]] = []
        total = 0
        for ids, m, _ in self.requests[:64]:
            if out and total + len(ids) > 4096:
                break
            out.append([ids, min(m, 8), 0.0])
            total += len(ids)
        return out


def load_prompts(path: str | pathlib.Path | None = None) -> dict[str, Any]:
    """prompts.json: ``path``, else the packaged copy.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    p = pathlib.Path(path) if path else PROMPTS_FILE
    return json.loads(p.read_text())  # type: ignore[no-any-return]


def shared_copy_differs(data: dict[str, Any]) -> bool:
    """True when ../shared/bench/prompts.json exists and holds other token ids."""
    if not SHARED_PROMPTS.is_file():
        return False
    other = json.loads(SHARED_PROMPTS.read_text())
    return any(other.get(k, {}).get("ids") != data[k]["ids"] for k in ("W1", "W2", "W3"))


def poisson_arrivals(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` per second over ``duration``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def w6_lengths(n: int, quick: bool = False) -> list[int]:
    """W6's max_tokens: 16 + (37 i mod 241) (quick: 8 + (37 i mod 61))."""
    if quick:
        return [8 + (37 * i) % 61 for i in range(n)]
    return [16 + (37 * i) % 241 for i in range(n)]


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """What the workloads are built from: prompts.json's ids and the sizes a run asks for."""

    data: dict[str, Any]
    quick: bool
    rate: float
    duration: float
    seed: int

    @property
    def w1(self) -> list[list[int]]:
        return self.data["W1"]["ids"]  # type: ignore[no-any-return]

    @property
    def n1(self) -> int:
        return 16 if self.quick else len(self.w1)

    @property
    def new1(self) -> int:
        return 32 if self.quick else int(self.data["W1"]["new"])

    def w1_requests(self, n: int) -> list[list[Any]]:
        return [[self.w1[i], self.new1, 0.0] for i in range(n)]


def _w1(z: _Sizes) -> Workload:
    return Workload(
        "W1", z.w1_requests(z.n1), f"offline throughput: {z.n1} at once, {z.new1} tokens"
    )


def _w1j(z: _Sizes) -> Workload:
    return Workload(
        "W1J",
        z.w1_requests(z.n1),
        f"structured outputs: W1 ({z.n1} at once, up to {z.new1} tokens), each "
        "constrained by one JSON schema",
        structured_outputs={"json": W1J_SCHEMA},
        ignore_eos=False,
    )


def _w2(z: _Sizes) -> Workload:
    w2 = z.data["W2"]["ids"]
    n2, new2 = (8, 16) if z.quick else (len(w2), int(z.data["W2"]["new"]))
    return Workload(
        "W2",
        [[w2[i], new2, 0.0] for i in range(n2)],
        f"shared system prompt: {n2} at once, "
        f"{z.data['W2']['common_prefix_tokens']} shared tokens, {new2} tokens",
        variants=("on", "off"),
    )


def _w3(z: _Sizes) -> Workload:
    new3 = 32 if z.quick else int(z.data["W3"]["new"])
    return Workload("W3", [[z.data["W3"]["ids"][0], new3, 0.0]], f"single stream: {new3} tokens")


def _w7(z: _Sizes) -> Workload:
    """W7 (issue 40): where output repeats its context, so prompt-lookup speculation pays.
    Quick: 32 tokens of the same prompt."""
    w7 = z.data["W7"]
    new7 = 32 if z.quick else int(w7["new"])
    return Workload(
        "W7",
        [[w7["ids"][0], new7, 0.0]],
        f"agent turn: a {len(w7['ids'][0])}-token document in the prompt, an answer that "
        f"quotes and edits it, {new7} tokens",
    )


def _w4(z: _Sizes) -> Workload:
    arrivals = poisson_arrivals(z.rate, z.duration, z.seed)
    reqs = [[z.w1[i % len(z.w1)], 16 if z.quick else 64, t] for i, t in enumerate(arrivals)]
    return Workload(
        "W4",
        reqs,
        f"online: Poisson {z.rate:g} req/s for {z.duration:g} s ({len(reqs)} requests), "
        f"{reqs[0][1] if reqs else 0} tokens",
        params={"rate": z.rate, "duration_s": z.duration, "seed": z.seed},
    )


def _w5(z: _Sizes) -> Workload:
    return Workload(
        "W5",
        z.w1_requests(z.n1),
        "preemption pressure: W1 with the KV cache for 25% of its peak",
        kv_fraction=0.25,
    )


def _w6(z: _Sizes) -> Workload:
    lens = w6_lengths(z.n1, z.quick)
    return Workload(
        "W6",
        [[z.w1[i], lens[i], 0.0] for i in range(z.n1)],
        f"mixed lengths: {z.n1} at once, {min(lens)}..{max(lens)} tokens (sum {sum(lens)})",
    )


def _concurrency(k: int, z: _Sizes) -> Workload:
    n = max(1, k // 4) if z.quick else k
    return Workload(f"C{k}", z.w1_requests(n), f"concurrency sweep: {n} at once, {z.new1} tokens")


#: Each workload's builder.
BUILDERS: dict[str, Callable[[_Sizes], Workload]] = {
    "W1": _w1,
    "W1J": _w1j,
    "W2": _w2,
    "W3": _w3,
    "W4": _w4,
    "W5": _w5,
    "W6": _w6,
    "W7": _w7,
    "C4": functools.partial(_concurrency, 4),
    "C16": functools.partial(_concurrency, 16),
}


def build(
    names: tuple[str, ...] | list[str],
    data: dict[str, Any],
    *,
    quick: bool = False,
    w4_rate: float = 1.0,
    w4_duration: float = 60.0,
    seed: int = 0,
) -> list[Workload]:
    """The named workloads, in the order given (``quick``: smoke-test sizes; W4 at most
    1 request/s for 15 s).

    Raises:
        ValueError: an unknown workload name.
    """
    duration = min(w4_duration, 15.0) if quick else w4_duration
    rate = min(w4_rate, 1.0) if quick else w4_rate
    z = _Sizes(data, quick, rate, duration, seed)
    out: list[Workload] = []
    for name in names:
        if name not in BUILDERS:
            raise ValueError(f"unknown workload {name!r}; choose from {ALL}")
        out.append(BUILDERS[name](z))
    return out
