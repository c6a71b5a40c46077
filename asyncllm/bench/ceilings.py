"""The machine and its ceilings, measured by the harness where it runs.

- copy bandwidth: ``dst.copy_(src)`` of a 256 MiB float32 tensor (far larger than the L3
  of most machines), bytes read + written per second, best of several;
- matmul FLOP/s: ``[m, k] @ [k, n]`` with m = k = n = 1024 (a large GEMM: the peak the BLAS
  reaches), best of several, in float32 (``matmul_gflops``) and bfloat16
  (``bf16_matmul_gflops``: an engine whose matmuls take bfloat16 activations, as the int4 and
  Q8_0 kernels do, is bounded by this one);
- the same at the model's shapes at batch 64 is not used as the ceiling (it is what the engine
  reaches, not what the machine can do).

The floors derived from them (``floors``): a decode step cannot take less than the weights'
bytes over the copy bandwidth, nor less than 2 x parameters x tokens over the FLOP/s of its
compute dtype.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any


def machine() -> dict[str, Any]:
    """Cores, processor, SIMD flags, memory, Python and torch versions."""
    import torch

    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "x86_64", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    mem_gib = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cores": os.cpu_count(),
        "processor": model,
        "simd": simd,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def copy_bandwidth(threads: int, mib: int = 256, reps: int = 7) -> float:
    """Best copy bandwidth (bytes read + written per second) with ``threads`` torch threads."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(prev)


def matmul_flops(threads: int, size: int = 1024, reps: int = 5, dtype: str = "float32") -> float:
    """Best GEMM FLOP/s (``size``-cubed, ``dtype`` "float32" or "bfloat16") with ``threads``
    torch threads."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = getattr(torch, dtype)
        a = torch.randn(size, size).to(dt)
        b = torch.randn(size, size).to(dt)
        out = torch.empty(size, size, dtype=dt)
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b, out=out)
            best = min(best, (time.perf_counter() - t) / 4)
        return 2 * size**3 / best
    finally:
        torch.set_num_threads(prev)


def measure(threads: list[int], mib: int = 256) -> dict[str, dict[str, float]]:
    """``{str(threads): {"copy_gbs": ..., "matmul_gflops": ..., "bf16_matmul_gflops": ...}}``
    (``mib``: the copied tensor's size; tests pass a small one)."""
    size = 1024 if mib >= 64 else 256
    return {
        str(t): {
            "copy_gbs": copy_bandwidth(t, mib) / 1e9,
            "matmul_gflops": matmul_flops(t, size) / 1e9,
            "bf16_matmul_gflops": matmul_flops(t, size, dtype="bfloat16") / 1e9,
        }
        for t in threads
    }


def best_of(samples: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per thread count, the best copy bandwidth and FLOP/s over several measurements (the
    ceiling is what the machine reached; noise only ever lowers it)."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        for t, v in s.items():
            cur = out.setdefault(t, {})
            for k, x in v.items():
                cur[k] = max(cur.get(k, 0.0), x)
    return out


def gflops(ceiling: dict[str, float], dtype: str | None) -> float:
    """The GEMM GFLOP/s bounding an engine whose matmuls run in ``dtype`` (its activations:
    "bfloat16" for the bfloat16 and int4/Q8_0 engines); float32's for anything else."""
    if dtype == "bfloat16" and "bf16_matmul_gflops" in ceiling:
        return ceiling["bf16_matmul_gflops"]
    return ceiling["matmul_gflops"]


def floors(
    ceiling: dict[str, float],
    weight_bytes: int,
    num_params: int,
    tokens: int,
    dtype: str | None = "float32",
    kv_bytes: float = 0.0,
) -> dict[str, float]:
    """Lower bounds (s) of one forward over ``tokens`` tokens (decode: one per sequence).

    Args:
        weight_bytes: bytes of weights the forward reads (the engine's, quantized or not).
        dtype: the dtype its matmuls compute in (``gflops``).
        kv_bytes: bytes of KV cache its attention reads (each cached slot once per layer).

    Returns:
        ``bandwidth_s`` (weights bytes / copy bandwidth), ``compute_s`` (2 x params x tokens
        / FLOP/s), ``floor_s``, the larger (the matmul floor); ``kv_s`` (``kv_bytes`` / copy
        bandwidth) and ``floor_with_kv_s`` = ``floor_s + kv_s``: attention, memory-bound at
        decode, runs between a layer's matmuls, not beside them.
    """
    bw = weight_bytes / (ceiling["copy_gbs"] * 1e9)
    fl = 2 * num_params * tokens / (gflops(ceiling, dtype) * 1e9)
    kv = kv_bytes / (ceiling["copy_gbs"] * 1e9)
    return {
        "bandwidth_s": bw,
        "compute_s": fl,
        "floor_s": max(bw, fl),
        "kv_s": kv,
        "floor_with_kv_s": max(bw, fl) + kv,
    }
