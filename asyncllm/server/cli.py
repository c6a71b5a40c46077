"""The ``python -m asyncllm serve`` command line (see :mod:`asyncllm.server` for what the
options do)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm import envs
from asyncllm.chat_templates import load_chat_template
from asyncllm.config_args import add_engine_arguments, as_options, engine_config_from_args
from asyncllm.preflight import check_engine_config
from asyncllm.server.app import create_app
from asyncllm.server.security import DEFAULT_MAX_REQUEST_BYTES, split_commas

__all__ = ["add_serve_arguments", "app_options_from_args", "engine_config_from_args", "main",
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
    """The ``serve`` subcommand's options: the server's, one per
    :class:`~asyncllm.EngineConfig` field (:mod:`asyncllm.config_args`), replicas and
    security."""
    parser.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (8000)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the --model directory or file's "
        "base name, or the --model value)",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="the chat template of /v1/chat/completions instead of the model's: a built-in "
        'one ("hermes": ChatML with Hermes-style tool calling, for a model whose own template '
        "has no tool support, such as the default model's) or a Jinja file",
    )
    add_engine_arguments(parser.add_argument_group("engine (EngineConfig's fields)"))
    _add_replica_arguments(parser)
    _add_security_arguments(parser)


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--tenant-header",
        metavar="NAME",
        help="a request header naming the request's tenant (fair shares between tenants; "
        "set by a gateway you trust); default: the API key's tenant, else one shared tenant",
    )
    sec.add_argument(
        "--admission",
        choices=("refuse", "wait"),
        default="refuse",
        help="when the waiting queue is full: refuse (429, the default) or wait for a place",
    )
    sec.add_argument(
        "--queue-events",
        action="store_true",
        help="streamed requests get SSE comments with their queue position and estimated "
        "start before their first token",
    )
    sec.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="origins browsers may call the server from (CORS); repeat it or separate with "
        "commas; '*' for any (default: none)",
    )


def app_options_from_args(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    """The :func:`create_app` keywords the options set (API keys from ``--api-key``, else
    from ``$ASYNCLLM_API_KEY``; the ``--chat-template`` read, its text).

    Raises:
        ValueError: a ``--chat-template`` that names no built-in template or file.
    """
    template = getattr(args, "chat_template", None)
    keys = split_commas(getattr(args, "api_key", None))
    if not keys:
        value = envs.text(API_KEY_ENV) if environ is None else environ.get(API_KEY_ENV)
        keys = split_commas(value)
    return {
        "api_keys": keys,
        "metrics_without_auth": getattr(args, "metrics_without_auth", False),
        "max_request_bytes": getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        "trust_request_chat_template": getattr(args, "trust_request_chat_template", False),
        "client_priority_range": getattr(args, "client_priority_range", (0, 0)),
        "share_prefix_cache_across_keys": getattr(args, "share_prefix_cache_across_keys", False),
        "allowed_origins": split_commas(getattr(args, "allowed_origins", None)),
        "chat_template": None if template is None else load_chat_template(template),
        "tenant_header": getattr(args, "tenant_header", None),
        "admission": getattr(args, "admission", "refuse"),
        "queue_events": getattr(args, "queue_events", False),
    }


def freeze_loaded_objects() -> None:
    """Collect, then move every object the process holds into the permanent generation
    (``gc.freeze``): for a process that serves one engine until it exits, whose loaded
    objects (torch's, transformers', the model's: about half a million) live as long as it
    does. A full collection then walks only what was made since, instead of pausing a
    stream for all of them (docs/tuning.md, "Gemma 3's prefill"). Not for a process that
    builds and drops engines: a frozen object is never collected."""
    gc.collect()
    gc.freeze()


def serve(args: argparse.Namespace) -> int:
    """Load the model and serve it with uvicorn in this process until interrupted; returns
    the exit code. ``--replicas`` (Ray Serve) is served by the command line above this
    package (:func:`asyncllm.__main__.serve`), which builds on it.

    The engine's fields, the model source and ``--chat-template`` are checked first, before
    torch is imported (:func:`asyncllm.preflight.check_engine_config`).

    Raises:
        ValueError: a bad engine field, model (the typed errors of the model loader) or
            chat template; ``--replicas`` given.
    """
    if getattr(args, "replicas", None) is not None:
        raise ValueError(
            "--replicas serves on Ray Serve: run `python -m asyncllm serve --replicas N` "
            "(asyncllm.__main__.serve)"
        )
    check_engine_config(args.model, engine_config_from_args(args))
    app_options = app_options_from_args(args)

    import uvicorn

    from asyncllm.startup_report import start_engine

    engine = start_engine(args.model, engine_config_from_args(args))
    app = create_app(engine, args.served_model_name, **app_options)
    freeze_loaded_objects()

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn waits for open responses before the lifespan leaves the engine:
            # aborted first, streams end with their final event instead of being cut
            # after the grace period (with a traceback in the log).
            engine.begin_shutdown()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        Server(config).run()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``python -m asyncllm serve`` options (:func:`add_serve_arguments`) of ``argv``."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm serve", description="An OpenAI-compatible HTTP server."
    )
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def exit_code(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``'s exit code; 2 with the message on stderr for a ``ValueError``
    (our typed errors: bad model path, bad engine settings; settings named as the options
    that set them)."""
    try:
        return command(args)
    except ValueError as e:
        print(f"error: {as_options(str(e))}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncllm serve [options]`` in this process (no ``--replicas``); returns
    the exit code."""
    return exit_code(serve, parse_args(argv))


def _port(text: str) -> int:
    """A TCP port for argparse (0: the OS picks one)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0-65535, got {port}")
    return port
