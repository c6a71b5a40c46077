"""Resident memory (VmRSS) of the default engine at each stage of a W3 run, as the benchmark's
asyncllm worker builds and runs it (``python -m asyncllm bench``; :class:`AsyncllmWorker`).

    python benchmarks/rss_stages.py [--config JSON] [--top 15] [--threads N] [--runs 1]
                                    [--without triton,scipy,boto3]

Prints VmRSS (MiB) after the imports, after the engine build (compiled forward loaded), and
after each W3 run (with its TPOT), then the biggest resident mappings of
``/proc/self/smaps`` (each shared object by path, anonymous memory as one line) and
``ru_maxrss`` (the peak). The benchmark reads RSS after the run
(:func:`asyncllm.bench.engine_process.rss_mb`); the figure to compare is "after W3".

``--without`` is a what-if, never a setting: it makes the named packages unimportable in
this process (``sys.modules[name] = None``), so that transformers, accelerate and torch
skip the optional imports they make when a package is installed (scipy via
``transformers.loss``, boto3 via ``accelerate.commands.config``, triton via
``torch._dynamo.utils``), and prints what the engine holds without them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's asyncllm, installed or not


def rss() -> float:
    """VmRSS of this process (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def smaps_top(n: int) -> list[tuple[float, str]]:
    """The ``n`` biggest resident mappings (MiB, name), grouped by file; anonymous as one."""
    by: dict[str, float] = defaultdict(float)
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:":
                by[name] += int(parts[1]) / 1024
    return sorted(((v, k) for k, v in by.items()), reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default='{"max_model_len": 2048, "kv_cache_bytes": 1073741824}')
    ap.add_argument("--model", default=None, help="default: the default model's directory")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--without", default="", help="what-if: packages made unimportable")
    a = ap.parse_args()
    for name in filter(None, a.without.split(",")):
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    t0 = time.perf_counter()
    print(f"start            {rss():7.1f} MiB")
    from asyncllm.bench.asyncllm_engine import AsyncllmWorker
    from asyncllm.bench.workloads import build, load_prompts
    from asyncllm.models.loader import resolve_model_dir

    print(f"imports          {rss():7.1f} MiB  (torch, transformers, asyncllm)")
    model = a.model or str(resolve_model_dir("default"))
    threads = a.threads or len(os.sched_getaffinity(0))
    args = argparse.Namespace(config=a.config, threads=threads, model=model)
    w = AsyncllmWorker(args)
    info = w.info()
    print(f"engine built     {rss():7.1f} MiB  ({info['precision']}, load {w.load_s:.1f} s)")
    core = w.engine({}).core
    print(f"  compile: {core.stats()['compile']}  modules: {len(sys.modules)}")
    (w3,) = build(["W3"], load_prompts())
    warm = {"requests": w3.warmup()}
    w.run(warm)
    print(f"after warm-up    {rss():7.1f} MiB")
    for _ in range(a.runs):
        res = w.run({"requests": w3.requests, "outputs": True})
        tpot = res["tpot_s"][0] * 1e3
        print(f"after W3         {rss():7.1f} MiB  TPOT {tpot:.2f} ms")
    import asyncllm

    print(f"asyncllm from {os.path.dirname(asyncllm.__file__)}")
    print(f"outputs[:8] {res['outputs'][0][:8]}  hash {hash(tuple(res['outputs'][0]))}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak (ru_maxrss) {peak:7.1f} MiB   wall {time.perf_counter() - t0:.1f} s")
    for mib, name in smaps_top(a.top):
        print(f"  {mib:7.1f}  {name}")
    heavy = ["torch._dynamo", "torch._inductor", "scipy", "sympy", "botocore", "triton",
             "torch.distributed.tensor", "transformers.models.llama.modeling_llama", "xgrammar",
             "numpy", "gguf", "safetensors", "tokenizers", "pandas", "PIL"]  # fmt: skip
    print("loaded:", json.dumps({m: sys.modules.get(m) is not None for m in heavy}))


if __name__ == "__main__":
    main()
