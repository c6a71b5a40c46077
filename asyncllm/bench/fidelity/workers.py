"""The fidelity harness's engine processes (:mod:`asyncllm.bench.fidelity`): asyncllm's and
llama.cpp's workers of :mod:`asyncllm.bench.engine_process`, each answering one more kind of
run spec, ``{"fidelity": {"windows": [ids...], "questions": [ids...], "max_tokens": n}}``,
with ``{"windows": [{"logprobs": [...], "top": [...]}...], "answers": [ids...]}``: per window,
for each token after the first, its log-prob and the most likely token there (teacher
forced); per question, its first ``max_tokens`` greedy tokens (EOS ignored). Other specs run
as the plain workers run them.

    python -m asyncllm.bench.fidelity.workers --engine asyncllm --model DIR [--config JSON]
    VENV/bin/python path/to/asyncllm/bench/fidelity/workers.py --engine llamacpp --model F.gguf

The module's top level uses the standard library only: the llama.cpp worker runs it by path
with its venv's interpreter, where asyncllm is not installed (``engine_process.py`` is then
loaded from the folder above).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any


@functools.cache
def _engine_process() -> Any:
    """:mod:`asyncllm.bench.engine_process`: from the package, else from the folder above."""
    try:
        from asyncllm.bench import engine_process
    except ImportError:
        path = pathlib.Path(__file__).parent.parent / "engine_process.py"
        spec = importlib.util.spec_from_file_location("engine_process", path)
        assert spec is not None and spec.loader is not None
        engine_process = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(engine_process)
    return engine_process


def window_figures(
    ids: Sequence[int], entries: Sequence[Mapping[int, Any] | None]
) -> dict[str, Any]:
    """A window's figures from its ``prompt_logprobs`` (asked with 1 alternative): for each
    token after the first, its log-prob and the most likely token (the one alternative,
    or the token itself when it is the most likely: its entry then holds only it)."""
    logprobs, top = [], []
    for tok, entry in zip(ids[1:], entries[1:], strict=True):
        assert entry is not None
        logprobs.append(float(entry[tok].logprob))
        top.append(int(list(entry)[-1]))
    return {"logprobs": logprobs, "top": top}


async def score_windows(engine: Any, windows: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Each window's :func:`window_figures` from an ``AsyncEngine`` (all submitted at once;
    ``prompt_logprobs`` requests never hit the prefix cache)."""
    from asyncllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = await asyncio.gather(*(engine.generate(list(w), params) for w in windows))
    return [window_figures(w, o.prompt_logprobs) for w, o in zip(windows, outs, strict=True)]


async def greedy_answers(engine: Any, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens (EOS ignored) after each prompt, all submitted at once."""
    from asyncllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(list(p), params) for p in prompts))
    return [list(o.token_ids) for o in outs]


def asyncllm_worker(args: argparse.Namespace) -> Any:
    """asyncllm's benchmark worker (``AsyncllmWorker``) that also runs fidelity specs."""
    from asyncllm.bench.asyncllm_engine import AsyncllmWorker, run_loop

    class FidelityWorker(AsyncllmWorker):  # type: ignore[misc]
        def run(self, spec: dict[str, Any]) -> dict[str, Any]:
            f = spec.get("fidelity")
            if f is None:
                return super().run(spec)  # type: ignore[no-any-return]
            engine = self.engine(spec.get("engine_config") or {})

            async def main() -> dict[str, Any]:
                async with engine:
                    t0 = time.perf_counter()
                    windows = await score_windows(engine, f["windows"])
                    t1 = time.perf_counter()
                    answers = await greedy_answers(engine, f["questions"], f["max_tokens"])
                    t2 = time.perf_counter()
                return {"windows": windows, "answers": answers, "windows_s": t1 - t0,
                        "answers_s": t2 - t1}  # fmt: skip

            res: dict[str, Any] = run_loop(main)
            res["settings"] = self.settings(engine)
            return res

    return FidelityWorker(args)


def llamacpp_worker(args: argparse.Namespace) -> Any:
    """The llama.cpp benchmark worker (``LlamaCppWorker``, one GGUF file at its own
    quantization) that also runs fidelity specs (:func:`llamacpp_class`)."""
    return llamacpp_class()(args)


@functools.cache
def llamacpp_class() -> Any:
    """``LlamaCppWorker`` with fidelity specs: a window is one ``llama_decode`` with logits
    at every position (log-probs computed here in float64 from llama.cpp's float32 logits);
    a question is its prompt, then one token a step (argmax, first index on a tie)."""
    base = _engine_process().llamacpp_worker_class()
    pad256 = sys.modules[base.__module__].pad256

    class LlamaCppFidelityWorker(base):  # type: ignore[misc,valid-type]
        def run(self, spec: dict[str, Any]) -> dict[str, Any]:
            f = spec.get("fidelity")
            if f is None:
                return super().run(spec)  # type: ignore[no-any-return]
            n = f["max_tokens"]
            longest = max([len(w) for w in f["windows"]] + [len(p) + n for p in f["questions"]])
            self.context(1, pad256(longest))
            t0 = time.perf_counter()
            windows = [self.score(w) for w in f["windows"]]
            t1 = time.perf_counter()
            answers = [self.greedy(p, n) for p in f["questions"]]
            return {"windows": windows, "answers": answers, "windows_s": t1 - t0,
                    "answers_s": time.perf_counter() - t1, "settings": self.settings}  # fmt: skip

        def clear(self) -> None:
            self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

        def score(self, ids: Sequence[int]) -> dict[str, Any]:
            np = self.np
            self.clear()
            self.decode([(0, pos, tok, True) for pos, tok in enumerate(ids)])
            shape = (len(ids), self.n_vocab)
            raw = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape)
            logits = raw[:-1].astype(np.float64)
            m = logits.max(axis=1)
            lse = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
            nxt = np.asarray(ids[1:])
            lp = logits[np.arange(len(nxt)), nxt] - lse
            return {"logprobs": lp.tolist(), "top": logits.argmax(axis=1).tolist()}

        def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
            self.clear()
            last = len(prompt) - 1
            tok = int(self.decode([(0, p, t, p == last) for p, t in enumerate(prompt)])[0])
            out = [tok]
            while len(out) < n:
                tok = int(self.decode([(0, last + len(out), tok, True)])[0])
                out.append(tok)
            return out

    return LlamaCppFidelityWorker


def main(argv: Sequence[str] | None = None) -> int:
    """engine_process's ``main`` with the fidelity workers for asyncllm and llama.cpp."""
    ep = _engine_process()
    ep.WORKERS["asyncllm"] = asyncllm_worker
    ep.WORKERS["llamacpp"] = llamacpp_worker
    return int(ep.main(argv))


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run by path: keep this folder's modules from shadowing others
    sys.exit(main())
