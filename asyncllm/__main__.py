"""Command line: ``python -m asyncllm generate "What is the capital of France?"``,
``python -m asyncllm bench`` (the benchmark harness, :mod:`asyncllm.bench`), and
``python -m asyncllm serve`` (the OpenAI-compatible server, :mod:`asyncllm.server`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a coroutine on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _generate(args: argparse.Namespace) -> int:
    from asyncllm import SamplingParams
    from asyncllm.config_args import engine_config_from_args
    from asyncllm.errors import InvalidRequestError
    from asyncllm.preflight import check_engine_config

    # Checked before torch is imported and the model loads (milliseconds, not the load's
    # seconds): a bad prompt, option or model path fails at once.
    if not args.prompt.strip():
        raise InvalidRequestError("the prompt is empty: give the text to answer")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    # One answer, then exit: a compiled forward built before is used, none is started (the
    # compile child would be stopped with the command before it finished).
    config = {"max_num_seqs": 1, "compile": "cached", **engine_config_from_args(args)}
    check_engine_config(args.model, config)
    from asyncllm.startup_report import start_engine

    engine = start_engine(args.model, config)
    tokenizer = engine.tokenizer
    if args.raw or not getattr(tokenizer, "chat_template", None):
        if not args.raw:  # a base model: say so rather than answer a question oddly
            print(
                "asyncllm: the model has no chat template: the prompt goes as it is",
                file=sys.stderr,
            )
        prompt: Any = args.prompt
    else:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    async def main() -> int:
        async with engine:
            if not isinstance(prompt, str) and len(prompt) >= engine.max_model_len:
                raise InvalidRequestError(
                    f"the prompt takes {len(prompt)} tokens with the chat template, and "
                    f"max_model_len is {engine.max_model_len}: --max-model-len must be at "
                    f"least {len(prompt) + 1} to generate a token"
                )
            start = time.perf_counter()
            first = None
            n_prompt = n_gen = 0
            async for out in engine.stream(prompt, params):
                if first is None:
                    first = time.perf_counter()
                print(out.text, end="", flush=True)
                n_prompt, n_gen = out.num_prompt_tokens, out.num_generated_tokens
            end = time.perf_counter()
        print(flush=True)  # the answer's line ends (stdout may be a file or a pipe)
        ttft = (first or end) - start
        decode_s = end - (first or end)
        rate = (n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0
        print(
            f"[prompt tokens {n_prompt} | generated tokens {n_gen} | TTFT {ttft:.3f} s "
            f"| {rate:.1f} tokens/s]",
            file=sys.stderr,
        )
        return 0

    return run_async(main)


def serve(args: argparse.Namespace) -> int:
    """The ``serve`` command (options: :func:`asyncllm.server.add_serve_arguments`): one
    process (:func:`asyncllm.server.serve`), or with ``--replicas N`` N replicas on Ray Serve
    (:func:`asyncllm.integrations.ray_serve.main`, which builds on the server); returns the
    exit code.

    Raises:
        ValueError: a bad engine field, model or chat template (checked before torch or Ray
            is imported).
    """
    from asyncllm import server

    if getattr(args, "replicas", None) is None:
        return server.serve(args)
    from asyncllm.config_args import engine_config_from_args
    from asyncllm.preflight import check_engine_config

    check_engine_config(args.model, engine_config_from_args(args))
    app_options = server.app_options_from_args(args)
    try:
        from asyncllm.integrations import ray_serve
    except ImportError as e:
        print(f"error: {e}; install the ray extra: pip install 'asyncllm[ray]'", file=sys.stderr)
        return 2
    return ray_serve.main(args, engine_config_from_args(args), app_options)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and run a subcommand; returns the exit code."""
    from asyncllm.config_args import add_engine_arguments

    parser = argparse.ArgumentParser(prog="python -m asyncllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    # every EngineConfig field (asyncllm.config_args) but the model and the engine's seed,
    # which --model and the sampling --seed stand for here
    add_engine_arguments(gen.add_argument_group("engine"), exclude=("model", "seed"))
    sub.add_parser(
        "bench",
        help="the standard workloads against asyncllm and its peers (see docs/benchmarks.md)",
        add_help=False,
    )
    sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (python -m asyncllm serve --help)",
        add_help=False,
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from asyncllm.bench.runner import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:
        try:
            from asyncllm.server import cli
        except ImportError as e:
            hint = "install the server extra: pip install 'asyncllm[server]'"
            print(f"error: {e}; {hint}", file=sys.stderr)
            return 2
        return cli.exit_code(serve, cli.parse_args(argv[1:]))
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except ValueError as e:  # our typed errors: bad model path, bad parameters
        from asyncllm.config_args import as_options

        print(f"error: {as_options(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the engine closed on the way out; no traceback
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
