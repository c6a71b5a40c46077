"""An OpenAI-compatible HTTP server over :class:`~asyncllm.AsyncEngine`.

Install the ``server`` extra (starlette, uvicorn, prometheus-client):
``pip install 'asyncllm[server]'``. Then, from the command line::

    python -m asyncllm serve --model default --host 127.0.0.1 --port 8000

or in code, as any ASGI app (its lifespan starts and stops the engine)::

    app = create_app(AsyncEngine.from_pretrained("default"), served_model_name="smollm2")
    uvicorn.run(app, host="127.0.0.1", port=8000)

With ``--replicas N`` (the ``ray`` extra) the same app runs on Ray Serve in front of N
replicas, with prefix-cache-aware routing (:mod:`asyncllm.integrations.ray_serve`,
docs/scaling.md).

Any OpenAI client works against it::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="default", messages=[...], stream=True)

Security (each ``serve`` option is also a keyword of :func:`create_app`, underscores for
dashes):

- ``--api-key KEY`` (repeat it, or separate keys with commas; without it the
  ``ASYNCLLM_API_KEY`` environment variable, comma-separated; ``create_app(api_keys=...)``):
  every route but ``/health`` requires ``Authorization: Bearer KEY`` (OpenAI clients send
  their ``api_key`` so), else 401 ``invalid_api_key``. Keys are compared in constant time
  (``hmac.compare_digest``, against every key). ``/metrics`` too, unless
  ``--metrics-without-auth``. Without keys the server is open to whoever reaches it: keep
  the default ``--host 127.0.0.1``.
- ``--max-request-bytes N`` (default 4 MiB): a larger body answers 413
  ``request_too_large``; the body is read in chunks and reading stops at the limit, whatever
  ``Content-Length`` says or when it is absent.
- POST bodies must be ``Content-Type: application/json`` (parameters such as ``charset``
  allowed), else 415 ``unsupported_media_type``: a web page cannot make a browser post to
  the server without a CORS preflight. ``--allowed-origins ORIGIN`` (repeat it or
  comma-separate; ``*`` for any) lets browser pages from those origins call the server
  (Starlette's ``CORSMiddleware``); none by default.
- ``--trust-request-chat-template``: without it (the default) a request's own
  ``chat_template`` (top level or in ``chat_template_kwargs``) answers 400, since a template
  is a program the server runs (as vLLM's flag of the same name).
- ``--client-priority-range MIN,MAX`` (``MIN <= 0 <= MAX``; write
  ``--client-priority-range=-5,5`` for a negative MIN): the ``priority`` values a request
  may ask for (lower is served first), else 400 naming the range. The default ``0,0`` lets
  no client jump ahead of others.
- Prefix-cache isolation: with API keys, requests made with different keys never share
  prefix-cache blocks (each key's requests get a ``cache_salt`` derived from a SHA-256
  digest of the key, combined with any ``cache_salt`` the request sends), since a prefix
  hit's speed tells a client about other clients' prompts.
  ``--share-prefix-cache-across-keys`` shares them (more hits, less isolation).

Endpoints:

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one served model (its ``id`` is
  ``--served-model-name``, default the base name of the ``--model`` directory or file, or
  the ``--model`` value, e.g. "default"; also ``max_model_len``).
- ``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or a list
  of token-id lists (one choice per prompt and sample, index = prompt x n + sample).
  ``max_tokens`` defaults to 16. ``echo`` prepends the prompt; ``logprobs`` (0-20) returns
  OpenAI's legacy logprobs object. ``suffix``, and ``echo`` with ``logprobs``, answer 400.
- ``response_format`` (both generation endpoints): ``{"type": "text"}`` (the default),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}`` constrains decoding (``SamplingParams.structured_outputs``,
  xgrammar); a complete document ends with ``finish_reason`` "stop", one cut by
  ``max_tokens`` with "length". Another type, a malformed ``json_schema`` or a schema the
  grammar engine cannot compile answers 400 with ``param`` "response_format".
- ``POST /v1/chat/completions``: ``messages`` are rendered by the model's chat template (text
  content parts are joined; the "developer" role is sent as "system");
  ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of ``max_model_len``;
  ``logprobs`` with ``top_logprobs`` (0-20). Tool calling as OpenAI's: ``tools`` (function
  tools; a malformed one, e.g. ``parameters`` that is not a JSON schema of an object, answers
  400 with ``param`` "tools"), ``tool_choice`` ("auto", "none", "required" or a named function;
  a name no tool has answers 400, ``param`` "tool_choice") and ``parallel_tool_calls``; the
  conversation may hold assistant messages with ``tool_calls`` and ``role: "tool"`` messages
  with ``tool_call_id``. The model's calls are parsed from its output in its chat template's
  format (see ``asyncllm.engine.tool_calls``; a template without tool support answers 400):
  ``message.tool_calls`` (``content`` null when the message was only calls) and
  ``finish_reason`` "tool_calls"; streamed, a call's first ``delta.tool_calls`` item has
  ``index``, ``id``, ``type`` and ``function.name`` (sent once the name is generated), and
  later items ``function.arguments`` pieces as they are generated, which join to the
  call's arguments. "required" and a named function constrain decoding with a
  grammar: the message is only tool calls, each naming an allowed function with
  ``arguments`` that match its ``parameters`` schema (``finish_reason`` "length" if
  ``max_tokens`` cuts one short); combined with a ``response_format`` they answer 400.
  ``add_generation_prompt`` and ``chat_template_kwargs`` go to the template;
  ``chat_template_kwargs`` holds template variables only (``enable_thinking``...): an
  ``apply_chat_template`` option (``chat_template``, ``tokenize``, ``return_dict``, ``tools``,
  ``documents``, ``truncation``...) there answers 400 (``chat_template`` is allowed with
  ``--trust-request-chat-template``, as is a top-level ``chat_template``).
- Logprobs name each token by its own bytes (the tokenizer's token-to-bytes mapping): chat
  ``bytes`` are those bytes, and a token that holds part of a UTF-8 character is named
  OpenAI's way, ``"bytes:\\xe6"`` (``bytes`` ``[230]``); the legacy ``text_offset`` is in
  characters, the pieces of one character sharing its offset.
- ``GET /health``: 200 ``{"status": "running"}``; 503 once the engine has failed. Needs no
  API key.
- ``GET /metrics``: Prometheus text format (see Metrics).

Both generation endpoints take ``model`` (must equal the served name, else 404
``model_not_found``; may be left out), ``temperature`` (default 1), ``top_p``, ``n``
(parallel samples sharing the prompt's KV blocks; at most 128 choices per request),
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``user``
(ignored), ``stream`` and ``stream_options.include_usage``; and, as vLLM does (with the
``openai`` client: ``extra_body``), ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, plus the engine's ``priority`` (lower is served first; within
``--client-priority-range``) and ``cache_salt`` (within the API key's own cache space). Other
fields are ignored. Each maps to the
:class:`~asyncllm.SamplingParams` field of the same name and range.

Responses: ``finish_reason`` is "stop" (EOS, a stop string or token; ``stop_reason`` names
which), "tool_calls" (chat with tools: the model made calls and stopped) or "length".
``usage`` has ``prompt_tokens`` (once per prompt), ``completion_tokens`` (all choices),
``total_tokens`` and ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the
prefix cache).

Streaming (``stream: true``): server-sent events ``data: {chunk}``, ended by
``data: [DONE]``. Chat streams start with one chunk per choice whose delta is
``{"role": "assistant", "content": ""}``; a choice's last chunk carries its
``finish_reason``. ``usage`` is sent, as OpenAI does, only with
``stream_options: {"include_usage": true}``: then in a last chunk with empty ``choices``
(every other chunk has ``"usage": null``). The status and headers are sent when the first
output is ready, so a request that fails validation still gets its status code. If the
engine fails mid-stream, a last event ``data: {"error": {...}}`` is sent (with the 503's
fixed message).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` for any malformed body (not JSON, invalid UTF-8, empty, not an
object, nested too deeply, in any field), a field of the wrong type or out of range
(``param`` names it), an empty or too long prompt, token ids outside the vocabulary; 401
without a valid API key; 404 for an unknown model or route (405: wrong method); 413 past
``--max-request-bytes``; 415 for a body that is not ``application/json``; 429
``rate_limit_exceeded`` when ``EngineConfig.max_waiting`` requests already wait; 503
``server_error`` once the engine has failed (``EngineDeadError``) or while it is not
running; 500 ``server_error`` for anything unexpected. A 5xx carries a fixed message
(never the exception's text, a Python repr or a path); the details go to the server log
(logger ``asyncllm.server``).

Client disconnects: a client that goes away (closing a stream, or timing out on a
non-streamed request) aborts its engine requests, and their KV blocks are free before the
next step; ``asyncllm:request_success_total{finished_reason="abort"}`` counts them (once
per request, whatever its ``n``: see Metrics for what each metric counts).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from asyncllm.__main__ import add_precision_args
from asyncllm.server.app import (
    DEFAULT_MAX_REQUEST_BYTES,
    OpenAIServer,
    create_app,
    split_commas,
)

__all__ = ["OpenAIServer", "add_serve_arguments", "app_options_from_args", "create_app", "main",
           "serve"]  # fmt: skip

#: The environment variable ``serve`` reads API keys from (comma-separated) when no
#: ``--api-key`` is given.
API_KEY_ENV = "ASYNCLLM_API_KEY"


def _priority_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not lo <= 0 <= hi:
        raise argparse.ArgumentTypeError(f"need MIN <= 0 <= MAX, got {text!r}")
    return lo, hi


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options."""
    parser.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the --model directory or file's "
        "base name, or the --model value)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--max-waiting", type=int, default=None, help="past it: HTTP 429")
    parser.add_argument("--device", default=None, help='"auto", "cpu", "cuda" or "cuda:N"')
    parser.add_argument("--no-prefix-caching", action="store_true")
    add_precision_args(parser)
    parser.add_argument("--log-level", default="info")
    scale = parser.add_argument_group("replicas on Ray Serve (the ray extra; docs/scaling.md)")
    scale.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        metavar="N",
        help="serve N replicas of the model on Ray Serve (a local Ray instance, or the "
        "cluster of $RAY_ADDRESS) with prefix-cache-aware routing",
    )
    scale.add_argument(
        "--router",
        choices=["prefix", "default"],
        default="prefix",
        help="with --replicas: prefix-cache-aware routing, or Ray Serve's default "
        "power-of-two-choices router",
    )
    scale.add_argument(
        "--replica-threads",
        type=_positive_int,
        default=1,
        metavar="T",
        help="with --replicas: torch threads (and Ray CPUs) per replica (default 1)",
    )
    sec = parser.add_argument_group("security")
    sec.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on every route but /health; repeat it or "
        f"separate keys with commas (default: ${API_KEY_ENV}, else no authentication)",
    )
    sec.add_argument(
        "--metrics-without-auth", action="store_true", help="serve /metrics without a key"
    )
    sec.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"largest request body read; past it: 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    sec.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (a program the server runs)",
    )
    sec.add_argument(
        "--client-priority-range",
        type=_priority_range,
        default=(0, 0),
        metavar="MIN,MAX",
        help="the `priority` values requests may ask for, MIN <= 0 <= MAX (lower is served "
        "first); outside: 400 (default 0,0: none may jump ahead)",
    )
    sec.add_argument(
        "--share-prefix-cache-across-keys",
        action="store_true",
        help="let requests made with different API keys share prefix-cache blocks (by "
        "default each key hits only its own, since a hit's speed tells about others' prompts)",
    )
    sec.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="origins browsers may call the server from (CORS); repeat it or separate with "
        "commas; '*' for any (default: none)",
    )


