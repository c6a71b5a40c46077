"""One engine in its own process, driven by the benchmark orchestrator over stdin/stdout.

    python -m asyncllm.bench.worker --engine asyncllm|hf|hf_cb --model DIR [--threads N]
    VENV/bin/python path/to/asyncllm/bench/worker.py --engine vllm --model DIR
    VENV/bin/python path/to/asyncllm/bench/worker.py --engine llamacpp --model FILE.gguf

Each engine under test runs in a process of its own, so that its memory (RSS), its thread
settings and its failures stay its own, and vLLM and llama.cpp can run from virtual
environments of their own. This module's top level uses the standard library only: those
workers run it by path with their venv's interpreter, where asyncllm is not installed.

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
import ctypes
import gc
import json
import os
import resource
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

READY = "@@READY@@"
RESULT = "@@RESULT@@"

# ---------------------------------------------------------------------------------- helpers


def rss_mb(pids: Sequence[int] = ()) -> float:
    """Resident memory (MiB) of this process plus ``pids`` (children, e.g. vLLM's engine)."""
    total = 0.0
    for pid in (os.getpid(), *pids):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
        except OSError:
            pass
    if total == 0.0:  # no /proc: peak RSS of this process
        total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return total


def child_pids() -> list[int]:
    """Every descendant of this process (Linux /proc), for the RSS of multi-process peers."""
    kids: dict[int, list[int]] = {}
    try:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    except OSError:
        return []
    out: list[int] = []
    todo = [os.getpid()]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` (0..100) percentile, linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tensor_bytes(model: Any) -> int:
    """Bytes of a torch module's weights: its parameters, buffers and any other tensors its
    submodules hold as attributes (packed quantized weights), each storage counted once."""
    import torch

    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class Timeline:
    """Per-request submission / first token / last token times and received tokens."""

    def __init__(self, n: int) -> None:
        self.submit = [0.0] * n
        self.first: list[float | None] = [None] * n
        self.last: list[float | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.cached: list[int | None] = [None] * n

    def got(self, i: int, ids: Sequence[int], t: float) -> None:
        if not ids:
            return
        if self.first[i] is None:
            self.first[i] = t
        self.last[i] = t
        self.tokens[i].extend(ids)

    def result(self, start: float, keep_outputs: bool) -> dict[str, Any]:
        """Wall time, tokens and per-request TTFT / TPOT / end-to-end latency."""
        ends = [t for t in self.last if t is not None]
        wall = (max(ends) if ends else time.perf_counter()) - start
        ttft, tpot, e2e = [], [], []
        for i, toks in enumerate(self.tokens):
            f, la = self.first[i], self.last[i]
            if f is None or la is None:
                continue
            ttft.append(f - self.submit[i])
            e2e.append(la - self.submit[i])
            if len(toks) > 1:
                tpot.append((la - f) / (len(toks) - 1))
        return {
            "wall_s": wall,
            "generated_tokens": sum(len(t) for t in self.tokens),
            "completed": sum(1 for t in self.last if t is not None),
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": e2e,
            "outputs": self.tokens if keep_outputs else None,
            "cached_tokens": self.cached,
        }


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


# ---------------------------------------------------------------------------------- asyncllm


class AsyncllmWorker:
    """asyncllm's AsyncEngine in this process; the model is loaded once, in ``--config``'s
    dtype, and shared by the engine configurations the specs ask for (one KV cache alive at a
    time). Each engine is built on its own compute thread, as ``LLMEngine.from_config`` does
    (the thread that loaded the model has exited by then). With a ``quantization`` in
    ``--config``, each engine is built by ``LLMEngine.from_config`` itself (the engine's own
    loading and quantizing path), from ``--model`` as the user named it."""

    name = "asyncllm"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from asyncllm.engine.llm_engine import ComputeThread
        from asyncllm.models.loader import load_model
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
            dtype = resolve_dtype(self.base.get("dtype", "auto"), torch.device("cpu"))

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

        loaded = self.engine({})._engine.loaded if self.loaded is None else self.loaded
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
            self._engines[key] = AsyncEngine(core)
        return self._engines[key]

    def settings(self, engine: Any) -> dict[str, Any]:
        c = engine.config
        core = engine._engine
        return {
            "dtype": str(core.kv_cache.spec.dtype).replace("torch.", ""),
            "block_size": c.block_size,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "kv_blocks": core.block_manager.num_total_blocks,
            "kv_cache_mib": round(core.kv_cache.num_bytes / 2**20, 1),
            "prefix_caching": c.enable_prefix_caching,
            "preemption_mode": c.preemption_mode,
            "attention": core.runner.attention_backend.name,
            "packed_linears": getattr(core.runner, "num_packed_linears", 0),
            "quantization": getattr(c, "quantization", None),
            "threads": self.threads,
        }

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        from asyncllm import SamplingParams
        from asyncllm.sampling_params import StructuredOutputsParams

        engine = self.engine(spec.get("engine_config") or {})
        if spec.get("reset_prefix_cache", True):
            engine._engine.reset_prefix_cache()
        tracer = Tracer(engine) if spec.get("trace") else None
        so = spec.get("structured_outputs")

        def submit(i: int, ids: list[int], max_tokens: int, salt: str | None) -> Any:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=spec.get("ignore_eos", True),
                structured_outputs=StructuredOutputsParams(**so) if so else None,
            )

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
            res["stats"] = {
                k: after[k] - before[k]
                for k in (
                    "num_preemptions",
                    "num_swapped_out_blocks",
                    "num_swapped_in_blocks",
                    "num_recomputed_tokens",
                    "prefix_cache_queries",
                    "prefix_cache_hits",
                    "num_steps",
                )
            }
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


def run_loop(main: Callable[[], Any]) -> Any:
    """asyncio.run on uvloop when installed (as ``python -m asyncllm`` does)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


class Tracer:
    """Per-step instrumentation of one asyncllm engine (harness only; the engine is unchanged:
    its methods are wrapped on the instance for the duration of one run).

    Records, per step: wall time of scheduling (``schedule`` + ``update_from_output``), input
    preparation (``execute`` minus forward and sampling), the model forward, sampling, the
    front end's dispatch (detokenization and stop checks, timed apart, and posting to the
    request states), the main thread's CPU time per step (the event loop: dispatch, delivery
    to the consumers, the inbox), the batch shape, and the KV blocks held against the tokens
    in use. With constrained requests, the grammar's parts: the token bitmask fill
    (``GrammarMatchers.fill``, "grammar_fill"), the sampler's mask (``_apply_grammar``,
    "grammar_mask") and the matchers' advance (``GrammarMatchers.accept``, "grammar_accept").
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.core = engine._engine
        self.steps: list[dict[str, float]] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._cur: dict[str, float] = {}
        self._detok = 0.0
        self._loop_cpu0 = 0.0

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        orig = getattr(obj, name)
        cur = self

        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                cur._cur[key] = cur._cur.get(key, 0.0) + time.perf_counter() - t

        self._saved.append(
            (obj, name, obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING)
        )
        setattr(obj, name, wrapped)

    def install(self) -> None:
        import asyncllm.worker.model_runner as mr
        import asyncllm.worker.sampler as sampler
        from asyncllm.engine.detokenizer import IncrementalDetokenizer

        core = self.core
        runner = core.runner
        tracer = self
        orig_schedule = core.scheduler.schedule

        def schedule() -> Any:
            t = time.perf_counter()
            plan = orig_schedule()
            tracer._cur["schedule"] = time.perf_counter() - t
            tracer._cur["tokens"] = float(plan.num_batched_tokens)
            tracer._cur["batch"] = float(len(plan.chunks))
            return plan

        self._saved.append((core.scheduler, "schedule", _MISSING))
        core.scheduler.schedule = schedule
        self._wrap(core.scheduler, "update_from_output", "update")
        self._wrap(runner, "execute", "execute")
        self._wrap(runner, "_forward", "forward")
        self._wrap(mr, "sample_chunks", "sample")
        self._wrap(sampler, "_apply_grammar", "grammar_mask")
        self._wrap(core.grammar_matchers, "fill", "grammar_fill")
        self._wrap(core.grammar_matchers, "accept", "grammar_accept")
        tracer = self
        orig_step = core.step

        def step() -> Any:
            tracer._cur = {}
            t = time.perf_counter()
            out = orig_step()
            t1 = time.perf_counter()
            c = tracer._cur
            c["t0"], c["step"] = t, t1 - t
            c.update(tracer.kv_sample())
            tracer.steps.append(c)
            return out

        self._saved.append((core, "step", core.__dict__.get("step", _MISSING)))
        core.step = step
        table = self.engine._requests  # the front end's dispatch of a step's updates
        orig_dispatch = table.dispatch

        def dispatch(updates: Any, core: Any) -> Any:
            tracer._detok = 0.0
            t = time.perf_counter()
            cpu = time.thread_time()
            try:
                return orig_dispatch(updates, core)
            finally:
                if tracer.steps:
                    s = tracer.steps[-1]
                    s["dispatch"] = time.perf_counter() - t
                    s["detok"] = tracer._detok
                    s["loop_cpu"] = cpu - tracer._loop_cpu0
                tracer._loop_cpu0 = cpu

        self._saved.append((table, "dispatch", table.__dict__.get("dispatch", _MISSING)))
        table.dispatch = dispatch
        orig_add = IncrementalDetokenizer.add_tokens
        orig_flush = IncrementalDetokenizer.flush

        def add_tokens(self_: Any, ids: Any) -> str:
            t = time.perf_counter()
            try:
                return orig_add(self_, ids)
            finally:
                tracer._detok += time.perf_counter() - t

        def flush(self_: Any) -> str:
            t = time.perf_counter()
            try:
                return orig_flush(self_)
            finally:
                tracer._detok += time.perf_counter() - t

        self._class_saved = (IncrementalDetokenizer, orig_add, orig_flush)
        IncrementalDetokenizer.add_tokens = add_tokens  # type: ignore[method-assign]
        IncrementalDetokenizer.flush = flush  # type: ignore[method-assign]
        self._loop_cpu0 = time.thread_time()

    def uninstall(self) -> None:
        for obj, name, orig in reversed(self._saved):
            if orig is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, orig)
        self._saved.clear()
        cls, add, flush = self._class_saved
        cls.add_tokens = add
        cls.flush = flush

    def kv_sample(self) -> dict[str, float]:
        """Blocks held, and the tokens in use (distinct filled slots of the held blocks)."""
        bm = self.core.block_manager
        bs = bm.block_size
        filled: dict[int, int] = {}
        for r in self.core.scheduler.running:
            table = bm.block_table(r.request_id)
            n = r.num_computed_tokens
            for j, b in enumerate(table):
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
        }


_MISSING = object()

# ---------------------------------------------------------------------------------- transformers


class HFStaticWorker:
    """transformers' ``generate`` on static batches with left padding (its standard offline
    path): the batch runs until its longest request is done; a request's tokens count from
    the step that produced them (as if streamed) and the batch's wall time is the call's."""

    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.load_s = time.perf_counter() - t
        self.pad = self.tokenizer.pad_token_id
        if self.pad is None:
            self.pad = self.tokenizer.eos_token_id
        self.max_batch = args.max_batch
        self.attn = getattr(self.model.config, "_attn_implementation", None)

    def info(self) -> dict[str, Any]:
        import torch
        import transformers

        return {
            "engine": self.name,
            "version": transformers.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_s": self.load_s,
            "rss_mb": rss_mb(),
            "precision": "float32",
            "weight_bytes": tensor_bytes(self.model),
        }

    def settings(self) -> dict[str, Any]:
        import torch

        return {
            "dtype": "float32",
            "batching": f"static, left padding, at most {self.max_batch} per batch",
            "attn_implementation": self.attn,
            "threads": torch.get_num_threads(),
        }

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("static batching takes no requests while a batch runs (online load)")
        tl = Timeline(len(reqs))
        start = end = time.perf_counter()

        class Clock(StoppingCriteria):
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        for b0 in range(0, len(reqs), self.max_batch):
            batch = list(range(b0, min(b0 + self.max_batch, len(reqs))))
            width = max(len(reqs[i][0]) for i in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                p = reqs[i][0]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(reqs[i][1] for i in batch)
            gc_ = GenerationConfig(
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad,
            )
            clock = Clock()
            t_submit = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=gc_,
                    stopping_criteria=StoppingCriteriaList([clock]),
                )
            done = time.perf_counter()
            gen = out[:, width:].tolist()
            for row, i in enumerate(batch):
                m = reqs[i][1]
                tl.submit[i] = t_submit
                toks = gen[row][:m]
                if len(toks) < m:
                    raise RuntimeError(f"generate stopped early: {len(toks)} of {m} tokens")
                # generate does not stream a batch: its tokens are taken at the step that
                # computed them (as if streamed), the batch's wall time at the call's return.
                times = clock.times
                tl.first[i] = times[0] if times else done
                tl.last[i] = times[m - 1] if len(times) >= m else done
                tl.tokens[i] = toks
            end = max(end, done)
        res = tl.result(start, spec.get("outputs", False))
        res["wall_s"] = end - start
        res["settings"] = self.settings()
        return res


class HFCBWorker:
    """transformers' own continuous batching (the manager behind ``generate_batch``), each
    request with its own ``max_new_tokens``, EOS disabled, streamed."""

    name = "hf_cb"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t
        if not hasattr(self.model, "init_continuous_batching"):
            raise Unsupported("this transformers has no continuous batching (generate_batch)")

    info = HFStaticWorker.info

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig

        try:
            from transformers.generation.continuous_batching import WorkloadHints  # type: ignore
        except ImportError:  # pragma: no cover - older layouts
            WorkloadHints = None

        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("run offline only here (generate_batch's API)")
        gcfg = GenerationConfig(
            do_sample=False, eos_token_id=-1, max_new_tokens=max(r[1] for r in reqs)
        )
        kw: dict[str, Any] = {}
        if WorkloadHints is not None:
            kw["workload_hints"] = WorkloadHints(
                max_prompt_length=max(len(r[0]) for r in reqs),
                max_generated_length=max(r[1] for r in reqs),
                num_requests=len(reqs),
            )
        manager = self.model.init_continuous_batching(generation_config=gcfg, **kw)
        # As generate_batch does, untimed: its warm-up sizes and exercises the batch shapes
        # (without it the first requests of a run are many times slower).
        t_warm = time.perf_counter()
        if not getattr(manager, "warmed_up", True):
            manager.warmup()
        warm_s = time.perf_counter() - t_warm
        manager.start()
        tl = Timeline(len(reqs))
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                index = {}
                for i, (ids, m, _) in enumerate(reqs):
                    rid = f"r{i}"
                    index[rid] = i
                    tl.submit[i] = time.perf_counter()
                    manager.add_request(
                        list(ids), request_id=rid, max_new_tokens=m, streaming=True, eos_token_id=-1
                    )
                seen = [0] * len(reqs)
                finished = 0
                deadline = time.perf_counter() + spec.get("timeout_s", 3600)
                while finished < len(reqs):
                    r = manager.get_result(timeout=1)
                    if r is None:
                        if time.perf_counter() > deadline:
                            raise TimeoutError("continuous batching did not finish in time")
                        if getattr(manager.background_thread_status, "fatal_error", None):
                            raise RuntimeError(f"{manager.background_thread_status.fatal_error}")
                        continue
                    if r.error:
                        raise RuntimeError(f"request {r.request_id}: {r.error}")
                    i = index[r.request_id]
                    toks = list(r.generated_tokens)
                    tl.got(i, toks[seen[i] :], time.perf_counter())
                    seen[i] = len(toks)
                    if r.is_finished():
                        finished += 1
        finally:
            manager.stop(block=True, timeout=30)
            destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
            if destroy is not None:
                destroy()
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = {
            "dtype": "float32",
            "batching": "transformers continuous batching (generate_batch's manager)",
            "manager_warmup_s": round(warm_s, 1),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(),
        }
        return res


# ---------------------------------------------------------------------------------- vLLM


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
        so = spec.get("structured_outputs")

        def submit(i: int, ids: list[int], max_tokens: int, salt: str | None) -> Any:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=spec.get("ignore_eos", True),
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=StructuredOutputsParams(**so) if so else None,
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


# ---------------------------------------------------------------------------------- llama.cpp


def pad256(n: int) -> int:
    """``n`` rounded up to a multiple of 256 (llama.cpp pads each sequence's context so)."""
    return -(-n // 256) * 256


class LlamaCppWorker:
    """llama.cpp through llama-cpp-python's low-level API (its C functions), on one GGUF file
    at its own quantization (the default model's Q4_1), ``n_threads = n_threads_batch =
    --threads``. Runs under the llama.cpp venv's interpreter.

    A run's requests are fed as token ids (no tokenizer on the timed path) into
    ``llama_batch``es of one context with ``n_seq_max`` = the number of requests, each
    sequence with its own KV stream (``kv_unified`` off, so no sequence attends over the
    others' cells): first all prompts, in chunks of ``n_batch`` tokens, then one decode step
    for every unfinished sequence at a time, greedy (argmax of the logits, first index on a
    tie, as torch's argmax), EOS ignored. This is llama.cpp's own batched decoding
    (llama.cpp's examples/batched and its server's slots work the same way). Online arrivals
    (W4) are not run. Sources: llama.cpp's include/llama.h (``llama_decode``,
    ``llama_batch``, ``llama_context_params``).
    """

    name = "llamacpp"
    N_BATCH = 2048  # llama.cpp's default logical batch (tokens per llama_decode call)

    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp as ll
        import numpy as np

        self.ll, self.np = ll, np
        self.threads = args.threads
        self.path = args.model
        ll.llama_backend_init()

        def log(level: int, text: bytes, _: Any) -> None:  # warnings and errors only
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode(errors="replace"))

        self._log = ll.llama_log_callback(log)  # kept alive: llama.cpp holds the pointer
        ll.llama_log_set(self._log, None)
        t = time.perf_counter()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        # Extra buffer types repack weights for AMX or AVX kernels. On the benchmark's VM
        # (Xeon with AMX, Firecracker) the AMX kernels die at their first tileloadd (SIGILL)
        # although the kernel grants AMX: off unless asked for.
        mp.use_extra_bufts = bool(args.extra_bufts)
        self.extra_bufts = bool(args.extra_bufts)
        self.model = ll.llama_model_load_from_file(args.model.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.load_s = time.perf_counter() - t
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, len(buf))
        self.desc = buf.value.decode(errors="replace")
        self.ctx: Any = None
        self.batch: Any = None
        self.ctx_key: tuple[int, int] | None = None
        self.tokenizer = self.check_tokenizer(args.prompts) if args.prompts else None

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's ids for ``text``, special tokens parsed, none added (as the workloads'
        chat-templated texts are tokenized by transformers)."""
        data = text.encode()
        out = (self.ll.llama_token * (len(data) + 8))()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), out, len(out), False, True)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(ctypes.cast(out, ctypes.POINTER(ctypes.c_int32))[:n])

    def check_tokenizer(self, prompts: str) -> dict[str, str]:
        """Per workload of prompts.json, how many of its texts llama.cpp tokenizes to the ids
        transformers gave (``"64/64"``). The runs feed those ids either way."""
        with open(prompts) as f:
            data = json.load(f)
        out = {}
        for key in ("W1", "W2", "W3"):
            if key in data and "texts" in data[key]:
                pairs = zip(data[key]["texts"], data[key]["ids"], strict=True)
                same = sum(1 for text, ids in pairs if self.tokenize(text) == ids)
                out[key] = f"{same}/{len(data[key]['ids'])}"
        return out

    def info(self) -> dict[str, Any]:
        import llama_cpp

        return {
            "engine": self.name,
            "version": llama_cpp.__version__,
            "threads": self.threads,
            "load_s": self.load_s,
            "rss_mb": rss_mb(),
            "model": self.desc,
            "precision": self.desc.rsplit(" ", 1)[-1] + " (GGUF)",
            "weight_bytes": int(self.ll.llama_model_size(self.model)),
            "tokenizer_ids_match": self.tokenizer,
        }

    def context(self, n_seq: int, per_seq: int) -> None:
        """A context for ``n_seq`` sequences of up to ``per_seq`` tokens each (the last one is
        kept while its size fits; its KV cache is cleared); warmed by one decode."""
        ll = self.ll
        if self.ctx_key == (n_seq, per_seq):
            ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
            return
        self.free_context()
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_seq * per_seq
        cp.n_batch = self.N_BATCH
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cp.n_ctx} tokens")
        self.batch = ll.llama_batch_init(max(self.N_BATCH, n_seq), 0, 1)
        self.ctx_key = (n_seq, per_seq)
        self.settings = {
            "dtype": self.desc.rsplit(" ", 1)[-1] + " weights (GGUF)",
            "batching": f"low-level llama_batch, {n_seq} sequence(s), per-sequence KV",
            "n_ctx": cp.n_ctx,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "extra_bufts": self.extra_bufts,
            "threads": self.threads,
        }
        self.decode([(0, 0, 0, True)])  # first use allocates; keep it off the clock
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> Any:
        """One ``llama_decode`` of ``(sequence, position, token, wants logits)`` items; returns
        the greedy next token of each item that wants logits, in order (numpy array)."""
        ll, b = self.ll, self.batch
        for k, (seq, pos, tok, want) in enumerate(items):
            b.token[k] = tok
            b.pos[k] = pos
            b.n_seq_id[k] = 1
            b.seq_id[k][0] = seq
            b.logits[k] = int(want)
        b.n_tokens = len(items)
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for it in items if it[3])
        if not n_out:
            return self.np.empty(0, dtype=self.np.int64)
        # The rows of the items that asked for logits, in batch order (llama.h).
        logits = self.np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), (n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("offline batched decoding only here (no online arrivals)")
        n = len(reqs)
        self.context(n, pad256(max(len(ids) + m for ids, m, _ in reqs)))
        tl = Timeline(n)
        nxt = [0] * n
        start = time.perf_counter()
        tl.submit = [start] * n
        # Prefill: every prompt, in chunks of n_batch tokens; logits at each prompt's end.
        items = [
            (i, pos, tok, pos == len(ids) - 1)
            for i, (ids, _, _) in enumerate(reqs)
            for pos, tok in enumerate(ids)
        ]
        for c in range(0, len(items), self.N_BATCH):
            chunk = items[c : c + self.N_BATCH]
            toks = self.decode(chunk).tolist()
            now = time.perf_counter()
            ends = [it[0] for it in chunk if it[3]]
            for i, tok in zip(ends, toks, strict=True):
                nxt[i] = tok
                tl.got(i, [tok], now)
        pos = [len(r[0]) for r in reqs]
        left = [r[1] - 1 for r in reqs]
        while True:
            active = [i for i in range(n) if left[i] > 0]
            if not active:
                break
            toks = self.decode([(i, pos[i], nxt[i], True) for i in active]).tolist()
            now = time.perf_counter()
            for i, tok in zip(active, toks, strict=True):
                nxt[i] = tok
                pos[i] += 1
                left[i] -= 1
                tl.got(i, [tok], now)
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = self.settings
        return res

    def free_context(self) -> None:
        if self.ctx is not None:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
        self.ctx = self.batch = self.ctx_key = None

    def close(self) -> None:
        self.free_context()
        self.ll.llama_model_free(self.model)


# ---------------------------------------------------------------------------------- main


class Unsupported(Exception):
    """The engine cannot run this workload (reported as skipped, with the reason)."""


WORKERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "asyncllm": AsyncllmWorker,
    "hf": HFStaticWorker,
    "hf_cb": HFCBWorker,
    "vllm": VLLMWorker,
    "llamacpp": LlamaCppWorker,
}


_OUT = sys.stdout


def emit(tag: str, obj: Any) -> None:
    _OUT.write(f"{tag} {json.dumps(obj)}\n")
    _OUT.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncllm.bench.worker")
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
