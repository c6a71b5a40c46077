"""C++ decode and prefill attention over the paged cache, for CPUs (the "cpu" attention
backend).

The torch path (:mod:`asyncllm.attention.torch_paged`) gathers every sequence's K and V
blocks into new tensors, then runs ``scaled_dot_product_attention`` on them (once for the
decodes, once per prefill chunk): each layer writes and reads the whole context twice more
than attention needs, and each chunk costs a few torch calls. At W1's batch of 64 that is
most of the attention time; at W2's 570-token contexts it rivals the weights. This module's
kernels read K and V in place through the block tables instead, once, with an online
softmax over a tile of up to 16 positions of a block at a time, for the ``G`` query heads
that share a KV head together (vLLM's CPU backend does the same in its own C++).

Decode-only steps go through ``paged_decode`` (one query token per sequence, its blocks read
in parts of 256 positions with all KV heads: the work items when the sequences are fewer
than twice the threads, else one item per sequence; the parts' softmax states merged in
order either way, so a sequence's output does not depend on its batch or the thread count:
docs/tuning.md, "Decode attention in parts"). A step with
prefill chunks (a new prompt, a prompt after a prefix-cache hit, a chunk of a long prompt,
decodes mixed in) goes through ``paged_prefill``: a work item is one sequence's KV head and
a tile of up to 16 of its query tokens (16 x G query rows), causal within the chunk (query
token ``i`` of a chunk after ``ctx`` cached tokens sees positions ``0 .. ctx + i``), so each
K/V row is read once per tile and not once per token; items go to the threads longest first.
With AVX-512 the tile's K rows are transposed once so a row's 16 scores are plain FMAs.
In a decode step, sequences whose block tables start with the same blocks (prefix caching:
requests after one system prompt) are attended over those shared blocks together first, as
one work item per KV head and part of the group with all their query rows (cascade
attention), so a shared block's K/V rows are read once per group instead of once per
sequence; each sequence then goes on over its own blocks from that softmax state (W2's
decode, 32 sequences after a 528-token shared prompt, gains most; ``benchmarks/attention_kernel.py``
measures it: docs/tuning.md, "Cascade attention over shared prefixes").
Chunks of a bfloat16 step that share such a prefix (whole blocks cached before all of them)
are cascaded too, the prefix part by torch's flash attention for all the group's rows at
once (its bfloat16 GEMMs run on AMX), which returns the log-sum-exp the chunk kernel starts
from (:class:`SharedChunks`, :data:`MIN_SHARED_PAIRS`; W2's second step gains most:
docs/tuning.md, "Cascade attention for prefill chunks").
Bfloat16 chunks with ``q_len * seq_len >= TORCH_MIN_PAIRS`` stay on the torch path, whose
flash attention (bfloat16 GEMMs) is faster there (a long prompt); many short prompts, chunks
after a cached context and prefills mixed with decodes are faster in the kernel, and in
float32 every case is (``benchmarks/prefill_attention.py``; docs/tuning.md, "C++ paged
prefill (chunk) attention", has the times).

Queries are float32 or bfloat16 (the engine's dtype), caches the same or int8 codes with a
scale per row (:mod:`asyncllm.attention.kv_int8`: K rows widened times their scale, V scales
folded into the softmax weights; no cascade over them); all the arithmetic is in
float32 either way (a bfloat16 element widens exactly to float32 with a shift), and the
output is rounded to the query's dtype, as the torch path's ``scaled_dot_product_attention``
does. A bfloat16 cache is half the bytes to read. Each K and V row is widened once for the
``G`` query heads that read it; where the compiler targets AVX-512 and the head size is 64,
80 or 128, intrinsics reduce a tile's 16 dot products per head into one vector (or, for a
prefill's many rows, compute them against the tile's transposed K rows), take their online
softmax in one vector, and keep the heads' output accumulators in registers over the
tile (elsewhere portable, auto-vectorized C++ computes the same, up to summation order).
``benchmarks/attention_kernel.py`` times the decode kernel against an earlier revision.

The kernels (``csrc/paged_attention.cpp``) are built when the package is installed, in each
instruction-set variant (:mod:`asyncllm.kernels.native` imports the one this CPU runs).
Where they are not installed the engine keeps the torch path (one warning);
``EngineConfig.attention_backend="torch"`` chooses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.attention.backend_registry import AttentionBackend
from asyncllm.attention.cpu_decode import (
    KERNEL_DTYPES,
    arm_decode,
    reads_caches,
    write_and_decode,
)
from asyncllm.attention.torch_paged import (
    PagedAttentionPlan,
    padded_tables,
    paged_attention,
    write_kv_cache,
)
from asyncllm.kernels import native
from asyncllm.kernels.native import cpu_flags


def load() -> Any:
    """The kernel module (best installed variant), or None where it is not installed (the
    reason in :func:`failure`)."""
    return native.module("attention")


def failure() -> str | None:
    """Why the kernel could not be loaded, or None."""
    return native.failure("attention")


def available() -> bool:
    """The kernel is installed."""
    return load() is not None


#: torch's flash attention outruns the chunk kernel on long bfloat16 chunks only where its
#: GEMMs run on AMX tiles. On a 2-core AMD EPYC (Zen 5: AVX-512 BF16, no AMX) the kernel was
#: the faster on every case of ``benchmarks/prefill_attention.py`` (2 threads; W2's shared
#: prefix faster in the kernel alone than with the cascade below; docs/tuning.md, "A CPU
#: without AMX"), so there neither routing below applies.
_FLASH_PAYS = "amx_bf16" in cpu_flags()

#: Where the kernel's shared-prefix GEMMs run (native bfloat16 brgemm without AMX).
_GEMM_PAYS = not _FLASH_PAYS and "avx512_bf16" in cpu_flags()

#: A bfloat16 prefill chunk of ``q_len`` tokens reaching ``seq_len`` tokens of context goes
#: through the torch path where ``q_len * seq_len`` (query-position pairs, causal mask
#: aside) is at least this (on CPUs with AMX, :data:`_FLASH_PAYS`; elsewhere never): there
#: ``scaled_dot_product_attention``'s flash kernel (bfloat16 GEMMs) outruns the C++ kernel's
#: float32 FMAs. ``benchmarks/prefill_attention.py`` on a 2-core Xeon with AMX at the
#: engine's 2 threads put the crossover here: torch faster on a 512-token prompt and on 64
#: tokens after 512 cached, about even on 160 new tokens, the kernel faster on 48 after 512,
#: 128 new, W2's second step and short prompts. In float32 the kernel is the faster on all
#: of them, so every chunk goes through it (docs/tuning.md, "C++ paged prefill (chunk)
#: attention", has the ratios).
TORCH_MIN_PAIRS = 28_000 if _FLASH_PAYS else 1 << 62


#: A prefix of whole blocks that two or more chunks of a bfloat16 step share, all cached
#: before them, is attended for all their query rows at once by torch's flash attention
#: (bfloat16 GEMMs on AMX) where ``rows x prefix tokens`` is at least this;
#: the chunk kernel goes on from that state over each sequence's other positions (cascade
#: attention). ``benchmarks/prefill_attention.py --cases shared``, 2 threads: the cascade
#: was the faster from W2's second and third steps (17 x 28 rows after 512 shared tokens,
#: 14 x 14 after 528) down to 16 x 3 after 512 (24576 pairs); forced below that it was even
#: or slower (32 x 2, 4 x 16 and 8 x 5 after 256). Float32 steps keep the kernel (no AMX:
#: the cascade measured slower), and so do CPUs without AMX.
#: Without AMX but with AVX-512 BF16 (:data:`_GEMM_PAYS`) the group's rows go through the
#: kernel's own GEMMs instead (``shared_prefix_attention``: oneDNN's brgemm on
#: ``vdpbf16ps``), faster than the kernel alone on every case measured on a 2-core Zen 5,
#: down to the smallest, 4 x 16 after 256 (16384 pairs). docs/tuning.md, "Cascade attention
#: for prefill chunks", has the figures of both.
MIN_SHARED_PAIRS = 24576 if _FLASH_PAYS else 16384 if _GEMM_PAYS else 1 << 62


@dataclass(frozen=True)
class SharedChunks:
    """Cascade attention for the chunks of a step: sequences grouped by a shared prefix.

    Attributes:
        skip: ``[B]`` int64, the blocks of each sequence's context attended with its group
            (0: not in a group).
        groups: per group, ``(prefix block ids [nb] int64, the members' query rows [Tg]
            int64)``.
    """

    skip: torch.Tensor
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @staticmethod
    def build(
        picked: Sequence[tuple[int, int, int, Sequence[int]]],
        block_size: int,
        device: torch.device | str,
    ) -> SharedChunks | None:
        """Sequences (as :meth:`ChunkLayout.build`'s) grouped by their first block; a
        group's prefix is the blocks all its members' tables agree on from the start, within
        each member's cached context (whole blocks before its chunk). None without a group of
        two or more whose rows x prefix tokens reach :data:`MIN_SHARED_PAIRS`."""
        by_first: dict[int, list[int]] = {}
        for i, (_, q_len, seq_len, table) in enumerate(picked):
            if (seq_len - q_len) // block_size >= 1:
                by_first.setdefault(table[0], []).append(i)
        skip = [0] * len(picked)
        groups = []
        for members in by_first.values():
            tables = [picked[i][3] for i in members]
            nb = min((picked[i][2] - picked[i][1]) // block_size for i in members)
            n = 1
            while n < nb and all(t[n] == tables[0][n] for t in tables):
                n += 1
            rows = [r for i in members for r in range(picked[i][0], picked[i][0] + picked[i][1])]
            if len(members) < 2 or len(rows) * n * block_size < MIN_SHARED_PAIRS:
                continue
            for i in members:
                skip[i] = n
            blocks = torch.tensor(list(tables[0][:n]), dtype=torch.long, device=device)
            groups.append((blocks, torch.tensor(rows, dtype=torch.long, device=device)))
        if not groups:
            return None
        return SharedChunks(torch.tensor(skip, dtype=torch.long, device=device), tuple(groups))

    def attend(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's rows of ``query [R, H, D]`` over its prefix: ``(out [R, H, D],
        lse [R, H])`` float32 (softmax-normalized output and log-sum-exp of the scaled
        scores; rows of no group are left unset), by the kernel's bfloat16 GEMMs
        (``shared_prefix_attention``) where they run and AMX does not, else by
        ``aten._scaled_dot_product_flash_attention_for_cpu`` in the query's dtype, a group's
        ``G`` query heads per KV head as more rows of that head."""
        R, H, D = query.shape
        hkv = key_cache.shape[2]
        out = torch.empty((R, H, D), dtype=torch.float32, device=query.device)
        lse = torch.empty((R, H), dtype=torch.float32, device=query.device)
        mod = load()
        if (
            not _FLASH_PAYS
            and mod is not None
            and query.dtype == key_cache.dtype == torch.bfloat16
            and mod.shared_prefix_gemm_available(D)
        ):
            for blocks, rows in self.groups:
                mod.shared_prefix_attention(
                    query, key_cache, value_cache, blocks, rows, float(scale), out, lse
                )
            return out, lse
        for blocks, rows in self.groups:
            t = rows.numel()
            q = query.index_select(0, rows).view(t, hkv, H // hkv, D).transpose(0, 1)
            k = key_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None]
            v = value_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None]
            o, s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.reshape(1, hkv, -1, D), k, v, scale=scale
            )
            out[rows] = o[0].view(hkv, t, H // hkv, D).transpose(0, 1).reshape(t, H, D).float()
            lse[rows] = s[0].view(hkv, t, H // hkv).transpose(0, 1).reshape(t, H)
        return out, lse


@dataclass(frozen=True)
class ChunkLayout:
    """The sequences of a step that the chunk kernel attends (:func:`chunk_attention`).

    Attributes:
        tables: ``[B, M]`` int64 block tables, padded with block 0.
        seq_lens: ``[B]`` int64 context lengths including the new tokens.
        query_start: ``[B]`` int64 first query row of each.
        query_lens: ``[B]`` int64 query rows (new tokens) of each.
        shared: their shared prefixes (cascade attention), or None.
    """

    tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    query_lens: torch.Tensor
    shared: SharedChunks | None = None

    @staticmethod
    def build(
        picked: Sequence[tuple[int, int, int, Sequence[int]]],
        device: torch.device | str,
        block_size: int = 0,
    ) -> ChunkLayout:
        """From ``(first row, q_len, seq_len, block table)`` per sequence; with a
        ``block_size``, their shared prefixes too."""
        width = max(len(t) for *_, t in picked)

        def col(i: int) -> torch.Tensor:
            return torch.tensor([p[i] for p in picked], dtype=torch.long, device=device)

        tables = padded_tables([t for *_, t in picked], width, device)
        shared = SharedChunks.build(picked, block_size, device) if block_size else None
        return ChunkLayout(tables, col(2), col(0), col(1), shared)


@dataclass(frozen=True)
class CpuPagedPlan:
    """The torch plan (the fallback) plus what the kernels read.

    Attributes:
        base: the torch path's plan of the whole step.
        torch_part: ``base``'s long prefill chunks only (:data:`TORCH_MIN_PAIRS`), the ones
            the torch path attends beside the kernel in bfloat16.
        dec_lens: ``[Bd]`` int64 context lengths (tokens) of the decodes, None without any.
        chunks: every sequence of a step with prefills (decodes included), for the chunk
            kernel; None in a decode-only step (``base.decodes`` has those).
        short_chunks: ``chunks`` less ``torch_part``'s (the same object where that is
            empty); None where every sequence is in ``torch_part``.
    """

    base: PagedAttentionPlan
    torch_part: PagedAttentionPlan
    dec_lens: torch.Tensor | None
    chunks: ChunkLayout | None = None
    short_chunks: ChunkLayout | None = None

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> CpuPagedPlan:
        """Plan a step (arguments as :meth:`PagedAttentionPlan.build`)."""
        base = PagedAttentionPlan.build(query_lens, seq_lens, block_tables, block_size, device)
        lens = [s for q, s in zip(query_lens, seq_lens, strict=True) if q == 1]
        dec_lens = torch.tensor(lens, dtype=torch.long, device=device) if lens else None
        long_ = tuple(p for p in base.prefills if (p.end - p.start) * p.ctx_len >= TORCH_MIN_PAIRS)
        torch_part = PagedAttentionPlan(base.num_tokens, None, long_)
        if not base.prefills:
            return CpuPagedPlan(base, torch_part, dec_lens)
        every: list[tuple[int, int, int, Sequence[int]]] = []  # (start, q_len, seq_len, table)
        row = 0
        for q, n, table in zip(query_lens, seq_lens, block_tables, strict=True):
            every.append((row, q, n, table[: -(-n // block_size)]))
            row += q
        chunks = ChunkLayout.build(every, device, block_size)
        short = [c for c in every if c[1] == 1 or c[1] * c[2] < TORCH_MIN_PAIRS]
        if len(short) == len(every):
            return CpuPagedPlan(base, torch_part, dec_lens, chunks, chunks)
        short_chunks = ChunkLayout.build(short, device, block_size) if short else None
        return CpuPagedPlan(base, torch_part, dec_lens, chunks, short_chunks)

    def retable(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> CpuPagedPlan:
        """This plan over another layer group's block tables (same step): a decode-only
        step's new block ids only (:meth:`PagedAttentionPlan.retable`); a step with
        prefills is planned again."""
        if self.chunks is not None or self.base.prefills:
            return CpuPagedPlan.build(query_lens, seq_lens, block_tables, block_size, device)
        base = self.base.retable(query_lens, seq_lens, block_tables, block_size, device)
        return CpuPagedPlan(base, self.torch_part, self.dec_lens)


def _check_dtypes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> Any:
    """The loaded extension, once the dtypes are known to suit it.

    Raises:
        RuntimeError: the kernel is not available.
        ValueError: the query is not one of :data:`KERNEL_DTYPES`, or the caches are neither
            its dtype nor int8 (:func:`reads_caches`).
    """
    mod = load()
    if mod is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {failure()}")
    if not reads_caches(mod, query.dtype, key_cache.dtype, value_cache.dtype):
        raise ValueError(
            f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} must share "
            f"one of {KERNEL_DTYPES} (or the caches be int8)"
        )
    return mod


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``[Bd, H, D]`` attention of one query token per sequence over its paged context, in
    the query's dtype (``window``, ``softcap``: a sliding window and attention logit
    soft-capping, as :class:`~asyncllm.attention.backend_registry.AttentionBackend`'s
    ``attend``; 0: none).

    Raises:
        RuntimeError: the kernel is not available.
        ValueError: as :func:`_check_dtypes`.
    """
    mod = _check_dtypes(query, key_cache, value_cache)
    out = torch.empty(query.shape, dtype=query.dtype)
    mod.paged_decode(
        query, key_cache, value_cache, block_tables, lens, float(scale), int(window),
        float(softcap), out,
    )  # fmt: skip
    return out


def chunk_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    shared: SharedChunks | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``[T, H, D]`` causal attention of chunks of any length over their paged context, in
    the query's dtype (the K/V of the new tokens already written).

    Sequence ``b`` owns query rows ``query_start[b] : query_start[b] + query_lens[b]``, its
    last ``query_lens[b]`` positions of ``seq_lens[b]``; its query token ``i`` sees
    positions ``0 .. seq_lens[b] - query_lens[b] + i`` (the layout of
    :mod:`~asyncllm.attention.torch_paged`).

    Args:
        query: ``[T, H, D]`` (rows may be strided).
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous (int8:
            ``D + 2``, :mod:`~asyncllm.attention.kv_int8`).
        block_tables: ``[B, M]`` int64.
        seq_lens, query_start, query_lens: ``[B]`` int64 (tokens, rows, rows).
        scale: softmax scale.
        out: ``[T, H, D]`` contiguous, the query's dtype, to write the sequences' rows into
            (the others are left as they are); default a new tensor.
        shared: the sequences' shared prefixes: attended first per group
            (:meth:`SharedChunks.attend`), the kernel going on from that state; not with a
            ``window`` or ``softcap``.
        window, softcap: as :func:`decode_attention`.

    Raises:
        RuntimeError: the kernel is not available, the shapes do not match, or ``shared``
            comes with a window or soft-capping.
        ValueError: as :func:`decode_attention`.
    """
    mod = _check_dtypes(query, key_cache, value_cache)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    init: tuple[torch.Tensor | None, ...] = (None, None, None)
    if shared is not None:
        init = (shared.skip, *shared.attend(query, key_cache, value_cache, scale))
    mod.paged_prefill(
        query, key_cache, value_cache, block_tables, seq_lens, query_start, query_lens,
        float(scale), int(window), float(softcap), out, *init,
    )  # fmt: skip
    return out


def _kernel_reads(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The caches and query suit the kernels (else the torch path runs)."""
    return (
        reads_caches(load(), query.dtype, key_cache.dtype, value_cache.dtype)
        and key_cache.device.type == "cpu"
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPagedPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Like :func:`~asyncllm.attention.torch_paged.paged_attention`; float32 or bfloat16
    caches on CPU (the query of the same dtype) go through the kernels: a decode-only step
    through the decode kernel, a step with prefill chunks through the chunk kernel (its
    decodes too), but for long bfloat16 chunks (:data:`TORCH_MIN_PAIRS`); everything else
    through the torch path. Shared prefixes (cascade attention) only without a ``window``
    or ``softcap``."""
    if not _kernel_reads(query, key_cache, value_cache):
        return paged_attention(query, key_cache, value_cache, plan.base, scale, window, softcap)
    if plan.chunks is not None:
        chunks = plan.chunks if query.dtype == torch.float32 else plan.short_chunks
        if chunks is plan.chunks:
            out = torch.empty(query.shape, dtype=query.dtype)
        else:  # empty_like of a strided query is strided: the kernel writes a contiguous one
            out = paged_attention(
                query, key_cache, value_cache, plan.torch_part, scale, window, softcap
            )
            if chunks is None:  # every sequence went to the torch path
                return out
            out = out.contiguous()
        cascade = key_cache.dtype == torch.bfloat16 and window <= 0 and softcap <= 0
        return chunk_attention(
            query, key_cache, value_cache, chunks.tables, chunks.seq_lens, chunks.query_start,
            chunks.query_lens, scale, out, chunks.shared if cascade else None, window, softcap,
        )  # fmt: skip
    d = plan.base.decodes
    if d is None or plan.dec_lens is None:  # an empty step
        return paged_attention(query, key_cache, value_cache, plan.base, scale, window, softcap)
    return decode_attention(
        query, key_cache, value_cache, d.block_tables, plan.dec_lens, scale, window, softcap
    )


CPU_BACKEND = AttentionBackend(
    "cpu",
    CpuPagedPlan.build,
    write_kv_cache,
    paged_attention_cpu,
    write_and_decode,
    arm_decode,
    CpuPagedPlan.retable,
)
"""The C++ kernels, the torch path for long chunks ("auto" on CPU when they build)."""

__all__ = [
    "CPU_BACKEND",
    "KERNEL_DTYPES",
    "MIN_SHARED_PAIRS",
    "TORCH_MIN_PAIRS",
    "ChunkLayout",
    "CpuPagedPlan",
    "SharedChunks",
    "arm_decode",
    "available",
    "chunk_attention",
    "decode_attention",
    "failure",
    "load",
    "paged_attention_cpu",
    "reads_caches",
    "write_and_decode",
    "write_kv_cache",
]
