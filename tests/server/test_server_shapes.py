"""The server's pure parts without a server or an engine: response bodies as msgspec
structs (the JSON keys OpenAI clients read, ``null`` versus left out), the command-line
options generated from ``EngineConfig``'s fields, and the server reading no private
attribute of the engine."""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
from typing import Any

import msgspec
import pytest

from asyncllm import EngineConfig
from asyncllm.config_args import (
    add_engine_arguments,
    as_options,
    engine_config_from_args,
    field_help,
)
from asyncllm.outputs import RequestOutput, ToolCall, ToolCallDelta
from asyncllm.server import add_serve_arguments
from asyncllm.server.drivers import Choice, accumulate, make_prompts
from asyncllm.server.endpoints import ChatShape, CompletionShape
from asyncllm.server.protocol import APIError
from asyncllm.server.responses import encode, usage


def _json(obj: msgspec.Struct) -> Any:
    return json.loads(encode(obj))


def _out(text: str, finish: str | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput(
        request_id="r", token_ids=[1] if text else [], text=text, finish_reason=finish,
        num_prompt_tokens=3, num_generated_tokens=2, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks(include_usage: bool) -> None:
    """The role chunk has no ``stop_reason``; ``usage`` is left out of chunks unless asked
    for, then null but in the last; a delta holds only the keys it carries."""
    shape = ChatShape("chatcmpl-x", 7, "m", False, 0, include_usage)
    choice = Choice(0, 0, 0)
    (role,) = [_json(c) for c in shape.preamble([choice])]
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]  # fmt: skip
    assert role["object"] == "chat.completion.chunk" and role["created"] == 7
    assert ("usage" in role) is include_usage and role.get("usage") is None
    assert shape.chunk(choice, _out(""), False) is None  # nothing to send
    chunk = shape.chunk(choice, _out("hi"), True)
    assert chunk is not None
    body = _json(chunk)
    assert body["choices"][0]["delta"] == {"content": "hi"}
    assert body["choices"][0]["stop_reason"] is None and ("usage" in body) is include_usage
    calls = [ToolCallDelta(0, "call_1", "f", '{"a"'), ToolCallDelta(0, None, None, ": 1}")]
    tool = shape.chunk(choice, _out("", tool_call_deltas=calls), False)
    assert tool is not None
    assert _json(tool)["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}}]}  # fmt: skip
    last = shape.usage_chunk(usage(3, 2, 0))
    if include_usage:
        assert last is not None
        assert _json(last)["choices"] == [] and _json(last)["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    else:
        assert last is None


def test_chat_body_with_tool_calls() -> None:
    """``content`` is null when the message was only calls; ``tool_calls`` is left out
    when there are none."""
    shape = ChatShape("chatcmpl-x", 7, "m", False, 0, False)
    prompts = make_prompts([["msgs"]], 2, "chatcmpl-x")
    a, b = prompts[0].choices
    accumulate(a, _out("", "tool_calls", tool_calls=[ToolCall("call_1", "f", "{}")]))
    accumulate(b, _out("text", "stop"))
    body = _json(shape.body([a, b]))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "text"}
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4


def test_completion_echo_and_usage() -> None:
    """``echo`` prefixes the first chunk of each choice only; streamed chunks are
    ``text_completion`` objects too."""
    shape = CompletionShape("cmpl-x", 7, "m", None, False)
    choice = Choice(0, 0, 0, prompt_text="P:")
    first = shape.chunk(choice, _out("a"), True)
    later = shape.chunk(choice, _out("b", "length"), False)
    assert first is not None and later is not None
    assert _json(first)["choices"][0]["text"] == "P:a" and "usage" not in _json(first)
    expected = {"index": 0, "text": "b", "logprobs": None, "finish_reason": "length",
                "stop_reason": None}  # fmt: skip
    assert _json(later)["choices"][0] == expected
    assert _json(later)["object"] == "text_completion"


def test_error_body() -> None:
    err = APIError("bad", 400, param="n")
    assert _json(err.body()) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


# ------------------------------------------------------------------ command line


def _serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def _value(field: str) -> tuple[str, Any]:
    """A command-line value for each EngineConfig field that differs from its default."""
    special: dict[str, tuple[str, Any]] = {
        "dtype": ("float16", "float16"), "device": ("cpu", "cpu"),
        "preemption_mode": ("recompute", "recompute"), "attention_backend": ("torch", "torch"),
        "compile": ("true", True), "shutdown_mode": ("drain", "drain"),
        "quantization": ("int8", "int8"), "quantization_group_size": ("64", 64),
        "enable_prefix_caching": ("", False), "prefix_cache_dir": ("kv-dir", "kv-dir"),
        "kv_cache_dtype": ("int8", "int8"),
        "speculative_tokens": ("3", 3),  # below max_num_batched_tokens (7)
        "tenant_weights": ("bot=2,apikey:ab=0.5", {"bot": 2.0, "apikey:ab": 0.5}),
    }  # fmt: skip
    return special.get(field, ("7", 7))


def test_every_engine_field_is_an_option() -> None:
    """Each EngineConfig field (but the model, which --model gives) is settable from
    ``serve``, reaches engine_config_from_args with the field's type, and builds a valid
    EngineConfig; options left out are not passed (the engine's defaults apply)."""
    assert engine_config_from_args(_serve()) == {}
    argv, expected = [], {}
    for name in EngineConfig.__struct_fields__:
        if name == "model":
            continue
        text, value = _value(name)
        flag = "--" + name.replace("_", "-")
        argv += [f"--no-{flag[2:]}"] if name == "enable_prefix_caching" else [flag, text]
        expected[name] = value
    config = engine_config_from_args(_serve(*argv))
    assert config == expected
    EngineConfig(**config)


def test_errors_name_the_option_that_was_typed() -> None:
    """A setting's error on the command line names the option (``--block-size``), not the
    config field; other names are left as they are."""
    got = as_options("EngineConfig.block_size must be >= 1; EngineConfig.nope; EngineConfig")
    assert got == "--block-size must be >= 1; EngineConfig.nope; EngineConfig"


def test_option_help_is_plain_text() -> None:
    """Each option's help is its field's first sentence without reST markup: the docstring's
    double backquotes and cross-references (``:mod:`asyncllm.core.host_store```) read as
    plain names in ``--help``."""
    helps = field_help()
    assert set(helps) == set(EngineConfig.__struct_fields__)
    for name, text in helps.items():
        assert text and not re.search(r"``|:\w+:`", text), (name, text)
    assert "asyncllm.core.host_store" in helps["host_prefix_cache_bytes"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--quantization", "none"], {"quantization": None}),
        (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
        (["--compile"], {"compile": True}),
        (["--compile", "auto"], {"compile": "auto"}),
        (["--no-prefix-caching"], {"enable_prefix_caching": False}),
        (["--max-waiting", "none"], {"max_waiting": None}),
        (["--kv-cache-bytes", "1024"], {"kv_cache_bytes": 1024}),
    ],
)
def test_existing_option_names(argv: list[str], expected: dict[str, Any]) -> None:
    assert engine_config_from_args(_serve(*argv)) == expected


@pytest.mark.parametrize(
    "argv",
    [["--quantization-group-size", "48"], ["--dtype", "float8"], ["--max-num-seqs", "x"],
     ["--compile", "maybe"], ["--quantization", "int3"], ["--port", "-5"],
     ["--port", "70000"], ["--tenant-weights", "a=x"], ["--tenant-weights", "a"]],
)  # fmt: skip
def test_bad_option_values_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _serve(*argv)


def test_generate_options_share_the_generator() -> None:
    """``generate`` takes the same engine options, its own --seed (sampling) aside."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=None)
    add_engine_arguments(parser, exclude=("model", "seed"))
    args = parser.parse_args(["--seed", "3", "--quantization", "none", "--max-model-len", "64"])
    assert engine_config_from_args(args) == {"quantization": None, "max_model_len": 64}


def test_server_reads_no_private_engine_attribute() -> None:
    """The server uses AsyncEngine's public API only: no ``x._name`` on anything but
    ``self``/``cls`` in asyncllm/server."""
    root = pathlib.Path(__file__).resolve().parents[2] / "asyncllm" / "server"
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
