"""Every example in examples/ runs, on the tiny model with short settings, so none can rot.

The examples are imported from their files and their ``main``/``create_app`` called; one is
also run as ``python examples/X.py`` in a subprocess, as a user runs it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import runpy
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import httpx
import pytest

from asyncllm import AsyncEngine
from tests.server.test_server import serving, wait_for

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    return load_path(EXAMPLES / f"{name}.py", f"example_{name}")


def load_path(path: pathlib.Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def read_events(response: httpx.Response) -> list[tuple[str, Any]]:
    """Parse a server-sent event stream into (event, data) pairs."""
    events, event = [], "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((event, json.loads(line[len("data: ") :])))
            event = "message"
    return events


def test_web_sse_streams_and_aborts_on_disconnect(
    tiny_llama_dir: pathlib.Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    web_sse = load("web_sse")
    engine = make_engine(tiny_llama_dir, max_num_seqs=4)
    app = web_sse.create_app(engine)
    with serving(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        assert "EventSource" in http.get("/").text
        # a whole stream: text events, then "done"
        with http.stream("GET", "/generate", params={"prompt": "Hi", "max_tokens": 5}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = read_events(r)
        assert events[-1][0] == "done" and events[-1][1]["generated_tokens"] <= 5
        assert all(kind == "message" and "text" in data for kind, data in events[:-1])
        # POST with a JSON body, raw prompt
        with http.stream(
            "POST", "/generate", json={"prompt": "Hi", "max_tokens": 3, "raw": True}
        ) as r:
            assert read_events(r)[-1][0] == "done"
        # bad parameters: 400 before the stream starts
        assert http.get("/generate", params={"prompt": "Hi", "max_tokens": 0}).status_code == 400
        assert http.get("/generate").status_code == 400

        # a client that disconnects mid-stream: the request is aborted, its blocks freed
        generated = engine.stats()["num_generated_tokens"]
        params = {"prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": "1"}
        with http.stream("GET", "/generate", params=params) as r:
            lines = r.iter_lines()
            got = 0
            while got < 2:
                got += next(lines).startswith("data: ")
        # leaving the block closes the connection

        def aborted() -> bool:
            s = http.get("/stats").json()
            return (
                s["client_gone"] == 1
                and s["num_running"] == 0
                and s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"]
            )

        wait_for(aborted)
        assert engine.stats()["num_generated_tokens"] - generated < 200


def test_agents_shared_prefix(tiny_llama_dir: pathlib.Path, capsys: Any) -> None:
    agents = load("agents_shared_prefix")
    results = agents.main(
        ["--model", str(tiny_llama_dir), "--agents", "3", "--system-tokens", "100",
         "--max-tokens", "3"]
    )  # fmt: skip
    on, off = results["on"], results["off"]
    # with caching every worker reuses the planner's full blocks of the system prompt
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] == 0
    assert all(a["cached_tokens"] >= 64 for a in on["agents"][1:])
    assert all(a["cached_tokens"] == 0 for a in off["agents"])
    # the same greedy answers either way
    assert [a["text"] for a in on["agents"]] == [a["text"] for a in off["agents"]]
    for r in (on, off):
        assert r["free_blocks_after"] == r["total_blocks"]
    out = capsys.readouterr().out
    assert "prefix caching on" in out and "prefix caching off" in out


def test_chat_bot_cancels_and_prioritizes(tiny_llama_dir: pathlib.Path) -> None:
    chat_bot = load("chat_bot")
    base = ["--model", str(tiny_llama_dir), "--max-tokens", "4", "--quiet"]
    # Every message of a person arrives at once: all but each person's last are cancelled.
    summary = chat_bot.main(
        [*base, "--users", "3", "--moderators", "1", "--messages", "3", "--think-time", "0"]
    )
    assert summary["users"] == {**summary["users"], "answered": 3, "cancelled": 6}
    assert summary["moderators"]["answered"] == 1 and summary["moderators"]["cancelled"] == 2
    engine = summary["engine"]
    assert engine["num_running"] == 0 and engine["num_free_blocks"] == engine["num_total_blocks"]

    # With a batch of one, the moderator's message is served before the waiting users'.
    summary = chat_bot.main(
        [*base, "--users", "4", "--moderators", "1", "--messages", "1", "--think-time", "0",
         "--max-num-seqs", "1"]
    )  # fmt: skip
    assert summary["users"]["answered"] == 4 and summary["moderators"]["answered"] == 1
    assert summary["moderators"]["mean_ttft_s"] < summary["users"]["mean_ttft_s"]


def test_example_runs_as_a_script(
    tiny_llama_dir: pathlib.Path, monkeypatch: Any, capsys: Any
) -> None:
    """``python examples/chat_bot.py ...`` as a user runs it (its ``__main__`` block, run
    in this process: a new interpreter would spend seconds importing torch)."""
    argv = ["chat_bot.py", "--model", str(tiny_llama_dir), "--users", "2", "--moderators",
            "1", "--messages", "2", "--max-tokens", "3", "--think-time", "0.01"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / "chat_bot.py"), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "answered" in out and "KV blocks free" in out


def test_api_reference_is_current() -> None:
    """docs/api.md is what ``python docs/gen_api.py`` writes, and covers every public name."""
    import asyncllm

    root = EXAMPLES.parent
    gen = load_path(root / "docs" / "gen_api.py", "gen_api")
    text = (root / "docs" / "api.md").read_text()
    assert text == gen.generate(), "docs/api.md is out of date: run python docs/gen_api.py"
    for name in asyncllm.__all__:
        assert f"## `{name}`" in text, name


def test_doc_links_resolve() -> None:
    """Relative links in README.md and docs/*.md point at files that exist."""
    root = EXAMPLES.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_agent_tools_runs_and_calls_tools(
    tiny_llama_dir: pathlib.Path, tiny_llama_512_dir: pathlib.Path, make_engine: Any
) -> None:
    """On the random tiny model (a template without tools: the example brings one) it runs
    and reports what the model did; with the model's output scripted to a call, the loop
    runs the function and sends the result back."""
    from tests.conftest import script_output

    agent_tools = load("agent_tools")
    args = ["--max-tokens", "4", "--max-turns", "1", "--question", "17+25?"]
    summary = agent_tools.main(args, make_engine(tiny_llama_dir, max_num_seqs=2))
    assert summary["turns"] == 1
    engine = make_engine(tiny_llama_512_dir, max_num_seqs=2)  # the tools fill 256 positions
    script_output(engine, '<tool_call>{"name": "add", "arguments": {"a": 17, "b": 25}}</tool_call>')
    summary = agent_tools.main(
        ["--max-tokens", "40", "--max-turns", "1", "--question", "17+25?"], engine
    )
    assert summary["calls"] == [("add", '{"a": 17, "b": 25}')] and summary["answer"] is None


def test_agent_tools_required_makes_valid_calls(tiny_llama_512_dir: pathlib.Path, make_engine: Any):
    """tool_choice="required" end to end on the random model (512 positions: the tools in
    the prompt and a call fit): the grammar alone makes the first turn valid calls, each
    naming a function and matching its parameter schema, which the loop runs."""
    import jsonschema

    agent_tools = load("agent_tools")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in agent_tools.TOOLS}
    engine = make_engine(tiny_llama_512_dir, max_num_seqs=2)
    args = ["--tool-choice", "required", "--max-tokens", "200", "--max-turns", "1"]
    summary = agent_tools.main([*args, "--question", "17+25?"], engine)
    assert summary["calls"], summary
    for name, arguments in summary["calls"]:
        jsonschema.validate(json.loads(arguments), schemas[name])
