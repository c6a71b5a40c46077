"""asyncllm's engine for the benchmark, in a process of its own (run by
:mod:`asyncllm.bench.engine_process`), and its per-step trace (:class:`Tracer`)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncllm.bench.engine_process import drive_async, greedy, rss_mb

#: The core's counters a run reports as differences (``AsyncEngine.stats``).
STAT_DELTAS = (
    "num_preemptions", "num_swapped_out_blocks", "num_swapped_in_blocks",
    "num_recomputed_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_steps",
    "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_steps",
)  # fmt: skip


class AsyncllmWorker:
    """asyncllm's AsyncEngine in this process; the model is loaded once, in ``--config``'s
    dtype, and shared by the engine configurations the specs ask for (one KV cache alive at a
    time). Each engine is built on its own compute thread, as ``LLMEngine.from_config`` does
    (the thread that loaded the model has exited by then). With a ``quantization`` in
    ``--config``, each engine is built by ``LLMEngine.from_config`` itself (the engine's own
    loading and quantizing path), from ``--model`` as the user named it.

    A compiled forward (``EngineConfig.compile``, "auto" on CPU) is waited for when an
    engine is built, before any run of it, so the measured runs step through the compiled
    forward (or, when the compile failed, eagerly); each run's settings name the compile
    state and its seconds (``compile``, ``compile_s``)."""

    name = "asyncllm"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from asyncllm.engine.llm_engine import ComputeThread
        from asyncllm.models.loader import load_model, stored_dtype
        from asyncllm.worker.device import resolve_dtype

        self.base = json.loads(args.config or "{}")
        self.threads = args.threads
        self.model = args.model
        self._engines: dict[str, Any] = {}
        self.loaded: Any = None
        t = time.perf_counter()
        if self.base.get("quantization", "auto") is not None:
            self.engine({})  # loads (and quantizes) the model as EngineConfig's default does
        else:
            dtype = resolve_dtype(
                self.base.get("dtype", "auto"), torch.device("cpu"), stored_dtype(args.model)
            )

            def load() -> Any:
                torch.set_num_threads(args.threads)
                return load_model(args.model, dtype=dtype, device=torch.device("cpu"))

            loader = ComputeThread()
            self.loaded = loader.submit(load).result()
            loader.shutdown(wait=True)
        self.load_s = time.perf_counter() - t

    def info(self) -> dict[str, Any]:
        import torch

        import asyncllm

        loaded = self.engine({}).core.loaded if self.loaded is None else self.loaded
        dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
        # what ran: the dtype, or the quantization the loader applied ("auto" resolved)
        precision = loaded.precision
        quant = None if precision == dtype else precision
        return {
            "engine": self.name,
            "version": asyncllm.__version__,
            "torch": torch.__version__,
            "threads": self.threads,
            "load_s": self.load_s,
            "rss_mb": rss_mb(),
            "dtype": dtype,
            "quantization": quant,
            "precision": f"{dtype}, {quant}" if quant else dtype,
            "weight_bytes": loaded.weight_bytes,
        }

    def engine(self, overrides: dict[str, Any]) -> Any:
        from asyncllm import AsyncEngine, EngineConfig
        from asyncllm.engine.llm_engine import ComputeThread, LLMEngine

        cfg = {**self.base, **overrides}
        key = json.dumps(cfg, sort_keys=True)
        if key not in self._engines:
            self._engines.clear()  # one KV cache at a time
            gc.collect()
            if self.loaded is None:
                config = EngineConfig(model=self.model, num_threads=self.threads, **cfg)
                core = LLMEngine.from_config(config)
            else:
                config = EngineConfig(model=str(self.loaded.model_dir), **cfg)
                compute = ComputeThread()
                core = compute.submit(LLMEngine, config, self.loaded, compute).result()
            wait_for_compile(core)
            self._engines[key] = AsyncEngine(core)
        return self._engines[key]

    def settings(self, engine: Any) -> dict[str, Any]:
        c = engine.config
        core = engine.core
        return {
            "dtype": str(core.kv_cache.spec.dtype).replace("torch.", ""),
            "block_size": c.block_size,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "kv_blocks": core.block_manager.num_total_blocks,
            "kv_layout": core.stats()["kv_layout"],
            "kv_cache_mib": round(core.kv_cache.num_bytes / 2**20, 1),
            "prefix_caching": c.enable_prefix_caching,
            "preemption_mode": c.preemption_mode,
            "attention": core.runner.attention_backend.name,
            "packed_linears": getattr(core.runner, "num_packed_linears", 0),
            "quantization": getattr(c, "quantization", None),
            "compile": core.stats()["compile"],
            "compile_s": round(float(core.stats()["compile_seconds"]), 1),
            "threads": self.threads,
        }

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        from asyncllm import SamplingParams
        from asyncllm.sampling_params import StructuredOutputsParams

        engine = self.engine(spec.get("engine_config") or {})
        if spec.get("reset_prefix_cache", True):
            engine.core.reset_prefix_cache()
        tracer = Tracer(engine) if spec.get("trace") else None

        def submit(i: int, ids: list[int], max_tokens: int, salt: str | None) -> Any:
            params = SamplingParams(**greedy(spec, max_tokens, StructuredOutputsParams))

            async def gen() -> Any:
                async for out in engine.stream(ids, params, cache_salt=salt):
                    yield out.token_ids, out.num_cached_tokens

            return gen()

        async def main() -> dict[str, Any]:
            async with engine:
                before = engine.stats()
                if tracer is not None:
                    tracer.install()
                try:
                    res = await drive_async(submit, spec)
                finally:
                    if tracer is not None:
                        tracer.uninstall()
                after = engine.stats()
            res["stats"] = {k: after[k] - before[k] for k in STAT_DELTAS}
            q = res["stats"]["prefix_cache_queries"]
            res["stats"]["prefix_cache_hit_rate"] = (
                res["stats"]["prefix_cache_hits"] / q if q else 0
            )
            return res

        res = run_loop(main)
        res["settings"] = self.settings(engine)
        if tracer is not None:
            res["trace"] = tracer.report()
        return res


#: The longest a benchmark engine's compile is waited for (seconds); past it the runs go on
#: eagerly, and the settings say "compiling".
COMPILE_WAIT_S = 900.0


def wait_for_compile(core: Any) -> None:
    """Block until ``core``'s background compile ended (ready or failed), if it has one."""
    compiled = core.runner.compiled
    if compiled is not None and not compiled.wait(COMPILE_WAIT_S):
        logging.getLogger("asyncllm").warning(
            "asyncllm: compile not done after %.0f s; running eagerly", COMPILE_WAIT_S
        )


