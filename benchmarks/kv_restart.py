"""W2 after a restart (issue 39's target): the engine is restarted between the system
prompt's first users and the rest. Measures, on one loaded model (the default model and its
default precision unless told otherwise), alternating the variants for ``--rounds`` rounds:

* ``warm``: W2 on an engine whose device pool holds the system prompt (the first users ran
  on the same engine, prefix caching on, no disk tier);
* ``restarted``: an engine with ``prefix_cache_dir`` (a new temporary directory per round)
  serves the first users and stops (its files written); a new engine on the same directory
  serves W2: its device pool and host tier start empty, the prefix comes from the files;
* ``no cache``: W2 with ``enable_prefix_caching=False``.

W2 is ../shared/bench/WORKLOADS.md's: the 32 prompts of ``prompts.json`` (528 shared
tokens, then a distinct question) all submitted at once, exactly 32 new greedy tokens each,
through :class:`~asyncllm.AsyncEngine`, timed from the first submission to the last token.
The first users: ``--first-users`` W2 prompts (default 1: prompt 0), 32 tokens each, not
timed. Every engine is fresh (the model and its compiled forward shared), and one W2 run on
the first engine, not counted, warms the kernels up.

Run from the repository root::

    PYTHONPATH=. python benchmarks/kv_restart.py [--rounds 3] [--model default]
        [--first-users 1] [--threads 2] [--compile auto|true|false]

Prints per round each variant's wall seconds, mean TTFT, hits (device / host / disk,
tokens), how long after the submissions the first batch ran (the restarted engine waits
for the disk reads), the swap-in copies of host and disk hits and the step that carried
them, and the update phases (where the disk tier snapshots newly cached blocks), then
the medians and the median ratios restarted / warm (target: at most 1.2) and restarted /
no cache (target: at most 0.4); docs/tuning.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from typing import Any

import msgspec

from asyncllm import AsyncEngine, EngineConfig, SamplingParams
from asyncllm.bench.asyncllm_engine import wait_for_compile
from asyncllm.bench.workloads import load_prompts
from asyncllm.core.plan import SchedulerOutput
from asyncllm.engine.llm_engine import ComputeThread, LLMEngine
from asyncllm.worker.step_timing import StepTimings

VARIANTS = ("warm", "restarted", "no cache")


class _Steps:
    """Step observer (:mod:`asyncllm.worker.step_timing`): when the first batch ran, the
    swap-in copies (host and disk hits) and the step that carried them."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.swap_s = 0.0
        self.swap_blocks = 0
        self.swap_step_s = 0.0  # whole steps that carried a swap in
        self.update_s = 0.0  # update phases (the disk tier's snapshots of new blocks)

    def __call__(self, timings: StepTimings, plan: SchedulerOutput) -> None:
        if self.first_start is None:
            self.first_start = timings.start
        self.update_s += timings.phases.get("update", 0.0)
        if plan.swap_in:
            self.swap_s += timings.phases.get("kv_copy", 0.0)
            self.swap_blocks += len(plan.swap_in)
            self.swap_step_s += timings.end - timings.start


def _engine(base: EngineConfig, loaded: Any, **kw: Any) -> AsyncEngine:
    """A new engine on ``loaded`` (its own compute thread and KV cache)."""
    thread = ComputeThread()
    config = msgspec.structs.replace(base, **kw)
    core = thread.submit(LLMEngine, config, loaded, thread).result()
    wait_for_compile(core)
    return AsyncEngine(core)


