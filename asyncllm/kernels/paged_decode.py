"""Decode attention over a paged KV cache: split-K flash-decoding with grouped-query heads.

Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", 2023) on the paged layout of vLLM's PagedAttention (Kwon et al., SOSP 2023), with
the online softmax of FlashAttention-2 (Dao, 2023).

* Stage 1, :func:`_paged_decode_kernel`, grid ``(num_decodes, num_kv_heads, num_splits)``: a
  program takes one sequence, one KV head and one contiguous slice (split) of the context. It
  loads the ``GROUP = num_heads // num_kv_heads`` query rows that share the KV head as one
  ``[BLOCK_H, head_dim]`` tile, so each K/V tile is read once per group, and walks its slice in
  tiles of ``BLOCK_N`` positions gathered through the block table, keeping a running max ``m``,
  sum ``l`` and unnormalised output ``acc`` (log2 domain, float32). With one split it writes the
  normalised output directly; otherwise it stores ``(m, l, acc)`` per split.
* Stage 2, :func:`_paged_decode_reduce_kernel`, grid ``(num_decodes, num_heads)``: combines the
  sequence's non-empty splits, ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with
  ``M = max_s m_s``.

Splitting the context lets a few long sequences still occupy every SM.

Sliding window and logit soft-capping follow transformers' eager attention of Gemma 2/3
(Mistral and Qwen2 share the window): the score is ``s = scale * q.k``, with a soft-cap ``c``
``s = c * tanh(s / c)``; with a window ``w`` the query at position ``p`` sees only the keys at
``k > p - w`` (``sliding_window_overlay``), i.e. its last ``w`` positions. A decode's query
is its last position, so its visible context is the contiguous range ``[seq_len - w,
seq_len)``: the splits cover that range alone and earlier blocks are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.paged_common import (
    check_paged_inputs,
    check_window_softcap,
    dot_options,
    load_kv,
    num_sms,
    scale_view,
    tanh_f32,
)

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256
"""A split covers at least this many positions (fewer make the reduction dominate)."""


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    seq_ids_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    softcap_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    split_len,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    # qk_scale: scale * log2(e), or scale / softcap with SOFTCAP (then softcap_log2 = softcap *
    # log2(e)). WINDOW: the splits start at the window's first position, seq_len - window.
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    h_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    start = split * split_len
    if WINDOW:
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + split_len, seq_len)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        k = load_kv(
            k_cache_ptr, k_scale_ptr, table_ptr, pos, p_mask, kv_head, d, d_mask,
            stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM, QUANT,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
        elif QUANT:  # dequantized to the query's dtype, as the torch path does
            k = k.to(q.dtype)
        if SOFTCAP:
            s = tanh_f32(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale)
            s = s * softcap_log2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(
            v_cache_ptr, v_scale_ptr, table_ptr, pos, p_mask, kv_head, d, d_mask,
            stride_vb, stride_vt, stride_vh, BLOCK_SIZE, HEAD_DIM, QUANT,
        )  # fmt: skip
        if UPCAST:
            v = v.to(tl.float32)
        elif QUANT:  # dequantized to the query's dtype, as the torch path does
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        o_ptr = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partial buffers: m, l [num_decodes, NUM_HEADS, num_splits]; acc [..., HEAD_DIM].
        part = (i.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=h_mask)
        tl.store(l_ptr + part, l_i, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    seq_ids_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    window,
    split_len,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOW: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + i)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW:
        seq_len = tl.minimum(seq_len, window)  # the splits cover the window only
    used = tl.cdiv(seq_len, split_len)  # splits that saw at least one position
    s = tl.arange(0, BLOCK_S)
    s_mask = s < used
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    part = (i.to(tl.int64) * NUM_HEADS + head) * num_splits + s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, 0))
    l_sum = tl.sum(tl.load(l_ptr + part, mask=s_mask, other=0.0) * w, 0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / l_sum
    o_ptr = out_ptr + row * stride_ot + head * stride_oh + d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_block_n(device: torch.device, dtype: torch.dtype) -> int:
    """Context positions per K/V tile: 64 on CUDA (32 for float32, to bound shared memory),
    32 elsewhere (the interpreter)."""
    return 64 if device.type == "cuda" and dtype != torch.float32 else 32


def choose_num_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """Context splits per sequence: enough programs for about two per SM, each split at least
    :data:`MIN_SPLIT_TOKENS` positions (and a whole number of ``block_n`` tiles).

    Two per SM, not more: on an H200 a batch of 64 with 8 KV heads ran faster unsplit than in
    two splits (benchmarks/gpu_kernels.py's sweep; docs/benchmarks.md, "GPU").
    """
    programs = max(1, num_decodes * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms(device), programs)
    most = triton.cdiv(max_seq_len, max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(wanted, most))


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    seq_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Attention of one query token per sequence over its paged context, written into ``out``.

    Sequence ``seq_ids[i]``'s query is row ``query_start_loc[seq]`` of ``query``, at the last
    position ``seq_lens[seq] - 1`` of its context (its own K/V already written); it attends to
    all of it, or with ``window`` to its last ``window`` positions only. Only those rows of
    ``out`` are written. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32, head_dim
            contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the query's
            dtype, or int8 ``[..., head_dim + 2]`` (codes and scale,
            :mod:`asyncllm.attention.kv_int8`; dequantized to the query's dtype per tile).
        out: like ``query`` (any strides with head_dim contiguous); written in place.
        seq_ids: ``[num_decodes]`` int32, the sequences to attend for.
        query_start_loc: ``[num_seqs + 1]`` int32 first query row of each sequence.
        seq_lens: ``[num_seqs]`` int32 context lengths (tokens, >= 1).
        block_tables: ``[num_seqs, max_blocks]`` int32 physical blocks, padded, row-contiguous.
        max_seq_len: ``max(seq_lens[seq_ids])`` on the host (sizes the splits; no device sync).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window in tokens, 0 for none: the query at position ``p`` sees the keys
            at ``k > p - window`` (transformers' ``sliding_window_overlay``, Gemma 2/3, Mistral,
            Qwen2). One at least ``max_seq_len`` runs the kernel without a window.
        softcap: logit soft-cap, 0.0 for none: scores ``s = softcap * tanh(s / softcap)``
            before the mask and the float32 softmax (transformers' Gemma 2 eager attention).
        num_splits: context splits per sequence; None picks one from the device's SM count
            (:func:`choose_num_splits`). 1 skips the reduction kernel.
        block_n: context positions per tile (a power of two >= 16); None:
            :func:`default_block_n`.
        num_warps, num_stages: Triton launch options; None: Triton's defaults.

    Raises:
        ValueError: shapes, dtypes or layouts the kernel does not support.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(
        query, key_cache, value_cache
    )
    num_decodes = seq_ids.shape[0]
    if num_decodes == 0:
        return
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    check_window_softcap(window, softcap)
    windowed = 0 < window < max_seq_len
    span = window if windowed else max_seq_len  # the most positions a decode sees
    dev = query.device
    block_n = block_n or default_block_n(dev, query.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(num_decodes, num_kv_heads, span, block_n, dev)
    split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(span, split_len))
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if num_splits > 1:
        m = torch.empty(num_decodes, num_heads, num_splits, dtype=torch.float32, device=dev)
        l_sum = torch.empty_like(m)
        acc = torch.empty(
            num_decodes, num_heads, num_splits, head_dim, dtype=torch.float32, device=dev
        )
    else:
        m = l_sum = acc = out  # unused by the single-split kernel
    upcast, precision = dot_options(_paged_decode_kernel, query.dtype)
    extra = {
        k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None
    }
    _paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        scale_view(key_cache),
        scale_view(value_cache),
        out,
        m,
        l_sum,
        acc,
        seq_ids,
        query_start_loc,
        seq_lens,
        block_tables,
        scale / softcap if softcap else scale * LOG2E,
        softcap * LOG2E,
        window if windowed else 0,  # one specialization of the int argument without a window
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        split_len,
        num_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1,
        WINDOW=windowed,
        SOFTCAP=softcap > 0.0,
        UPCAST=upcast,
        PRECISION=precision,
        QUANT=key_cache.dtype == torch.int8,
        **extra,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_decodes, num_heads)](
            out,
            m,
            l_sum,
            acc,
            seq_ids,
            query_start_loc,
            seq_lens,
            out.stride(0),
            out.stride(1),
            window if windowed else 0,
            split_len,
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            WINDOW=windowed,
        )
