"""The pre-allocated paged KV cache tensors and their sizing.

A model with sliding-window layers gets a hybrid layout (:mod:`asyncllm.core.kv_groups`):
its layers in groups of ``g``, one block table per group, and ``g`` K and ``g`` V tensors
(*slots*) that the groups share: a block holds ``g`` layers' K/V, layer ``s`` of the group
whose table holds it in slot ``s``. ``KVCache.key_caches[layer]`` is its slot's tensor, so
the layers of one slot see the same tensor (each through its own group's block table).

With ``kv_cache_dtype="int8"`` the tensors are int8, each token-head row ``head_dim`` codes
and its float16 scale (:mod:`asyncllm.attention.kv_int8`): every per-block datum lives in
the slot tensors (:meth:`KVCache.block_tensors`), so a block copy between two pools of the
same spec (:func:`copy_blocks_between`) carries the scales with the codes.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.attention.kv_int8 import LAYOUT_VERSION, QUANTIZED_KV_DTYPES, row_dim
from asyncllm.core.kv_groups import KVGroups

CPU_MEMORY_FRACTION = 0.2
"""Share of the available host memory a CPU engine's KV cache takes when not told."""

CUDA_MEMORY_FRACTION = 0.8
"""Share of the device memory left free after loading the weights a CUDA KV cache takes."""


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's K/V across the model.

    Attributes:
        num_layers: attention layers.
        num_kv_heads: key/value heads per layer.
        head_dim: features per head.
        dtype: the model's dtype (the cache's element type unless quantized).
        block_size: tokens per block.
        groups: the layer groups (None: one group of all layers, full attention).
        kv_cache_dtype: "auto" (K/V in ``dtype``) or "int8" (codes and a float16 scale
            per token and head: :mod:`asyncllm.attention.kv_int8`).

    The repr names the int8 row layout's version (``kv_int8.LAYOUT_VERSION``) when
    quantized: the disk tier keys its files by it, so files of another int8 layout (float32
    scales, before version 2) are never read as this one.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    groups: KVGroups | None = None
    kv_cache_dtype: str = "auto"

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        layout = f", int8_layout={LAYOUT_VERSION}" if self.quantized else ""
        return f"KVCacheSpec({fields}{layout})"

    @property
    def quantized(self) -> bool:
        """K/V stored as int8 codes with scales (``kv_cache_dtype="int8"``)."""
        return self.kv_cache_dtype in QUANTIZED_KV_DTYPES

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type of the cache tensors (int8 when quantized, else ``dtype``)."""
        return QUANTIZED_KV_DTYPES.get(self.kv_cache_dtype, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one slot tensor: ``(block_size, num_kv_heads, row)``; ``row`` is
        ``head_dim``, or ``head_dim + 2`` int8 elements when quantized."""
        return (self.block_size, self.num_kv_heads, row_dim(self.head_dim, self.quantized))

    @property
    def kv_dtype_name(self) -> str:
        """The cache's element type as reported: "int8" or e.g. "bfloat16"."""
        return str(self.storage_dtype).removeprefix("torch.")

    @property
    def layer_groups(self) -> KVGroups:
        """The layer groups (one of all layers when ``groups`` is None)."""
        return self.groups if self.groups is not None else KVGroups.single(self.num_layers)

    @property
    def num_slots(self) -> int:
        """Layers whose K/V one block holds (all layers without groups)."""
        return self.num_layers if self.groups is None else self.groups.num_slots

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in one block table: ``2 (K and V) x slots x kv_heads x row x
        element bytes`` (slots: all layers, or a group's with layer groups; row: head_dim,
        or head_dim + 2 int8 bytes with its scale when quantized)."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        _, heads, row = self.block_shape
        return 2 * self.num_slots * heads * row * elem

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across its slots, K and V."""
        return self.bytes_per_token * self.block_size


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: host ``MemAvailable`` on CPU, ``cudaMemGetInfo`` free on CUDA (bytes)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_cache_bytes(device: torch.device, cap_bytes: int) -> int:
    """The KV budget when the config gives none (see :class:`asyncllm.EngineConfig`)."""
    fraction = CUDA_MEMORY_FRACTION if device.type == "cuda" else CPU_MEMORY_FRACTION
    return min(int(available_memory_bytes(device) * fraction), cap_bytes)


def expected_windows(config: Any) -> list[int]:
    """The sliding window (tokens; 0: none) each layer's attention must apply, from the
    config: ``layer_types`` where it has them, else its ``sliding_window`` on every layer
    (unless ``use_sliding_window`` is off). A window at least ``max_position_embeddings``
    long is none."""
    cfg = config.get_text_config(decoder=True)
    layers = int(cfg.num_hidden_layers)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    longest = getattr(cfg, "max_position_embeddings", None)
    if window and longest and window >= int(longest):
        window = 0
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else 0 for kind in types]
    if getattr(cfg, "use_sliding_window", True) is False:
        return [0] * layers
    return [window] * layers


def kv_cache_spec(
    config: object,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
) -> KVCacheSpec:
    """The per-token K/V shape of a transformers decoder config (``head_dim`` when the
    config has one, else ``hidden_size // num_attention_heads``; ``num_key_value_heads``
    for grouped-query attention, else one K/V head per query head), with layer groups
    where its layers have sliding windows shorter than ``max_model_len``
    (:func:`expected_windows`, :meth:`KVGroups.of_windows`), stored as ``kv_cache_dtype``
    ("auto" or "int8").

    Raises:
        ValueError: an unknown ``kv_cache_dtype``, or "int8" with a head size that is not
            even (the float16 scale after the codes must stay 2-byte aligned).
    """
    if kv_cache_dtype != "auto" and kv_cache_dtype not in QUANTIZED_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {kv_cache_dtype!r}")
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    if kv_cache_dtype != "auto" and head_dim % 2:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs an even head_dim, got {head_dim}"
        )
    groups = KVGroups.of_windows(expected_windows(config), max_model_len)
    return KVCacheSpec(
        num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        groups=groups if groups.is_hybrid else None,
        kv_cache_dtype=kv_cache_dtype,
    )


def size_kv_cache(
    model_config: object,
    dtype: torch.dtype,
    device: torch.device,
    *,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int | None,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[KVCacheSpec, int]:
    """The KV cache's shape and its number of blocks.

    Args:
        model_config: the model's transformers config (:func:`kv_cache_spec`).
        dtype: the cache's element type (the model's).
        device: where the cache lives.
        block_size: tokens per block.
        max_model_len: the longest sequence, tokens.
        max_num_seqs: the most sequences running at once.
        kv_cache_bytes: the budget in bytes; None: :func:`default_kv_cache_bytes` of the
            device's free memory, capped at ``max_num_seqs`` sequences of
            ``max_model_len`` tokens (each in whole blocks; with layer groups, the blocks
            one such sequence holds at once: :meth:`KVGroups.blocks_per_sequence`).
        max_num_batched_tokens: the longest chunk a step computes (a sliding group holds
            its window plus a chunk); None: ``max_model_len``.
        kv_cache_dtype: "auto" or "int8" (:func:`kv_cache_spec`); the number of blocks
            follows its real bytes per token (scales included).

    Returns:
        (the spec, the number of blocks the budget holds).

    Raises:
        ValueError: a budget that cannot hold one sequence of ``max_model_len`` tokens, or
            a ``kv_cache_dtype`` :func:`kv_cache_spec` refuses.
    """
    spec = kv_cache_spec(model_config, dtype, block_size, max_model_len, kv_cache_dtype)
    # Whole blocks per sequence: a block size that does not divide max_model_len still
    # leaves room for one sequence of max_model_len tokens per max_num_seqs.
    chunk = max_num_batched_tokens or max_model_len
    per_seq = spec.layer_groups.blocks_per_sequence(max_model_len, block_size, chunk)
    cap = max_num_seqs * per_seq * spec.bytes_per_block
    budget = kv_cache_bytes or default_kv_cache_bytes(device, cap)
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < per_seq:
        raise ValueError(
            f"kv_cache_bytes={budget} holds {num_blocks * block_size} tokens "
            f"({spec.bytes_per_token} bytes per token), fewer than max_model_len="
            f"{max_model_len} tokens need ({per_seq} blocks of {block_size}): raise "
            "kv_cache_bytes or lower max_model_len"
        )
    return spec, num_blocks


def zeros_on_demand(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose host memory is committed page by page as it is written.

    On CPU the tensor lies in a private anonymous ``mmap``: the kernel hands out zero pages
    on first touch, so a process's resident memory (RSS) grows with the KV blocks actually
    used, not with the budget (``torch.zeros`` writes every page up front). Not shared:
    ``mmap``'s default, a shared mapping, is shmem (RssShmem, and seen by a forked child).
    Not advised ``MADV_HUGEPAGE``: 2 MiB pages made decode attention 5-13% faster (1-2% of a
    step) but zero 2 MiB of every layer's K and V at the first write of a block into a new
    huge page (~120 MB at once for the default model) and grow RSS in those steps
    (``benchmarks/kv_huge_pages.py``, docs/tuning.md). Elsewhere: ``torch.zeros``.

    Raises:
        ValueError: the host refuses to reserve the mapping (more than its memory and
            overcommit allow), naming ``kv_cache_bytes``, instead of a bare ``OSError``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    private = (
        {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    )
    try:
        buf = mmap.mmap(-1, max(nbytes, 1), **private)
    except OSError as exc:  # ENOMEM: past what the kernel's overcommit lets one reserve
        raise ValueError(
            f"cannot reserve {nbytes} bytes of host memory for the KV cache ({exc}): lower "
            "EngineConfig.kv_cache_bytes (or leave it None)"
        ) from exc
    # The tensor keeps the mapping alive (frombuffer holds a reference to ``buf``).
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)


def copy_blocks_between(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """Copy blocks ``src_ids[i]`` of every tensor of ``src`` to blocks ``dst_ids[i]`` of the
    matching tensor of ``dst`` (``[num_blocks, *block_shape]`` each, e.g.
    :meth:`KVCache.block_tensors` of a device pool and of a host pool of the same spec;
    either side may be the other's device): one gather and one scatter per tensor for all
    blocks, never a copy per block from Python. The destination may be ``src`` itself
    (copy-on-write); the sources are gathered before any is written.

    Raises:
        ValueError: the lists differ in length, or a pair's block shapes or dtypes differ.
    """
    if len(src) != len(dst) or len(src_ids) != len(dst_ids):
        raise ValueError(
            f"{len(src)} source and {len(dst)} destination tensors, {len(src_ids)} source "
            f"and {len(dst_ids)} destination blocks"
        )
    if not src_ids:
        return
    for s, d in zip(src, dst, strict=True):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise ValueError(
                f"blocks {tuple(s.shape[1:])} {s.dtype} cannot go to {tuple(d.shape[1:])} {d.dtype}"
            )
    s_ids = torch.tensor(src_ids, dtype=torch.long, device=src[0].device)
    d_ids = torch.tensor(dst_ids, dtype=torch.long, device=dst[0].device)
    for s, d in zip(src, dst, strict=True):
        moved = s.index_select(0, s_ids)
        if moved.device != d.device:
            moved = moved.to(d.device, non_blocking=d.device.type == "cuda")
        d.index_copy_(0, d_ids, moved)


class KVCache:
    """One K and one V tensor per slot, ``[num_blocks, block_size, num_kv_heads, row]``
    (row: ``head_dim``, or ``head_dim + 2`` int8 codes and scale with an int8 cache; a slot
    per layer without layer groups; see the module's text).

    Allocated once, zero-filled so that never-written slots read as finite numbers; on CPU
    committed page by page as blocks are first written (:func:`zeros_on_demand`).

    Args:
        spec: the per-token shape.
        num_blocks: blocks per slot (>= 1).
        device: where the tensors live.

    Attributes:
        key_slots, value_slots: the tensors, one per slot.
        key_caches, value_caches: per layer, its slot's tensor.
        layer_groups: per layer, the group whose block table it reads; empty with one
            group (every layer reads the one table).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, *spec.block_shape)
        dtype = spec.storage_dtype
        self.key_slots = [zeros_on_demand(shape, dtype, device) for _ in range(spec.num_slots)]
        self.value_slots = [zeros_on_demand(shape, dtype, device) for _ in range(spec.num_slots)]
        groups = spec.layer_groups
        where = groups.layer_slots()
        self.key_caches = [self.key_slots[s] for _, s in where]
        self.value_caches = [self.value_slots[s] for _, s in where]
        self.layer_groups: tuple[int, ...] = (
            tuple(g for g, _ in where) if groups.num_groups > 1 else ()
        )

    @property
    def num_bytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return self.num_blocks * self.spec.bytes_per_block

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds per-block state, ``[num_blocks, *spec.block_shape]``:
        each slot's K, then each slot's V (an int8 cache's scales are inside them). What a
        block copy must copy (:func:`copy_blocks_between`)."""
        return self.key_slots + self.value_slots

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every slot's K and V (copy-on-write); one
        gather and one scatter per tensor for all pairs."""
        tensors = self.block_tensors()
        copy_blocks_between(tensors, tensors, [s for s, _ in pairs], [d for _, d in pairs])
