"""A fresh machine's first minutes: the default engine started with its compiled forward
missing, asked for the same greedy answer every few seconds; prints when the compiled
forward arrives (the engine's log lines) and what each answer took meanwhile. (The C++
kernels are built when the package is installed: nothing of them is built here.)

    python benchmarks/cold_start.py [--cache DIR] [--drop compiled,inductor]
                                    [--answers 45] [--every 4] [--tokens 32]

``--cache`` (default: a ``cold-start`` folder under the system's temp dir) becomes
``ASYNCLLM_CACHE``; the folders named by ``--drop`` are deleted first (``all``: the whole
cache, the GGUF conversion included). Run it on a quiet machine: the background compile
competes with the steps for the cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's asyncllm, installed or not


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "cold-start"))
    ap.add_argument("--drop", default="compiled,inductor")
    ap.add_argument("--answers", type=int, default=45)
    ap.add_argument("--every", type=float, default=4.0, help="seconds between answers")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    for name in filter(None, a.drop.split(",")):
        shutil.rmtree(a.cache if name == "all" else os.path.join(a.cache, name), True)
    os.environ["ASYNCLLM_CACHE"] = a.cache
    t0 = time.perf_counter()
    fmt = "%(relativeCreated)8.0f ms  %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)
    from asyncllm import LLM, SamplingParams

    llm = LLM("default")
    print(f"loaded after {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for i in range(a.answers):
        t = time.perf_counter()
        (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
        took = time.perf_counter() - t
        print(f"answer {i:3d} at {time.perf_counter() - t0:6.1f} s took {took:.2f} s "
              f"({len(out.token_ids)} tokens): {out.text[:40]!r}", flush=True)  # fmt: skip
        time.sleep(a.every)


if __name__ == "__main__":
    main()
