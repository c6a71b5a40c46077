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
error message as the tool result).

``--tool-choice required`` makes the first turn a tool call for sure: the output is
constrained by a grammar to calls naming one of the functions, with arguments that match
its schema (later turns are "auto", so the model can answer).
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
from asyncllm.tool_calling.tool_calls import HERMES_TEMPLATE, detect_format


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


def bounded(tool: dict[str, Any], max_length: int = 64) -> dict[str, Any]:
    """The tool with its string parameters at most ``max_length`` characters: under
    ``tool_choice="required"`` the grammar then closes every string in time, so a small
    model cannot ramble inside one until ``max_tokens``."""
    for prop in tool["function"]["parameters"].get("properties", {}).values():
        if prop.get("type") == "string":
            prop.setdefault("maxLength", max_length)
    return tool


FUNCTIONS: dict[str, Callable[..., Any]] = {"add": add, "get_weather": get_weather}
TOOLS = [bounded(get_json_schema(fn)) for fn in FUNCTIONS.values()]


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


async def agent(
    engine: AsyncEngine,
    question: str,
    params: SamplingParams,
    max_turns: int,
    tool_choice: str = "auto",
):
    """Run the loop (``tool_choice`` for the first turn, "auto" after); returns a summary
    (turns, calls made as (name, arguments), the final answer)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    kwargs = template_kwargs(engine)
    calls_made: list[tuple[str, str]] = []
    answer = None
    for turn in range(1, max_turns + 1):
        out = None  # params.output_kind is "final": one item, the whole answer
        choice = tool_choice if turn == 1 else "auto"
        async for item in engine.chat(
            messages, params, tools=TOOLS, tool_choice=choice, chat_template_kwargs=kwargs
        ):
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
            calls_made.append((call.name, call.arguments))
            print(f"turn {turn}: {call.name}({call.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        print(f"no final answer after {max_turns} turns")
    return {"turns": turn, "calls": calls_made, "answer": answer}


async def run(args: argparse.Namespace, engine: AsyncEngine | None = None) -> dict[str, Any]:
    engine = engine or AsyncEngine.from_pretrained(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, output_kind="final")
    async with engine:
        return await agent(engine, args.question, params, args.max_turns, args.tool_choice)


def main(argv: Sequence[str] | None = None, engine: AsyncEngine | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--question", default="What is the weather in Paris, and 17 + 25?")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--tool-choice", choices=["auto", "required"], default="auto")
    return asyncio.run(run(parser.parse_args(argv), engine))


if __name__ == "__main__":
    main()
    sys.exit(0)
