"""What the command lines (``generate``, ``serve``) say while an engine starts: the model
being loaded, then its weights' precision and size, the dtype it computes in, the C++
kernels that run, the KV cache's shape, whether the forward compiles in the background, and
the load time."""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine


def start_engine(model: str, config: dict[str, Any], out: IO[str] | None = None) -> AsyncEngine:
    """``AsyncEngine.from_pretrained(model, **config)``, with the start-up lines written to
    ``out`` (default: stderr; a first start also shows the GGUF conversion's and the
    quantization's progress bars there).

    Raises:
        whatever ``from_pretrained`` raises (ValueError and its subclasses for a model or
        setting it cannot run), after the "loading" line.
    """
    from asyncllm import AsyncEngine

    out = out if out is not None else sys.stderr
    t0 = time.perf_counter()
    print(f"loading {model} ...", file=out, flush=True)
    engine = AsyncEngine.from_pretrained(model, **config)
    stats = engine.stats()
    kernels = f"; C++ kernels: {stats['cpu_kernels']}" if stats["cpu_kernels"] else ""
    print(
        f"weights: {stats['precision']}, {int(stats['weight_bytes']) / 2**20:.0f} MiB; "
        f"computed in {stats['dtype']}{kernels}",
        file=out,
    )
    print(f"KV cache: {stats['kv_layout']}", file=out)
    if stats["compile"] == "compiling":
        print(
            "compiling the forward in the background (once per model and machine, about a "
            "minute; a saved one loads in seconds); answering eagerly meanwhile",
            file=out,
        )
    elif stats["compile"] == "off" and config.get("compile") == "cached":
        print(
            "eager: no compiled forward saved for this model yet (`serve`, or `--compile "
            "auto` on a longer run, builds one in the background, about a minute)",
            file=out,
        )
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    return engine
