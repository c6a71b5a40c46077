"""Soak test of ``python -m asyncllm serve``: bursts of streaming clients, RSS after each.

    python benchmarks/soak_server.py [--bursts 6] [--clients 200] [--model tiny|default|DIR]
                                     [--max-tokens 48] [--disconnect-every 4] [--json OUT]

Starts the server in a subprocess on 127.0.0.1 (a free port), on a tiny random-weight Llama
(2 layers, SmolLM2's tokenizer; built once in a temporary folder) unless ``--model`` says
otherwise. Each burst opens ``--clients`` concurrent streaming ``/v1/completions`` requests
(distinct prompts, greedy, ``ignore_eos``; every ``--disconnect-every``-th client hangs up
after its first chunk, which aborts its request). After each burst it waits until the
engine is idle, then reads the server's resident set size (``VmRSS`` of /proc/PID/status),
its KV cache usage and running/waiting gauges from ``/metrics``.

A leak shows as RSS that keeps growing burst after burst; allocator caching shows as a rise
over the first bursts that then stays flat. The last line says which (growth over the last
half of the bursts, MiB). Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def build_tiny_model(path: pathlib.Path) -> pathlib.Path:
    """The tiny random Llama (``asyncllm.bench.tiny_model``) saved at ``path``."""
    from asyncllm.bench.tiny_model import save_tiny_llama
    from asyncllm.models.loader import resolve_model_dir

    return save_tiny_llama(path, resolve_model_dir("default"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (Linux /proc)."""
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    assert match is not None
    return int(match.group(1)) / 1024


def gauge(metrics: str, name: str) -> float:
    """The value of an unlabelled-or-model-labelled Prometheus gauge in ``metrics``."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
    return float(match.group(1)) if match else float("nan")


async def one_client(
    client: httpx.AsyncClient, i: int, burst: int, max_tokens: int, hang_up: bool
) -> int:
    """One streaming completion; returns the number of SSE data events read."""
    body = {
        "prompt": f"Soak burst {burst} client {i}: tell me about the number {i * 7919 % 1000}.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if hang_up or line == "data: [DONE]":
                    break
    return events


async def wait_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> str:
    """Poll /metrics until no request runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        busy = gauge(text, "asyncllm:num_requests_running") + gauge(
            text, "asyncllm:num_requests_waiting"
        )
        if busy == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.2)


async def soak(args: argparse.Namespace, base_url: str, pid: int) -> list[dict[str, Any]]:
    rows = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await wait_idle(client)
        rows.append({"burst": 0, "rss_mib": rss_mib(pid), "seconds": 0.0, "errors": 0})
        print(f"burst 0 (before): RSS {rows[0]['rss_mib']:.1f} MiB", flush=True)
        for burst in range(1, args.bursts + 1):
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(
                    one_client(client, i, burst, args.max_tokens, i % args.disconnect_every == 0)
                    for i in range(args.clients)
                ),
                return_exceptions=True,
            )
            seconds = time.monotonic() - t0
            errors = [r for r in results if isinstance(r, BaseException)]
            metrics = await wait_idle(client)
            row = {
                "burst": burst,
                "rss_mib": rss_mib(pid),
                "seconds": seconds,
                "errors": len(errors),
                "kv_cache_usage": gauge(metrics, "asyncllm:kv_cache_usage_perc"),
            }
            rows.append(row)
            print(
                f"burst {burst}: {seconds:5.1f} s, {len(errors)} errors"
                f"{' (' + repr(errors[0]) + ')' if errors else ''}, "
                f"RSS {row['rss_mib']:.1f} MiB, KV cache usage {row['kv_cache_usage']:.3f}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--disconnect-every", type=int, default=4)
    ap.add_argument("--model", default="tiny", help='"tiny" (random weights), "default" or DIR')
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve option")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    if args.bursts < 1 or args.clients < 1 or args.disconnect_every < 1:
        ap.error("--bursts, --clients and --disconnect-every must be >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            model = str(build_tiny_model(pathlib.Path(tmp) / "tiny"))
        port = free_port()
        cmd = [sys.executable, "-m", "asyncllm", "serve", "--model", model]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        cmd += ["--max-waiting", str(max(1024, args.clients)), *args.server_arg]
        server = subprocess.Popen(cmd, env=os.environ.copy())
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    print("error: the server exited", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print("error: the server did not start in 120 s", file=sys.stderr)
                    return 1
                time.sleep(0.5)
            rows = asyncio.run(soak(args, base_url, server.pid))
        finally:
            server.terminate()
            server.wait(30)
    half = rows[len(rows) // 2]["rss_mib"]
    growth_last_half = rows[-1]["rss_mib"] - half
    print(
        f"RSS {rows[0]['rss_mib']:.1f} -> {rows[1]['rss_mib']:.1f} (first burst) -> "
        f"{rows[-1]['rss_mib']:.1f} MiB (last); last half of the bursts: "
        f"{growth_last_half:+.1f} MiB"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
