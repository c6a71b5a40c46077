"""An agent loop that lets the model call two Python functions as tools.

    python examples/agent_tools.py --model default --question "What is 17 + 25?"

Each turn sends the conversation and the tools to ``engine.chat(..., tools=TOOLS)``. When
the answer holds tool calls (``out.tool_calls``, ``finish_reason`` "tool_calls"), the
script runs each function with the model's arguments and appends the assistant's calls and
one ``role: "tool"`` message per result, then asks again; an answer without calls ends the
loop (so does ``--max-turns``).

The tools' JSON schemas come from the functions' signatures and docstrings
(transformers' ``get_json_schema``). A model whose chat template has no tool support
gets a Hermes-style template (``<tool_call>`` JSON, the format Qwen and Hermes models are
trained on) through ``chat_template_kwargs``; the script says so. A small model may answer
without calling anything, call a function that does not exist or pass bad arguments: the
script prints what the model did rather than pretending (a bad call is answered with an
error message as the tool result). ``tool_choice="required"`` is only asked for through the
prompt until grammar-constrained decoding covers tool calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import get_json_schema

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.engine.tool_calls import HERMES_TEMPLATE, detect_format


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: a number
        b: another
    """
    return a + b


def get_weather(city: str) -> str:
    """The weather in a city (made up).

    Args:
        city: its name
    """
    return f"sunny, 21 C in {city}"


FUNCTIONS: dict[str, Callable[..., Any]] = {"add": add, "get_weather": get_weather}
TOOLS = [get_json_schema(fn) for fn in FUNCTIONS.values()]


def run_tool(name: str, arguments: str) -> str:
    """Call one function; a bad call becomes an error message for the model."""
    fn = FUNCTIONS.get(name)
    if fn is None:
        return f"error: no function named {name!r}"
    try:
        return str(fn(**json.loads(arguments)))
    except (TypeError, ValueError) as e:
        return f"error: {e}"


def template_kwargs(engine: AsyncEngine) -> dict[str, Any] | None:
    """None for a model whose template renders tools; else the Hermes-style template."""
    try:
        detect_format(engine.tokenizer.get_chat_template(None, TOOLS))
        return None
    except (InvalidRequestError, ValueError):
        print("(the model's chat template has no tool support: using a Hermes-style one)")
        return {"chat_template": HERMES_TEMPLATE}


async def agent(engine: AsyncEngine, question: str, params: SamplingParams, max_turns: int):
    """Run the loop; returns a summary (turns, calls made, the final answer)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    kwargs = template_kwargs(engine)
    calls_made: list[str] = []
    answer = None
    for turn in range(1, max_turns + 1):
        out = None  # params.output_kind is "final": one item, the whole answer
        async for item in engine.chat(messages, params, tools=TOOLS, chat_template_kwargs=kwargs):
            out = item
        assert out is not None
        if out.tool_call_error:
            print(f"turn {turn}: the model's tool call was not valid: {out.tool_call_error}")
        if not out.tool_calls:
            answer = out.text
            print(f"turn {turn}: answer ({out.finish_reason}): {answer!r}")
            break
        messages.append(
            {
                "role": "assistant",
                "content": out.text or None,
                "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in out.tool_calls
                ],
            }
        )  # fmt: skip
        for call in out.tool_calls:
            result = run_tool(call.name, call.arguments)
            calls_made.append(call.name)
            print(f"turn {turn}: {call.name}({call.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        print(f"no final answer after {max_turns} turns")
    return {"turns": turn, "calls": calls_made, "answer": answer}


async def run(args: argparse.Namespace, engine: AsyncEngine | None = None) -> dict[str, Any]:
    engine = engine or AsyncEngine.from_pretrained(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, output_kind="final")
    async with engine:
        return await agent(engine, args.question, params, args.max_turns)


def main(argv: Sequence[str] | None = None, engine: AsyncEngine | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--question", default="What is the weather in Paris, and 17 + 25?")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=4)
    return asyncio.run(run(parser.parse_args(argv), engine))


if __name__ == "__main__":
    main()
    sys.exit(0)
