"""The int4 linear layer in C++: a few-row kernel of our own (``int4_gemv.cpp``, 1-3 rows),
torch's int4 kernel up to 8 rows, dequantize-and-GEMM for more.

torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``) is a matrix-vector kernel: its
cost grows linearly with the row count, so at a decode batch of 64 it is several times
slower than a plain bfloat16 matmul on the same weight (docs/tuning.md, "Many rows:
dequantize then GEMM"). For many rows,
:class:`asyncllm.layers.quant_linear.Int4Linear` therefore multiplies with the dequantized
weight, keeping only the int4 weight in memory. The extension registers the whole layer as
one op, ``asyncllm_cpu::int4_linear`` (reshape, cast, the row-count choice, kernel, bias): a
decode step calls it 210 times with the default model, and the same steps in Python were a
large share of a batch-1 step (docs/tuning.md, "Compiled forward"); compiled graphs call it
too (its fake implementation is registered by :func:`kernel`).

The many-row path (``int4_mm`` in the source) never writes the whole bfloat16 weight: a work
item is one 64-column block of ``W^T`` (the packing's row block) times up to 64 rows, and
items run block-major, so each thread dequantizes a block once into its own scratch
``[K, 64]`` (72 KiB at K = 576, 192 KiB at K = 1536: it stays in the core's L2), in the packed
("VNNI") layout of oneDNN's brgemm micro-kernel (``at::native::cpublas::brgemm``: AMX, or
``vdpbf16ps`` on AVX-512 BF16), and
multiplies it with the rows on the calling thread; with few blocks (N = 192) the rows are
split further so that both threads work. Dequantizing the whole weight and then calling one
``at::mm`` (the former path) wrote 2 bytes per weight to memory and read them back (about
212 MB per decode step); it remains where oneDNN's bfloat16 brgemm does not run
(``brgemm_bf16_runs`` in ``csrc/common.h``) and for ``m_tile`` 0. Float32 scales (a float32
model's layers, and bfloat16 ones on the avx2 variant, whose CPUs emulate bfloat16 GEMMs)
take the same block-by-block path in float32: each block dequantized exactly, then oneDNN's
float32 brgemm (docs/tuning.md has the figures).

The packed layout (``aten._convert_weight_to_int4pack_for_cpu(q_int32[N, K], 1)``, torch 2.13;
checked against the codes in tests/models/test_quantization.py): uint8 ``[N, K/2]`` read as
``[N/64, K, 32]``; byte ``[b, k, j]``'s low nibble is the code of row ``64b + j`` at column
``k``, its high nibble that of row ``64b + 32 + j``. Scales and zeros ``sz`` are
``[K/group, N, 2]`` (scale, zero) and ``w[n, k] = (q - 8) * scale + zero``, the int4 kernel's
own formula; a float32 model's layers (``Int4Linear``) keep theirs tile-major instead,
``[N/64, K/group, 2, 64]`` (a group's 64 scales, then its 64 offsets, ``w = q * scale +
offset``), which every float32 path here reads. Every 32-byte run of codes thus gives 64
consecutive entries of one row of ``W^T [K, N]``: the kernel streams the codes once and
writes ``W^T`` contiguously.

Arithmetic: float32 (a bfloat16 scale widens exactly), the multiply and add rounded
separately (``-ffp-contract=off``: the same values as torch's float32 ``(q - 8) * s + z``),
then rounded once to the output dtype (bfloat16: to nearest even, as torch's ``.to()``): the
dequantized values are the same in both many-row paths. The GEMMs accumulate in float32 over
all of K and round once to bfloat16 (to nearest even); only their summation order differs.

The few-row kernel (``int4_gemv.cpp``, appended to this source; AVX-512 BF16 and VBMI) reads
the same packed codes: it pairs two columns' codes per output in registers and multiplies
them with bfloat16 pairs of the row (``vdpbf16ps``), half the instructions per code of
torch's kernel, which converts every code to float32 first, and so the faster at a few
rows: see :data:`asyncllm.layers.quant_linear.INT4_GEMV_MAX_ROWS`.

The C++ is ``csrc/int4_linear.cpp`` and ``csrc/int4_gemv.cpp``, built when the package is
installed (:mod:`asyncllm.kernels.native`; ``ASYNCLLM_INT4_DEQUANT_KERNEL=0`` turns it
off); where it is not installed, ``Int4Linear`` keeps torch's int4 kernel for every row count
(correct, slower for many rows).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.kernels import native

__all__ = [
    "ENV_SWITCH",
    "fused_available",
    "gemv_available",
    "kernel",
    "op_available",
    "path_calls",
]

ENV_SWITCH = native.SWITCHES["int4"]


def kernel() -> Any:
    """The int4 kernel module, or None where it is switched off or not installed; loading it
    registers the CPU kernel of ``asyncllm::int4_linear`` (a whole
    :class:`~asyncllm.layers.quant_linear.Int4Linear` call in C++, the row-count choice
    inside). Cheap after the first call."""
    return native.module("int4")


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def op_available() -> bool:
    """``asyncllm::int4_linear`` has its C++ kernel here (:func:`kernel`); a constant to
    Dynamo, which evaluates it once while tracing instead of tracing the loading."""
    return kernel() is not None


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def fused_available() -> bool:
    """The fused many-row path can run here (the kernel installed, native bfloat16 brgemm);
    a constant to Dynamo."""
    mod = kernel()
    return mod is not None and bool(mod.int4_fused_available())


def path_calls() -> tuple[int, int, int]:
    """Calls of the C++ ``asyncllm::int4_linear`` so far, per path: (torch's int4 kernel,
    dequantize then GEMM, the few-row kernel); zeros where the kernel is not loaded."""
    mod = kernel()
    if mod is None:
        return 0, 0, 0
    int4, dense, gemv = mod.int4_path_calls()
    return int(int4), int(dense), int(gemv)


def gemv_available() -> bool:
    """The few-row kernel (``csrc/int4_gemv.cpp``) is in the variant loaded here: AVX-512
    BF16 and VBMI."""
    mod = kernel()
    return mod is not None and bool(mod.int4_gemv_available())
