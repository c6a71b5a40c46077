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
import ctypes
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

    With ``--draft-tokens K`` it runs one stream (W3, W7) with llama-cpp-python's prompt-lookup
    decoding (``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K))``): each step
    asks its ``LlamaPromptLookupDecoding`` for up to K tokens after the last n-gram (2 or 1
    tokens) of the prompt and output, decodes the pending token and those in one
    ``llama_decode``, keeps the proposals that the greedy tokens confirm plus the first
    greedy token after them, and drops the KV cells of the rest (``llama_memory_seq_rm``), as
    ``Llama.generate`` does with a draft model.
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
        self.draft: Any = None
        if args.draft_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.draft = LlamaPromptLookupDecoding(num_pred_tokens=args.draft_tokens)

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
        for key in ("W1", "W2", "W3", "W7"):
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
        if self.draft is not None:
            if len(reqs) != 1:
                raise Unsupported("prompt-lookup decoding runs one stream here (W3, W7)")
            return self.run_lookup(spec)
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

    def run_lookup(self, spec: dict[str, Any]) -> dict[str, Any]:
        """One request, greedy, with prompt-lookup proposals verified a step at a time."""
        ll, np = self.ll, self.np
        ((ids, max_tokens, _),) = spec["requests"]
        self.context(1, pad256(len(ids) + max_tokens))
        mem = ll.llama_get_memory(self.ctx)
        tl = Timeline(1)
        start = time.perf_counter()
        tl.submit = [start]
        items = [(0, pos, tok, pos == len(ids) - 1) for pos, tok in enumerate(ids)]
        for c in range(0, len(items), self.N_BATCH):
            out = self.decode(items[c : c + self.N_BATCH]).tolist()
        nxt, context = out[-1], [*ids]
        tl.got(0, [nxt], time.perf_counter())
        pos, left = len(ids), max_tokens - 1
        proposed = accepted = steps = 0
        while left > 0:
            # At most left - 1 proposals: the step yields one token more than it accepts.
            draft = self.draft(np.array([*context, nxt], dtype=np.intc)).tolist()[: left - 1]
            batch = [nxt, *draft]
            greedy = self.decode([(0, pos + j, t, True) for j, t in enumerate(batch)]).tolist()
            j = 0
            while j < len(draft) and draft[j] == greedy[j]:
                j += 1
            new = greedy[: j + 1]
            ll.llama_memory_seq_rm(mem, 0, pos + j + 1, -1)  # the rejected proposals' cells
            tl.got(0, new, time.perf_counter())
            context += batch[: j + 1]
            nxt, pos, left = new[-1], pos + j + 1, left - len(new)
            proposed, accepted, steps = proposed + len(draft), accepted + j, steps + 1
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = {
            **self.settings,
            "speculation": f"LlamaPromptLookupDecoding(max_ngram_size={self.draft.max_ngram_size}"
            f", num_pred_tokens={self.draft.num_pred_tokens})",
        }
        res["stats"] = {
            "spec_num_draft_tokens": proposed,
            "spec_num_accepted_tokens": accepted,
            "spec_num_steps": steps,
        }
        return res

    def free_context(self) -> None:
        if self.ctx is not None:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
        self.ctx = self.batch = self.ctx_key = None

    def close(self) -> None:
        self.free_context()
        self.ll.llama_model_free(self.model)


class Unsupported(Exception):
    """The engine cannot run this workload (reported as skipped, with the reason)."""


def _in_package(module: str, name: str) -> Callable[[argparse.Namespace], Any]:
    """A worker class of this package, imported when started (the peers' venvs lack it)."""

    def make(args: argparse.Namespace) -> Any:
        import importlib

        return getattr(importlib.import_module(f"asyncllm.bench.{module}"), name)(args)

    return make


WORKERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "asyncllm": _in_package("asyncllm_engine", "AsyncllmWorker"),
    "hf": _in_package("hf_engines", "HFStaticWorker"),
    "hf_cb": _in_package("hf_engines", "HFCBWorker"),
    "vllm": VLLMWorker,
    "llamacpp": LlamaCppWorker,
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