async def _w2(engine: AsyncEngine, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """All ``prompts`` at once, ``new`` greedy tokens each: wall, mean TTFT, tokens."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    steps = engine._engine.step_observer = _Steps()
    start = time.perf_counter()
    ttft: list[float] = []

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.stream(prompt, params):
            if not tokens:
                ttft.append(time.perf_counter() - start)
            tokens.extend(out.token_ids)
        return tokens

    outs = await asyncio.gather(*(one(p) for p in prompts))
    engine._engine.step_observer = None
    first = (steps.first_start or start) - start
    return {"wall_s": time.perf_counter() - start, "ttft_s": statistics.mean(ttft),
            "tokens": outs, "before_first_step_s": first, "steps": steps}  # fmt: skip


async def _variant(
    name: str, base: EngineConfig, loaded: Any, w2: list[list[int]], first: list[list[int]],
    new: int,
) -> dict[str, Any]:  # fmt: skip
    """One timed W2 of variant ``name`` on fresh engines (see the module docstring)."""
    kw: dict[str, Any] = {"enable_prefix_caching": name != "no cache"}
    with tempfile.TemporaryDirectory(prefix="kv-restart-") as directory:
        if name == "restarted":
            kw["prefix_cache_dir"] = directory
            async with _engine(base, loaded, **kw) as e:
                await _w2(e, first, new)
            gc.collect()  # the first engine's KV cache gone before the second's is made
        return await _timed(name, base, loaded, w2, first, new, kw)


async def _timed(
    name: str, base: EngineConfig, loaded: Any, w2: list[list[int]], first: list[list[int]],
    new: int, kw: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The timed W2 of :func:`_variant` on a new engine with ``kw``."""
    async with _engine(base, loaded, **kw) as e:
        if name != "restarted":
            await _w2(e, first, new)
        e._engine.scheduler.prefix_cache_hits = 0  # count W2's hits only
        for k in ("queries", "host_hits", "disk_hits"):
            setattr(e._engine.scheduler, f"prefix_cache_{k}", 0)
        out = await _w2(e, w2, new)
        s = e.stats()
    gc.collect()
    hits = s["prefix_cache_hits"]
    out["hits"] = {"device": int(hits) - int(s["prefix_cache_host_hits"]),
                   "host": s["prefix_cache_host_hits"], "disk": s["prefix_cache_disk_hits"],
                   "queries": s["prefix_cache_queries"]}  # fmt: skip
    return out


async def main(a: argparse.Namespace) -> None:
    data = load_prompts()["W2"]
    w2, new = data["ids"], int(data["new"])
    first = w2[: a.first_users]
    base = EngineConfig(model=a.model, max_model_len=1024, num_threads=a.threads,
                        compile=a.compile)  # fmt: skip
    core = LLMEngine.from_config(base)  # loads (and quantizes) the model once
    wait_for_compile(core)
    loaded = core.loaded
    async with AsyncEngine(core) as e:  # warm-up, not counted
        await _w2(e, w2, new)
    s = core.stats()
    print(f"model {a.model}: {s['precision']}, KV {s['kv_layout']}, compile {s['compile']}, "
          f"block {base.block_size}, max_num_seqs {base.max_num_seqs}, "
          f"max_num_batched_tokens {base.max_num_batched_tokens}", flush=True)  # fmt: skip
    del core, e
    gc.collect()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            out = await _variant(name, base, loaded, w2, first, new)
            runs[name].append(out)
            st = out["steps"]
            print(f"round {r} {name}: wall {out['wall_s']:.2f} s, mean TTFT "
                  f"{out['ttft_s']:.3f} s, hits {out['hits']}; first batch after "
                  f"{out['before_first_step_s'] * 1e3:.0f} ms, swap in {st.swap_blocks} blocks "
                  f"in {st.swap_s * 1e3:.1f} ms (its step {st.swap_step_s * 1e3:.0f} ms), "
                  f"update phases {st.update_s * 1e3:.0f} ms", flush=True)  # fmt: skip
    for name in VARIANTS:
        walls = [o["wall_s"] for o in runs[name]]
        print(f"{name}: median wall {statistics.median(walls):.2f} s "
              f"({', '.join(f'{w:.2f}' for w in walls)})")  # fmt: skip
    for other, target in (("warm", 1.2), ("no cache", 0.4)):
        ratios = [x["wall_s"] / y["wall_s"] for x, y in zip(runs["restarted"], runs[other],
                                                              strict=True)]  # fmt: skip
        print(f"restarted / {other}: median {statistics.median(ratios):.3f} "
              f"({', '.join(f'{x:.3f}' for x in ratios)}; target <= {target})")  # fmt: skip
    same = all(o["tokens"] == runs["warm"][0]["tokens"] for v in VARIANTS for o in runs[v])
    print(f"greedy tokens equal across variants and rounds: {same}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-users", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compile", default="auto", type=lambda s: {"true": True, "false": False}.get(s.lower(), s)
    )
    asyncio.run(main(p.parse_args()))
