"""Prefill attention over a paged KV cache: varlen chunks, causal inside each chunk.

Algorithm: the forward pass of FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", 2023): tiles of ``BLOCK_M`` queries against tiles of
``BLOCK_N`` keys with an online softmax in float32 (log2 domain), here with K/V gathered
through the block table of vLLM's PagedAttention (Kwon et al., SOSP 2023).

Grid ``(num_tiles, num_heads)``: tile ``t`` is ``BLOCK_M`` consecutive queries of sequence
``tile_seqs[t]``, starting at chunk offset ``tile_starts[t]`` (a host-built list, so many
sequences of different lengths share one launch without idle programs). The chunk's ``q_len``
queries are the last positions of the sequence's ``seq_len``-token context: query ``i`` sits at
position ``seq_len - q_len + i`` and attends to every position up to its own, i.e. all earlier
blocks (prefix-cache hits, earlier chunks) and causally within the chunk. A tile stops at the
position of its last query, so later K/V tiles are never read.

Sliding window and logit soft-capping follow transformers' eager attention of Gemma 2/3
(Mistral and Qwen2 share the window): the score is ``s = scale * q.k``, with a soft-cap ``c``
``s = c * tanh(s / c)``; with a window ``w`` the query at ``p`` additionally sees only the keys
at ``k > p - w`` (``sliding_window_overlay``). A tile then starts at its first query's first
visible position, so the blocks before it are never read, and masks the rest per query.
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
    scale_view,
    tanh_f32,
)

LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    tile_seqs_ptr,
    tile_starts_ptr,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    # qk_scale: scale * log2(e), or scale / softcap with SOFTCAP (then softcap_log2 = softcap *
    # log2(e)).
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seqs_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    i = tile_start + tl.arange(0, BLOCK_M)
    i_mask = i < q_len
    q_pos = prefix + i
    rows = (q_begin + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = i_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)

    end = tl.minimum(seq_len, prefix + tile_start + BLOCK_M)  # last query's position + 1
    begin = 0
    if WINDOW:
        begin = tl.maximum(prefix + tile_start - window + 1, 0)  # first query's first key
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n in range(begin, end, BLOCK_N):
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
        visible = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
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

    l_i = tl.where(i_mask, l_i, 1.0)  # rows past the chunk are not stored
    out = acc / l_i[:, None]
    o_ptr = out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_block_m(max_query_len: int, device: torch.device) -> int:
    """Queries per tile: the next power of two of the longest chunk, between 16 and 64 on CUDA
    (16 and 32 elsewhere, for the interpreter)."""
    cap = 64 if device.type == "cuda" else 32
    return min(cap, max(16, triton.next_power_of_2(max(max_query_len, 1))))


def default_block_n(device: torch.device, dtype: torch.dtype) -> int:
    """Context positions per K/V tile: 64 on CUDA (32 for float32, to bound shared memory),
    32 elsewhere (the interpreter)."""
    return 64 if device.type == "cuda" and dtype != torch.float32 else 32


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    tile_seqs: torch.Tensor,
    tile_starts: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_m: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Causal attention of prefill chunks over their paged context, written into ``out``.

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b + 1]``, the last
    ``q_len`` positions of its ``seq_lens[b]``-token context (K/V of all of them already in the
    cache); the query at position ``p`` sees the keys at ``k <= p``, and with ``window`` only
    those at ``k > p - window``. Only the rows of the tiled sequences are written. Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32, head_dim
            contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the query's
            dtype, or int8 ``[..., head_dim + 2]`` (codes and scale,
            :mod:`asyncllm.attention.kv_int8`; dequantized to the query's dtype per tile).
        out: like ``query`` (any strides with head_dim contiguous); written in place.
        tile_seqs: ``[num_tiles]`` int32 sequence of each query tile.
        tile_starts: ``[num_tiles]`` int32 first chunk offset of each tile (a multiple of
            ``block_m``); the tiles of a sequence must cover its ``q_len`` queries.
        query_start_loc: ``[num_seqs + 1]`` int32 query row offsets.
        seq_lens: ``[num_seqs]`` int32 context lengths including the chunk (tokens).
        block_tables: ``[num_seqs, max_blocks]`` int32 physical blocks, padded, row-contiguous.
        block_m: queries per tile (a power of two >= 16), the one ``tile_starts`` was built with.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window in tokens, 0 for none: the query at position ``p`` sees the keys
            at ``k > p - window`` (transformers' ``sliding_window_overlay``, Gemma 2/3, Mistral,
            Qwen2).
        softcap: logit soft-cap, 0.0 for none: scores ``s = softcap * tanh(s / softcap)``
            before the mask and the float32 softmax (transformers' Gemma 2 eager attention).
        max_seq_len: the longest context among the tiled sequences, known on the host; a window
            at least this long runs the kernel without one. None: not known.
        block_n: context positions per tile (a power of two >= 16); None:
            :func:`default_block_n`.
        num_warps, num_stages: Triton launch options; None: Triton's defaults.

    Raises:
        ValueError: shapes, dtypes or layouts the kernel does not support.
    """
    num_heads, num_kv_heads, head_dim, block_size = check_paged_inputs(
        query, key_cache, value_cache
    )
    num_tiles = tile_seqs.shape[0]
    if num_tiles == 0:
        return
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    check_window_softcap(window, softcap)
    windowed = window > 0 and (max_seq_len is None or window < max_seq_len)
    upcast, precision = dot_options(_paged_prefill_kernel, query.dtype)
    extra = {
        k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None
    }
    _paged_prefill_kernel[(num_tiles, num_heads)](
        query,
        key_cache,
        value_cache,
        scale_view(key_cache),
        scale_view(value_cache),
        out,
        tile_seqs,
        tile_starts,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_M=block_m,
        BLOCK_N=block_n or default_block_n(query.device, query.dtype),
        BLOCK_SIZE=block_size,
        WINDOW=windowed,
        SOFTCAP=softcap > 0.0,
        UPCAST=upcast,
        PRECISION=precision,
        QUANT=key_cache.dtype == torch.int8,
        **extra,
    )
