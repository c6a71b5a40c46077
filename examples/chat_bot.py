"""A chat bot serving many users at once (simulated, no network).

    python examples/chat_bot.py --model default --users 6 --moderators 1 --messages 3

The bot reads incoming messages from one queue, as a Discord or Slack bot reads its event
stream, and answers each in its own task; the engine batches all answers continuously.

- A new message from a user cancels that user's unfinished answer: the bot cancels the
  answering task, which closes its engine stream, which aborts the request and frees its KV
  blocks before the next step. The new answer then sees the conversation so far.
- Moderators' messages get a better priority (``priority=-10``; users have 0, lower is
  served first): when the batch is full (``--max-num-seqs``), a moderator's request is
  admitted before waiting users' and may preempt a running one.
- Each user is a tenant (``tenant=user``): users share the batch fairly, so one user's flood
  of messages cannot delay everyone else's answers; and when the engine's waiting queue is
  full an answer waits for a place (``admission="wait"``) instead of failing.

Simulated users send ``--messages`` messages each, waiting a random time in
``[0, --think-time]`` seconds between them (so some answers get interrupted). At the end the
script prints per role how many answers finished or were cancelled and their mean TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncllm import AsyncEngine, SamplingParams

SYSTEM = "You are a friendly assistant in a community chat. Answer briefly."
MODERATOR_PRIORITY = -10
USER_PRIORITY = 0
QUESTIONS = [
    "What is the capital of France?",
    "Can you suggest a name for a cat?",
    "How do I boil an egg?",
    "What is a good first programming language?",
    "Why is the sky blue?",
    "Give me a fun fact about octopuses.",
    "How many legs does a spider have?",
    "What should I read this weekend?",
]
MOD_MESSAGES = [
    "Summarize the channel rules in one sentence.",
    "Draft a reminder to keep the discussion on topic.",
    "Write a welcome message for new members.",
]


@dataclass
class Message:
    user: str
    text: str
    moderator: bool
    sent: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    user: str
    moderator: bool
    status: str  # "answered" or "cancelled"
    ttft_s: float | None = None
    text: str = ""


class ChatBot:
    """Answers messages from a queue; one answering task per user at a time."""

    def __init__(self, engine: AsyncEngine, max_tokens: int, verbose: bool = True) -> None:
        self.engine = engine
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9)
        self.inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self.history: dict[str, list[dict[str, str]]] = {}
        self.answering: dict[str, asyncio.Task[None]] = {}
        self.outcomes: list[Outcome] = []
        self.verbose = verbose

    def say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)

    async def run(self) -> None:
        """The bot loop: dispatch messages until a None arrives, then finish the answers."""
        while (msg := await self.inbox.get()) is not None:
            previous = self.answering.get(msg.user)
            if previous is not None and not previous.done():
                previous.cancel()  # closes its stream: the request is aborted at once
            self.answering[msg.user] = asyncio.create_task(self.answer(msg))
        await asyncio.gather(*self.answering.values(), return_exceptions=True)

    async def answer(self, msg: Message) -> None:
        history = self.history.setdefault(msg.user, [])
        messages = [{"role": "system", "content": SYSTEM}, *history]
        messages.append({"role": "user", "content": msg.text})
        priority = MODERATOR_PRIORITY if msg.moderator else USER_PRIORITY
        outcome = Outcome(msg.user, msg.moderator, "cancelled")
        self.outcomes.append(outcome)
        parts: list[str] = []
        chat = self.engine.chat(
            messages, self.params, priority=priority, tenant=msg.user, admission="wait"
        )
        try:
            async for out in chat:
                if outcome.ttft_s is None and out.token_ids:
                    outcome.ttft_s = time.monotonic() - msg.sent
                parts.append(out.text)
        except asyncio.CancelledError:
            self.say(f"[{msg.user}] answer cancelled by a new message ({len(parts)} parts)")
            raise
        outcome.status, outcome.text = "answered", "".join(parts)
        history += [
            {"role": "user", "content": msg.text},
            {"role": "assistant", "content": outcome.text},
        ]
        ttft = f"{outcome.ttft_s:.2f}" if outcome.ttft_s is not None else "-"
        line = outcome.text.replace("\n", " ")[:60]
        self.say(f"[{msg.user}] (TTFT {ttft} s) {line}")


async def simulate_user(
    bot: ChatBot, name: str, moderator: bool, n: int, think: float, rng: random.Random
) -> None:
    pool = MOD_MESSAGES if moderator else QUESTIONS
    for _ in range(n):
        text = rng.choice(pool)
        bot.say(f"<{name}> {text}")
        await bot.inbox.put(Message(name, text, moderator))
        await asyncio.sleep(rng.uniform(0, think))


async def simulate(engine: AsyncEngine, args: argparse.Namespace) -> ChatBot:
    bot = ChatBot(engine, args.max_tokens, verbose=not args.quiet)
    rng = random.Random(args.seed)
    people = [(f"user{i}", False) for i in range(args.users)]
    people += [(f"mod{i}", True) for i in range(args.moderators)]
    async with engine:
        loop = asyncio.create_task(bot.run())
        await asyncio.gather(
            *(
                simulate_user(bot, name, mod, args.messages, args.think_time, rng)
                for name, mod in people
            )
        )
        await bot.inbox.put(None)
        await loop
    return bot


def summarize(bot: ChatBot, stats: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for role, is_mod in (("moderators", True), ("users", False)):
        mine = [o for o in bot.outcomes if o.moderator == is_mod]
        ttfts = [o.ttft_s for o in mine if o.status == "answered" and o.ttft_s is not None]
        summary[role] = {
            "answered": sum(o.status == "answered" for o in mine),
            "cancelled": sum(o.status == "cancelled" for o in mine),
            "mean_ttft_s": statistics.mean(ttfts) if ttfts else None,
        }
    summary["engine"] = {
        k: stats[k]
        for k in ("num_preemptions", "num_running", "num_free_blocks", "num_total_blocks")
    }
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--moderators", type=int, default=1)
    parser.add_argument("--messages", type=int, default=3, help="messages per person")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--think-time", type=float, default=3.0, help="max seconds between")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="the batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    engine = AsyncEngine.from_pretrained(args.model, max_num_seqs=args.max_num_seqs)
    bot = asyncio.run(simulate(engine, args))
    summary = summarize(bot, engine.stats())
    print()
    for role in ("moderators", "users"):
        s = summary[role]
        ttft = f"{s['mean_ttft_s']:.2f} s" if s["mean_ttft_s"] is not None else "-"
        print(f"{role:>10}: {s['answered']} answered, {s['cancelled']} cancelled, mean TTFT {ttft}")
    e = summary["engine"]
    print(
        f"    engine: {e['num_preemptions']} preemptions; {e['num_free_blocks']} of "
        f"{e['num_total_blocks']} KV blocks free"
    )
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
