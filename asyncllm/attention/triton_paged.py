"""Paged attention through the Triton kernels of :mod:`asyncllm.kernels`: the GPU path.

Same roles and cache layout as :mod:`asyncllm.attention.torch_paged` (the CPU path and the
reference): :meth:`TritonPagedPlan.build` once per step, then per layer :func:`write_kv_cache`
and :func:`paged_attention`. Decodes (``q_len == 1``) go to the split-K decode kernel, longer
chunks to the varlen prefill kernel; a mixed step launches both, over disjoint query rows.
Both take a sliding window and a logit soft-cap with the semantics of transformers' eager
attention for Gemma 2/3 (see :func:`paged_attention`).

The kernel modules (and their ``@triton.jit`` decorations) are imported on first use, so
importing this module, or ``asyncllm``, never needs Triton. On a CPU they run only in Triton's
interpreter: ``TRITON_INTERPRET=1`` set when the process starts (see
:func:`interpreter_enabled`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


def interpreter_enabled() -> bool:
    """Whether the kernels will run in Triton's CPU interpreter.

    True when ``TRITON_INTERPRET`` is on and Triton was not imported before it was set: Triton's
    own ``tl.max``, ``tl.zeros``... are ``@triton.jit`` functions fixed at its import (and
    transformers imports Triton), so the variable must be set when the process starts.
    """
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() not in ("1", "true", "on", "yes"):
        return False
    tl = sys.modules.get("triton.language")
    if tl is None:
        return True
    from triton.runtime.jit import JITFunction

    return not isinstance(tl.zeros, JITFunction)


@dataclass(frozen=True)
class TritonPagedPlan:
    """Index tensors of one step for the Triton kernels, built once and read by every layer.

    Attributes:
        num_tokens: query rows of the step.
        query_start_loc: ``[num_seqs + 1]`` int32 first query row of each sequence.
        seq_lens: ``[num_seqs]`` int32 context lengths including the new tokens.
        block_tables: ``[num_seqs, max_blocks]`` int32 physical blocks, padded with 0.
        decode_seqs: ``[num_decodes]`` int32 sequences with one query token, or None.
        max_decode_len: longest context among them (tokens; 0 without decodes).
        prefill_tile_seqs, prefill_tile_starts: ``[num_tiles]`` int32 sequence and first
            chunk offset of each ``prefill_block_m``-query tile of the longer chunks, or None.
        prefill_block_m: queries per prefill tile.
        max_prefill_len: longest context among the longer chunks' sequences (tokens; 0
            without them).
    """

    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_seqs: torch.Tensor | None
    max_decode_len: int
    prefill_tile_seqs: torch.Tensor | None
    prefill_tile_starts: torch.Tensor | None
    prefill_block_m: int
    max_prefill_len: int

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> TritonPagedPlan:
        """Plan a step (same arguments as :meth:`torch_paged.PagedAttentionPlan.build`).

        Args:
            query_lens: new tokens per sequence (>= 1), in query-row order.
            seq_lens: context length per sequence including its new tokens (tokens).
            block_tables: each sequence's physical blocks, covering ``seq_lens``.
            block_size: tokens per block.
            device: where the index tensors live.

        Raises:
            ValueError: a query longer than its context, or a block table too short.
        """
        from asyncllm.kernels.paged_prefill import prefill_block_m

        device = torch.device(device)
        starts = [0]
        decodes: list[int] = []
        long_q = [q for q in query_lens if q > 1]
        prefill_len = 0
        block_m = prefill_block_m(max(long_q, default=1), device)
        tile_seqs: list[int] = []
        tile_starts: list[int] = []
        rows: list[list[int]] = []
        for b, (q_len, ctx, table) in enumerate(
            zip(query_lens, seq_lens, block_tables, strict=True)
        ):
            n_blocks = -(-ctx // block_size)
            if not 1 <= q_len <= ctx or len(table) < n_blocks:
                raise ValueError(
                    f"sequence {b}: q_len={q_len}, seq_len={ctx}, {len(table)} blocks "
                    f"of {block_size} tokens"
                )
            starts.append(starts[-1] + q_len)
            rows.append(list(table[:n_blocks]))
            if q_len == 1:
                decodes.append(b)
            else:
                prefill_len = max(prefill_len, ctx)
                for s in range(0, q_len, block_m):
                    tile_seqs.append(b)
                    tile_starts.append(s)
        width = max((len(r) for r in rows), default=1)
        padded = [r + [0] * (width - len(r)) for r in rows]

        def i32(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return TritonPagedPlan(
            num_tokens=starts[-1],
            query_start_loc=i32(starts),
            seq_lens=i32(list(seq_lens)),
            block_tables=i32(padded or [[0]]),
            decode_seqs=i32(decodes) if decodes else None,
            max_decode_len=max((seq_lens[b] for b in decodes), default=0),
            prefill_tile_seqs=i32(tile_seqs) if tile_seqs else None,
            prefill_tile_starts=i32(tile_starts) if tile_starts else None,
            prefill_block_m=block_m,
            max_prefill_len=prefill_len,
        )

    def retable(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> TritonPagedPlan:
        """This plan over another layer group's block tables (same step, tables as long):
        only ``block_tables`` is new."""
        width = self.block_tables.shape[1]
        rows = []
        for ctx, table in zip(seq_lens, block_tables, strict=True):
            row = list(table[: -(-ctx // block_size)])
            rows.append(row + [0] * (width - len(row)))
        tables = torch.tensor(rows or [[0]], dtype=torch.int32, device=torch.device(device))
        return replace(self, block_tables=tables)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new K/V rows at their slots with the Triton kernel; negative slots are skipped.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype (any float
            dtype for int8 caches, quantized on the way), head_dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, or int8
            ``[..., head_dim + 2]`` (:mod:`asyncllm.attention.kv_int8`).
        slot_mapping: ``[num_tokens]`` int64 (or int32) flat slots (-1: do not store).

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    from asyncllm.kernels.kv_cache_write import kv_cache_write

    kv_cache_write(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: TritonPagedPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's queries over their paged context (the K/V already written).

    Sequence ``b``'s query rows are the last ``q_len`` positions of its ``seq_len``; the query
    at position ``p`` sees the keys at ``k <= p`` (causal) and, with a ``window``, only those at
    ``k > p - window`` (its last ``window`` positions: transformers' ``sliding_window_overlay``).
    Scores are ``s = scale * q.k``, with a ``softcap`` then ``s = softcap * tanh(s /
    softcap)``, before the mask and the float32 softmax (transformers' Gemma 2/3 eager
    attention). Keys outside the window are not read and weigh exactly zero.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32, head_dim
            contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the
            query's dtype, or int8 ``[..., head_dim + 2]`` (codes and scales,
            :mod:`asyncllm.attention.kv_int8`; dequantized in the kernels).
        plan: the step's :class:`TritonPagedPlan`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window in tokens (the model's ``sliding_window`` on its sliding
            layers); 0: none.
        softcap: attention logit soft-cap (``attn_logit_softcapping``); 0.0: none.
        num_splits: context splits of the decode kernel; None: chosen from the device.
        out: where to write the result (like ``query``, head_dim contiguous); None: a new
            contiguous tensor.

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]``, the query's dtype.

    Raises:
        ValueError: shapes, dtypes or layouts the kernels do not support, a negative window,
            or a negative or non-finite soft-cap.
    """
    from asyncllm.kernels.paged_common import check_window_softcap
    from asyncllm.kernels.paged_decode import paged_decode
    from asyncllm.kernels.paged_prefill import paged_prefill

    check_window_softcap(window, softcap)
    if query.shape[0] != plan.num_tokens:
        raise ValueError(f"query has {query.shape[0]} rows, the plan {plan.num_tokens}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match the query")
    if plan.decode_seqs is not None:
        paged_decode(
            query, key_cache, value_cache, out, plan.decode_seqs, plan.query_start_loc,
            plan.seq_lens, plan.block_tables, plan.max_decode_len, scale, window, softcap,
            num_splits=num_splits,
        )  # fmt: skip
    if plan.prefill_tile_seqs is not None:
        paged_prefill(
            query, key_cache, value_cache, out, plan.prefill_tile_seqs,
            plan.prefill_tile_starts, plan.query_start_loc, plan.seq_lens, plan.block_tables,
            plan.prefill_block_m, scale, window, softcap, max_seq_len=plan.max_prefill_len,
        )  # fmt: skip
    return out