def engine_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~asyncllm.EngineConfig` fields the options set."""
    config: dict[str, Any] = {}
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "block_size",
        "kv_cache_bytes",
        "max_waiting",
        "dtype",
        "device",
    ):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "no_prefix_caching", False):
        config["enable_prefix_caching"] = False
    if hasattr(args, "quantization"):  # None ("none") is a setting here, not "unset"
        config["quantization"] = args.quantization
        config["quantization_group_size"] = args.quantization_group_size
    return config


def app_options_from_args(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    """The :func:`create_app` keywords the options set (API keys from ``--api-key``, else
    from ``$ASYNCLLM_API_KEY``)."""
    env = os.environ if environ is None else environ
    keys = split_commas(getattr(args, "api_key", None))
    if not keys:
        keys = split_commas(env.get(API_KEY_ENV))
    return {
        "api_keys": keys,
        "metrics_without_auth": getattr(args, "metrics_without_auth", False),
        "max_request_bytes": getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        "trust_request_chat_template": getattr(args, "trust_request_chat_template", False),
        "client_priority_range": getattr(args, "client_priority_range", (0, 0)),
        "share_prefix_cache_across_keys": getattr(args, "share_prefix_cache_across_keys", False),
        "allowed_origins": split_commas(getattr(args, "allowed_origins", None)),
    }


def serve(args: argparse.Namespace) -> int:
    """Load the model and serve it with uvicorn until interrupted; returns the exit code."""
    if getattr(args, "replicas", None) is not None:
        try:
            from asyncllm.integrations import ray_serve
        except ImportError as e:
            print(
                f"error: {e}; install the ray extra: pip install 'asyncllm[ray]'", file=sys.stderr
            )
            return 2
        return ray_serve.main(args, engine_config_from_args(args), app_options_from_args(args))

    import uvicorn

    from asyncllm import AsyncEngine

    engine = AsyncEngine.from_pretrained(args.model, **engine_config_from_args(args))
    app = create_app(engine, args.served_model_name, **app_options_from_args(args))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncllm serve [options]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm serve", description="An OpenAI-compatible HTTP server."
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except ValueError as e:  # our typed errors: bad model path, bad engine settings
        print(f"error: {e}", file=sys.stderr)
        return 2
