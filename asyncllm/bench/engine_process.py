"""One engine in its own process, driven by the benchmark orchestrator over stdin/stdout.

    python -m asyncllm.bench.engine_process --engine asyncllm|hf|hf_cb --model DIR [--threads N]
    VENV/bin/python path/to/asyncllm/bench/engine_process.py --engine vllm --model DIR
    VENV/bin/python path/to/asyncllm/bench/engine_process.py --engine llamacpp --model FILE.gguf

Each engine under test runs in a process of its own, so that its memory (RSS), its thread
settings and its failures stay its own, and vLLM and llama.cpp can run from virtual
environments of their own. This module's top level uses the standard library only: those
workers run it by path with their venv's interpreter, where asyncllm is not installed.
asyncllm's engine is in :mod:`asyncllm.bench.asyncllm_engine`, transformers' in ``hf_engines``.

Protocol: the worker writes ``@@READY@@ {json}`` once loaded, then for each JSON line it
reads on stdin (``{"op": "run", "spec": {...}}`` or ``{"op": "quit"}``) one ``@@RESULT@@
{json}`` line, on the file descriptor ``--result-fd`` (a pipe of its own, so that what the
engine and its child processes print cannot interleave with a result), else on stdout.

A run spec lists requests as ``[prompt token ids, max_tokens, arrival seconds]``; every
request is greedy and ignores EOS (exactly ``max_tokens`` new tokens) unless the spec has
``"ignore_eos": false``; ``"structured_outputs"`` (``StructuredOutputsParams`` fields, the
same names in asyncllm and vLLM) constrains every request. Each request is
streamed to a consumer that timestamps what it receives; the run is timed from the first
submission to the last token received.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

READY = "@@READY@@"
RESULT = "@@RESULT@@"


try:
    from asyncllm.bench.engine_protocol import (
        Timeline,
        Unsupported,
        child_pids,
        percentile,
        rss_mb,
    )
except ImportError:  # run by path in a peer's venv (no asyncllm): the file beside this one
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_protocol import (  # type: ignore[no-redef]
        Timeline,
        Unsupported,
        child_pids,
        percentile,
        rss_mb,
    )


async def lag_ticker(stop: asyncio.Event, lags: list[float], interval: float = 0.005) -> None:
    """Event-loop lag: how late a ``sleep(interval)`` wakes up, sampled continuously."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(time.perf_counter() - t - interval)


def lag_summary(lags: Sequence[float]) -> dict[str, float | None]:
    ms = [x * 1e3 for x in lags]
    return {
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "max": max(ms) if ms else None,
        "samples": len(ms),
    }


