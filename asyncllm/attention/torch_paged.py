"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Layout (PagedAttention, Kwon et al., SOSP 2023): each layer has a key cache and a value cache
of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a sequence lives
in block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot is
``block * block_size + offset``.

A step's queries are flattened over sequences (varlen, no padding): sequence ``b`` owns query
rows ``query_start_loc[b]:query_start_loc[b + 1]``, which are its last ``q_len`` positions of
``seq_lens[b]`` (context including the new tokens). Query ``i`` attends to context positions
``<= seq_lens[b] - q_len + i``: causal inside the chunk, full over earlier blocks. Grouped-query
attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Per layer, a sliding window of ``w`` positions keeps only the context positions ``> p - w``
for the query at position ``p`` (transformers' ``sliding_window_overlay``: Mistral, Gemma 2/3,
Qwen2's sliding layers), and attention logit soft-capping replaces each scaled score ``s`` by
``c * tanh(s / c)`` before the mask (Gemma 2; transformers' ``eager_attention_forward``).

An int8 cache (:mod:`asyncllm.attention.kv_int8`: ``head_dim + 2`` int8 elements a row, codes
and scale) is quantized on write and its gathered rows dequantized to the query's dtype
before the attention.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from asyncllm.attention.kv_int8 import dequantize, is_quantized, quantize


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new K/V rows at their slots; rows whose slot is negative are skipped.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype (any float
            dtype for an int8 cache: quantized here, :func:`~asyncllm.attention.kv_int8.quantize`).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (int8:
            ``head_dim + 2``).
        slot_mapping: ``[num_tokens]`` int64 flat slots (-1: do not store).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if is_quantized(key_cache):
        key, value = quantize(key), quantize(value)
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def padded_tables(
    tables: Sequence[Sequence[int]], width: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[len(tables), width]`` int64 block tables, each padded with block 0: filled through
    an ``array`` (faster than ``torch.tensor`` of nested lists, a cost paid once per step and
    layer group; docs/tuning.md, "Sliding-window layers (Gemma 3): the per-layer-type
    pool")."""
    flat = array("q", bytes(8 * len(tables) * width))
    for i, t in enumerate(tables):
        flat[i * width : i * width + len(t)] = array("q", t)
    out = torch.frombuffer(flat, dtype=torch.long) if flat else torch.zeros(0, dtype=torch.long)
    return out.view(len(tables), width).to(device)


@dataclass(frozen=True)
class _Decodes:
    rows: torch.Tensor  # [Bd] query rows of single-token sequences
    block_tables: torch.Tensor  # [Bd, max_blocks] int64
    flat_blocks: torch.Tensor  # [Bd * max_blocks] int64, the tables row by row
    lens: torch.Tensor  # [Bd] int64 context lengths
    mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend
    identity: bool  # rows are 0..Bd-1 and cover the whole step
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def mask_for(self, window: int) -> torch.Tensor:
        """The mask with a sliding window of ``window`` positions (0: none), built once per
        step and window."""
        if window <= 0:
            return self.mask
        if window not in self.windowed:
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)[None, :]
            seen = self.mask[:, 0, 0] & (pos >= self.lens[:, None] - window)
            self.windowed[window] = seen[:, None, None, :]
        return self.windowed[window]


@dataclass(frozen=True)
class _Prefill:
    start: int  # first query row
    end: int  # one past the last query row
    blocks: torch.Tensor  # [num_blocks_used] int64
    ctx_len: int
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when plain causal
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The mask with a sliding window of ``window`` positions (0: none; None: plain
        causal), built once per step and window."""
        if window <= 0 or window >= self.ctx_len:  # no position falls out of the window
            return self.mask
        if window not in self.windowed:
            dev = self.blocks.device
            q_pos = torch.arange(self.ctx_len - (self.end - self.start), self.ctx_len, device=dev)
            k_pos = torch.arange(self.ctx_len, device=dev)[None, :]
            self.windowed[window] = (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
        return self.windowed[window]


@dataclass(frozen=True)
class PagedAttentionPlan:
    """Index tensors for one step, built once and reused by every layer.

    Build it with :meth:`build`; decodes (``q_len == 1``) are batched into one attention call,
    longer chunks run one call per sequence.
    """

    num_tokens: int
    decodes: _Decodes | None
    prefills: tuple[_Prefill, ...]

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedAttentionPlan:
        """Plan a step.

        Args:
            query_lens: new tokens per sequence (>= 1), in query-row order.
            seq_lens: context length per sequence including its new tokens (tokens).
            block_tables: each sequence's physical blocks, covering ``seq_lens``.
            block_size: tokens per block.
            device: where the index tensors live.
        """
        dec_rows: list[int] = []
        dec_tables: list[Sequence[int]] = []
        dec_lens: list[int] = []
        prefills: list[_Prefill] = []
        row = 0
        for q_len, ctx, table in zip(query_lens, seq_lens, block_tables, strict=True):
            n_blocks = -(-ctx // block_size)
            if q_len == 1:
                dec_rows.append(row)
                dec_tables.append(table[:n_blocks])
                dec_lens.append(ctx)
            else:
                mask = None
                if ctx != q_len:
                    q_pos = torch.arange(ctx - q_len, ctx, device=device)
                    mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
                blocks = torch.tensor(table[:n_blocks], dtype=torch.long, device=device)
                prefills.append(_Prefill(row, row + q_len, blocks, ctx, mask))
            row += q_len
        decodes = None
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            lens = torch.tensor(dec_lens, device=device)
            mask = torch.arange(width * block_size, device=device)[None, :] < lens[:, None]
            tables = padded_tables(dec_tables, width, device)
            decodes = _Decodes(
                rows=torch.tensor(dec_rows, dtype=torch.long, device=device),
                block_tables=tables,
                flat_blocks=tables.view(-1),
                lens=lens,
                mask=mask[:, None, None, :],
                identity=len(dec_rows) == row,
            )
        return PagedAttentionPlan(row, decodes, tuple(prefills))

    def retable(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedAttentionPlan:
        """This plan over other block tables of the same step (another layer group's, as
        long as these): only the block ids are new; rows, lengths and masks (and the
        windowed masks built from them) are shared."""
        dec_tables: list[Sequence[int]] = []
        blocks: list[torch.Tensor] = []
        for q_len, ctx, table in zip(query_lens, seq_lens, block_tables, strict=True):
            n_blocks = -(-ctx // block_size)
            if q_len == 1:
                dec_tables.append(table[:n_blocks])
            else:
                blocks.append(torch.tensor(table[:n_blocks], dtype=torch.long, device=device))
        decodes = self.decodes
        if decodes is not None:
            tables = padded_tables(dec_tables, decodes.block_tables.shape[1], device)
            decodes = replace(decodes, block_tables=tables, flat_blocks=tables.view(-1))
        prefills = tuple(replace(p, blocks=b) for p, b in zip(self.prefills, blocks, strict=True))
        return PagedAttentionPlan(self.num_tokens, decodes, prefills)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., n_blocks]`` block ids -> ``[..., num_kv_heads, n_blocks * block_size, head_dim]``
    (an int8 cache's rows dequantized to ``dtype``)."""
    g = cache[blocks]  # [..., n_blocks, block_size, Hkv, D]
    if is_quantized(cache):
        g = dequantize(g, dtype)
    g = g.flatten(-4, -3)  # [..., L, Hkv, D]
    return g.transpose(-3, -2)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """``q [B, Hkv, M, D]`` over ``k/v [B, Hkv, L, D]`` (the M rows of a KV head: its query
    heads, or its query heads times tokens), ``mask`` broadcastable to ``[B, Hkv, M, L]``
    (True = attend; None: causal, M == L). Soft-capped scores (``softcap`` > 0) are not
    something ``scaled_dot_product_attention`` computes: those go through an explicit
    float32 softmax, as transformers' eager attention does."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
        )
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of a step's queries over their paged context (the K/V already written).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the
            query's dtype, or int8 ``[..., head_dim + 2]`` (dequantized to the query's dtype).
        plan: the step's :class:`PagedAttentionPlan`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: a sliding window of this many positions (0: none), see the module's text.
        softcap: attention logit soft-capping (0: none), see the module's text.

    Returns:
        ``[num_tokens, num_heads, head_dim]``, the query's dtype.
    """
    out = torch.empty_like(query)
    d = plan.decodes
    if d is not None:
        # All single-token sequences at once. The G = H / Hkv query heads that share a KV
        # head are that head's G query rows (one SDPA "sequence" of G queries, no causal
        # mask between them), so each gathered K/V row is read once per group rather than
        # once per query head; index_select copies whole blocks.
        q = query if d.identity else query[d.rows]  # [Bd, H, D]
        bd, n_blk = d.block_tables.shape
        _, bs, hkv, row = key_cache.shape
        shape = (bd, n_blk * bs, hkv, row)
        k = key_cache.index_select(0, d.flat_blocks).view(shape)
        v = value_cache.index_select(0, d.flat_blocks).view(shape)
        if is_quantized(key_cache):
            k, v = dequantize(k, query.dtype), dequantize(v, query.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        dim = q.shape[-1]
        heads = q.shape[1]
        o = _attention(
            q.reshape(bd, hkv, heads // hkv, dim), k, v, d.mask_for(window), scale, softcap
        ).reshape(bd, heads, dim)
        if d.identity:
            return o
        out[d.rows] = o
    for p in plan.prefills:
        q = query[p.start : p.end].transpose(0, 1)  # [H, q_len, D]
        k = _gather(key_cache, p.blocks, query.dtype)[:, : p.ctx_len]
        v = _gather(value_cache, p.blocks, query.dtype)[:, : p.ctx_len]
        # 4-D inputs: CPU SDPA takes its flash kernel only for [B, H, L, D] (3-D ones go
        # to the unfused math path, much slower on a long chunk: docs/tuning.md, "Costs
        # behind smaller code choices").
        mask = p.mask_for(window)
        if softcap <= 0:
            o = F.scaled_dot_product_attention(
                q[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )[0]
        else:
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            o = _attention(q[None], k[None], v[None], mask, scale, softcap)[0]
        out[p.start : p.end] = o.transpose(0, 1)
    return out