def run_loop(main: Callable[[], Any]) -> Any:
    """asyncio.run on uvloop when installed (as ``python -m asyncllm`` does)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _main_thread_cpu() -> Callable[[], float] | None:
    """A clock of the main thread's CPU time (seconds; the event loop's thread), readable
    from another thread; None where the platform has none (``pthread_getcpuclockid``)."""
    try:
        clock = time.pthread_getcpuclockid(threading.main_thread().ident or 0)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock)


class Tracer:
    """Per-step trace of one asyncllm engine through its step hook
    (``LLMEngine.step_observer``, :mod:`asyncllm.worker.step_timing`); the engine is not
    patched, and the hook is unset again after the run.

    Records per step: its start ``t0`` and wall time ``step``; the hook's phases
    (``schedule``, ``update``, the runner's ``prep``, ``forward`` and ``sample`` and their
    sum ``execute``; with constrained requests ``grammar_fill`` and ``grammar_accept``, the
    grammar's mask being part of ``sample``); the batch shape; the KV blocks held against
    the tokens in use; ``dispatch``: the event loop's turn after the step until the next one
    starts (detokenization, stop strings, posting to the request states, the inbox and the
    hand-off to the compute thread); ``loop_cpu``: the main thread's CPU time since the
    previous step ended (the event loop: dispatch, delivery to the consumers, the inbox).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.core = engine.core
        self.steps: list[dict[str, float]] = []
        self._cpu = _main_thread_cpu()
        self._cpu0 = self._cpu() if self._cpu is not None else 0.0
        self._end = 0.0

    def __call__(self, timings: Any, plan: Any) -> None:
        """The step observer: one record per step (on the compute thread)."""
        ph = timings.phases
        s = dict(ph)
        s["execute"] = ph.get("prep", 0.0) + ph.get("forward", 0.0) + ph.get("sample", 0.0)
        s["t0"], s["step"] = timings.start, timings.end - timings.start
        s["tokens"] = float(plan.num_batched_tokens)
        s["batch"] = float(len(plan.chunks))
        if self.steps:
            self.steps[-1]["dispatch"] = timings.start - self._end
        if self._cpu is not None:
            cpu = self._cpu()
            s["loop_cpu"], self._cpu0 = cpu - self._cpu0, cpu
        s.update(self.kv_sample())
        self.steps.append(s)
        self._end = time.perf_counter()

    def install(self) -> None:
        self.core.step_observer = self

    def uninstall(self) -> None:
        self.core.step_observer = None

    def kv_sample(self) -> dict[str, float]:
        """Blocks held, and the tokens in use (distinct filled slots of the held blocks, in
        every layer group's table)."""
        bm = self.core.block_manager
        bs = bm.block_size
        filled: dict[int, int] = {}
        for r in self.core.scheduler.running:
            n = r.num_computed_tokens
            for g, table in enumerate(bm.block_tables(r.request_id)):
                for j in range(bm.live_from(r.request_id, g), len(table)):
                    b = table[j]
                    k = min(bs, max(0, n - j * bs))
                    if k > filled.get(b, -1):
                        filled[b] = k
        return {
            "blocks_held": float(bm.num_total_blocks - bm.num_free_blocks),
            "tokens_in_use": float(sum(filled.values())),
            "computed_tokens": float(
                sum(r.num_computed_tokens for r in self.core.scheduler.running)
            ),
        }

    def report(self) -> dict[str, Any]:
        spec = self.core.kv_cache.spec
        return {
            "steps": self.steps,
            "block_size": self.core.block_manager.block_size,
            "bytes_per_token": spec.bytes_per_token,
            "grammar_compiler": self.core.grammar_compiler.stats(),
        }