def greedy(spec: dict[str, Any], max_tokens: int, structured: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields of every request of a spec (the same names in asyncllm
    and vLLM): greedy, EOS ignored unless the spec says otherwise, and the spec's
    ``structured_outputs`` as a ``structured`` (the engine's params class), if any."""
    so = spec.get("structured_outputs")
    return {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": spec.get("ignore_eos", True),
        "structured_outputs": structured(**so) if so else None,
    }


async def drive_async(
    submit: Callable[[int, list[int], int, str | None], Any],
    spec: dict[str, Any],
) -> dict[str, Any]:
    """Run a spec against an async streaming engine.

    ``submit(i, ids, max_tokens, salt)`` returns an async iterator of ``(new token ids,
    prompt tokens served from the prefix cache or None)``.
    Requests with arrival 0 are submitted at once; others at their arrival offsets.
    """
    reqs = spec["requests"]
    tl = Timeline(len(reqs))
    salts = [uuid.uuid4().hex if spec.get("cache") == "off" else None for _ in reqs]
    stop = asyncio.Event()
    lags: list[float] = []
    ticker = asyncio.ensure_future(lag_ticker(stop, lags)) if spec.get("lag") else None
    start = time.perf_counter()

    async def one(i: int) -> None:
        ids, max_tokens, arrival = reqs[i]
        if arrival > 0:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        tl.submit[i] = time.perf_counter()
        async for new, cached in submit(i, ids, max_tokens, salts[i]):
            tl.got(i, new, time.perf_counter())
            if cached is not None:
                tl.cached[i] = cached

    try:
        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    finally:
        stop.set()
        if ticker is not None:
            await ticker
    out = tl.result(start, spec.get("outputs", False))
    if spec.get("lag"):
        out["loop_lag_ms"] = lag_summary(lags)
    return out


class VLLMWorker:
    """vLLM's ``AsyncLLM`` (V1 engine; on CPU its engine core runs in a child process),
    streaming deltas, as asyncllm is driven, in ``--dtype`` (float32 unless given). Runs
    under the vLLM venv's interpreter."""

    name = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.args = args
        t = time.perf_counter()
        eargs = AsyncEngineArgs(
            model=args.model,
            dtype=args.dtype or "float32",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_batch,
            enable_prefix_caching=True,
            disable_log_stats=True,
        )

        async def make() -> Any:
            return AsyncLLM.from_engine_args(eargs)

        self.engine = self.loop.run_until_complete(make())
        self.load_s = time.perf_counter() - t
        cfg = self.engine.vllm_config
        self.cfg = {
            "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
            "block_size": cfg.cache_config.block_size,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        }

    def info(self) -> dict[str, Any]:
        import torch
        import vllm

        return {
            "engine": self.name,
            "version": vllm.__version__,
            "torch": torch.__version__,
            "threads": self.cfg["omp_threads_bind"],
            "load_s": self.load_s,
            "rss_mb": rss_mb(child_pids()),
            "precision": self.cfg["dtype"],
        }

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        engine = self.engine
        run_id = uuid.uuid4().hex[:8]

        def submit(i: int, ids: list[int], max_tokens: int, salt: str | None) -> Any:
            params = SamplingParams(
                **greedy(spec, max_tokens, StructuredOutputsParams),
                output_kind=RequestOutputKind.DELTA,
            )
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if salt is not None:
                prompt["cache_salt"] = salt

            async def gen() -> Any:
                async for out in engine.generate(prompt, params, f"{run_id}-{i}"):
                    yield list(out.outputs[0].token_ids), out.num_cached_tokens

            return gen()

        async def main() -> dict[str, Any]:
            if spec.get("reset_prefix_cache", True):
                await engine.reset_prefix_cache()
            return await drive_async(submit, spec)

        res = self.loop.run_until_complete(main())
        res["settings"] = self.cfg
        res["rss_mb"] = rss_mb(child_pids())
        return res

    def close(self) -> None:
        self.engine.shutdown()


def _in_package(module: str, name: str) -> Callable[[argparse.Namespace], Any]:
    """A worker class of this package, imported when started (the peers' venvs lack it)."""

    def make(args: argparse.Namespace) -> Any:
        import importlib

        return getattr(importlib.import_module(f"asyncllm.bench.{module}"), name)(args)

    return make


def llamacpp_worker_class() -> Any:
    """:class:`~asyncllm.bench.llamacpp_worker.LlamaCppWorker`, from the package or, by path
    in the llama.cpp venv, from the file beside this one."""
    try:
        from asyncllm.bench.llamacpp_worker import LlamaCppWorker
    except ImportError:
        from llamacpp_worker import LlamaCppWorker  # type: ignore[no-redef]
    return LlamaCppWorker


WORKERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "asyncllm": _in_package("asyncllm_engine", "AsyncllmWorker"),
    "hf": _in_package("hf_engines", "HFStaticWorker"),
    "hf_cb": _in_package("hf_engines", "HFCBWorker"),
    "vllm": VLLMWorker,
    "llamacpp": lambda args: llamacpp_worker_class()(args),
}


_OUT = sys.stdout


def emit(tag: str, obj: Any) -> None:
    """One protocol line: ``tag`` and ``obj`` as JSON."""
    _OUT.write(f"{tag} {json.dumps(obj)}\n")
    _OUT.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncllm.bench.engine_process")
    ap.add_argument("--engine", required=True, choices=sorted(WORKERS))
    ap.add_argument(
        "--model", required=True, help="a Hugging Face directory (llamacpp: a .gguf file)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--config", default=None, help="asyncllm: EngineConfig fields as JSON")
    ap.add_argument("--dtype", default=None, help="vllm: its dtype (float32)")
    ap.add_argument("--prompts", default=None, help="llamacpp: prompts.json (tokenizer check)")
    ap.add_argument(
        "--extra-bufts", action="store_true", help="llamacpp: its extra buffer types (AMX)"
    )
    ap.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="llamacpp: prompt-lookup decoding, up to this many proposed tokens (0: off)",
    )
    ap.add_argument("--result-fd", type=int, default=None, help="write results to this fd")
    args = ap.parse_args(argv)
    global _OUT
    if args.result_fd is not None:
        _OUT = os.fdopen(args.result_fd, "w", buffering=1)
    try:
        worker = WORKERS[args.engine](args)
    except Exception as e:
        emit(READY, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    emit(READY, worker.info())
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            break
        t = time.perf_counter()
        try:
            res = worker.run(msg["spec"])
            res.setdefault("rss_mb", rss_mb())
        except Unsupported as e:
            res = {"skipped": str(e)}
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["elapsed_s"] = time.perf_counter() - t
        emit(RESULT, res)
    close = getattr(worker, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()
    return 0


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run by path: keep this folder's modules from shadowing others
    sys.exit(main())
