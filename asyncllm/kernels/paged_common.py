"""Pieces shared by the paged attention kernels: reading K/V tiles through a block table (an
int8 cache's dequantized: :mod:`asyncllm.attention.kv_int8`), the tanh of logit soft-capping,
and the checks of the inputs."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_ptr,
    pos,
    pos_mask,
    kv_head,
    d,
    d_mask,
    stride_b,
    stride_t,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """Gather ``[BLOCK_N, BLOCK_D]`` rows of one KV head at context positions ``pos``.

    Position ``p`` lives in block ``block_table[p // BLOCK_SIZE]`` at offset
    ``p % BLOCK_SIZE``; masked positions read zeros.
    """
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = block * stride_b + (pos % BLOCK_SIZE) * stride_t + kv_head * stride_h
    return tl.load(
        cache_ptr + row[:, None] + d[None, :], mask=pos_mask[:, None] & d_mask[None, :], other=0.0
    )


#: Bytes of an int8 KV row's float16 scale after its codes (``asyncllm.attention.kv_int8``'s
#: ``SCALE_BYTES``, which the kernels cannot import; tests/worker/test_kv_cache_int8.py checks).
SCALE_BYTES = 2


@triton.jit
def load_kv(
    cache_ptr,
    scale_ptr,
    block_table_ptr,
    pos,
    pos_mask,
    kv_head,
    d,
    d_mask,
    stride_b,
    stride_t,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """:func:`load_kv_tile`, or with ``QUANT`` an int8 cache's rows as float32 ``code *
    scale``: ``cache_ptr`` the int8 codes (rows of ``HEAD_DIM + 2`` bytes), ``scale_ptr``
    the same memory as float16, each row's scale at its byte ``HEAD_DIM`` (widened to float32
    exactly)."""
    if QUANT:
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        row = block * stride_b + (pos % BLOCK_SIZE) * stride_t + kv_head * stride_h
        codes = tl.load(
            cache_ptr + row[:, None] + d[None, :], mask=pos_mask[:, None] & d_mask[None, :], other=0
        )
        scale = tl.load(scale_ptr + (row + HEAD_DIM) // 2, mask=pos_mask, other=0.0)
        return codes.to(tl.float32) * scale.to(tl.float32)[:, None]
    else:
        return load_kv_tile(
            cache_ptr, block_table_ptr, pos, pos_mask, kv_head, d, d_mask,
            stride_b, stride_t, stride_h, BLOCK_SIZE,
        )  # fmt: skip


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """The float16 view of an int8 cache (its scales' pointer for :func:`load_kv` and the
    int8 write); the cache itself otherwise (an unused argument)."""
    return cache.view(torch.float16) if cache.dtype == torch.int8 else cache


@triton.jit
def tanh_f32(x):
    """``tanh(x)`` of a float32 tensor (not every Triton version has ``tl.tanh``).

    ``|x| >= 0.25``: ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` in ``(0, 0.61]``, so nothing
    overflows for large ``|x|`` and ``1 - e`` loses at most a bit; ``|x| < 0.25``: the Taylor
    series to ``x^9`` (truncation below 1e-8 relative), where ``1 - e`` would cancel. The sign
    is restored last. Within 1e-6 relative of ``torch.tanh`` in float32.
    """
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a
    poly = a2 * (0.13333333333333333 + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203))
    small = a + a * a2 * (-0.3333333333333333 + poly)
    t = tl.where(a < 0.25, small, t)
    return tl.where(x < 0.0, -t, t)


def dot_options(kernel: object, dtype: torch.dtype) -> tuple[bool, str]:
    """``(UPCAST, PRECISION)`` constexprs for a kernel's ``tl.dot`` calls on ``dtype`` inputs.

    ``PRECISION`` is "ieee" for float32 (exact products, no TF32). ``UPCAST`` converts bfloat16
    tiles to float32 before ``tl.dot`` under ``TRITON_INTERPRET=1`` only: the interpreter
    (Triton 3.9) multiplies bfloat16 operands as raw 16-bit integers.
    """
    upcast = dtype == torch.bfloat16 and not isinstance(kernel, JITFunction)
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def check_paged_inputs(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """Validate the query and caches shared by the attention kernels; returns their sizes.

    The caches are the query's dtype, or int8 with rows of ``head_dim + 2`` (codes and
    scale: :mod:`asyncllm.attention.kv_int8`).

    Returns:
        ``(num_heads, num_kv_heads, head_dim, block_size)``.

    Raises:
        ValueError: shapes, dtypes or layouts the kernels do not support.
    """
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"query must be [T, H, D] and caches [blocks, block_size, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(key_cache.shape)}"
        )
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    quant = key_cache.dtype == torch.int8
    row = head_dim + (SCALE_BYTES if quant else 0)  # an int8 row: codes and float16 scale
    if value_cache.shape != key_cache.shape or cache_dim != row:
        raise ValueError(
            f"query {tuple(query.shape)}, key_cache {tuple(key_cache.shape)} and value_cache "
            f"{tuple(value_cache.shape)} do not match"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if quant and head_dim % 2:
        raise ValueError(f"an int8 cache needs an even head_dim, got {head_dim}")
    if not (key_cache.dtype == value_cache.dtype and (quant or query.dtype == key_cache.dtype)):
        raise ValueError(
            f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} differ"
        )
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension of the query and caches")
    return num_heads, num_kv_heads, head_dim, block_size


def check_window_softcap(window: int, softcap: float) -> None:
    """Validate the sliding window (tokens, 0: none) and the logit soft-cap (0.0: none).

    Raises:
        ValueError: a negative window, or a negative or non-finite soft-cap.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no sliding window), got {window}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be finite and >= 0.0 (0.0: none), got {softcap}")
