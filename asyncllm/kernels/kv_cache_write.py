"""KV cache write: store a step's new K/V rows at their cache slots (GPU path).

The Triton form of vLLM's ``reshape_and_cache`` (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023): one program per new token copies
its ``[num_kv_heads, head_dim]`` key and value rows to flat slot ``slot_mapping[t]`` of the
``[num_blocks, block_size, num_kv_heads, head_dim]`` caches. Tokens with a negative slot are
skipped (masked loads and stores, no branch). An int8 cache (:mod:`asyncllm.attention.kv_int8`)
gets each row quantized on the way, bit for bit as the torch path writes: its float16 scale
``s = float16(min(absmax * (1/127), 65504))`` (round to nearest even) after its codes
``round(x * (1 / s))`` (ties to even, by adding and subtracting 1.5 * 2**23 in float32;
``1 / s`` IEEE-rounded, ``div_rn``; the product rounded before, no FMA; 0 where ``s`` is 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.paged_common import SCALE_BYTES, scale_view


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    keep = (tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0  # a tensor: the interpreter
    mask = (keep & (h < NUM_KV_HEADS))[:, None] & (d[None, :] < HEAD_DIM)  # rejects scalar & tensor
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_row = block * stride_kcb + offset * stride_kct + h * stride_kch  # [BLOCK_H]
    v_row = block * stride_vcb + offset * stride_vct + h * stride_vch
    if QUANT:
        k_codes, k_scale = _quantize_rows(k)
        v_codes, v_scale = _quantize_rows(v)
        tl.store(key_cache_ptr + k_row[:, None] + d[None, :], k_codes, mask=mask)
        tl.store(value_cache_ptr + v_row[:, None] + d[None, :], v_codes, mask=mask)
        h_mask = keep & (h < NUM_KV_HEADS)
        tl.store(key_scale_ptr + (k_row + HEAD_DIM) // 2, k_scale, mask=h_mask)
        tl.store(value_scale_ptr + (v_row + HEAD_DIM) // 2, v_scale, mask=h_mask)
    else:
        tl.store(key_cache_ptr + k_row[:, None] + d[None, :], k, mask=mask)
        tl.store(value_cache_ptr + v_row[:, None] + d[None, :], v, mask=mask)


@triton.jit
def _quantize_rows(x):
    """Rows ``[BLOCK_H, BLOCK_D]`` (masked elements 0) -> (int8 codes, float16 scales
    ``[BLOCK_H]``): kv_int8's per-row symmetric quantization, the codes from the rounded
    scale."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.minimum(amax * (1.0 / 127.0), 65504.0).to(tl.float16)  # round to nearest even
    s = scale.to(tl.float32)
    one = tl.full(s.shape, 1.0, tl.float32)
    inv = tl.where(s > 0.0, tl.math.div_rn(one, tl.where(s > 0.0, s, one)), 0.0)
    y = x * inv[:, None]
    y = (y + 12582912.0) - 12582912.0  # nearest integer, ties to even (|y| < 2**22; more clamps)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y.to(tl.int8), scale


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new K/V rows at their slots in place; rows whose slot is negative are skipped.

    Same contract as :func:`asyncllm.attention.torch_paged.write_kv_cache`. Launches one program
    per token; the rows may be strided (e.g. a transposed view) as long as ``head_dim`` is the
    contiguous dimension.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` in the caches' dtype (any float
            dtype for an int8 cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the last
            dimension contiguous; written in place. int8: ``head_dim + 2`` (codes and scale,
            :mod:`asyncllm.attention.kv_int8`).
        slot_mapping: ``[num_tokens]`` int32 or int64 flat slots
            (``block * block_size + offset``; negative: do not store).

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)}, key_cache "
            f"{tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)} do not match"
        )
    quant = key_cache.dtype == torch.int8
    if key_cache.shape[2:] != (num_kv_heads, head_dim + (SCALE_BYTES if quant else 0)):
        raise ValueError(f"key rows {tuple(key.shape)} do not fit cache {tuple(key_cache.shape)}")
    if quant and (value_cache.dtype != torch.int8 or head_dim % 2):
        raise ValueError(f"int8 caches need int8 values and an even head_dim, got {head_dim}")
    if not quant and (key.dtype != key_cache.dtype or value.dtype != value_cache.dtype):
        raise ValueError(f"K/V dtype {key.dtype} differs from the cache's {key_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    _kv_cache_write_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        scale_view(key_cache),
        scale_view(value_cache),
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        QUANT=quant,
        # no fused multiply-add on CUDA: the codes round the float32 product x * (1 / s), as
        # torch does (an FMA with the rounding constant would round the exact product)
        enable_fp_fusion=False,
    )
