"""The CPU attention kernel's decode fast path (:mod:`asyncllm.attention.cpu_paged`): a
decode-only step's K/V write and attention in one kernel call per layer
(:func:`write_and_decode`), or armed for the kernel's C++ implementation of
``asyncllm::paged_attention`` (:func:`arm_decode`), and which query and cache dtypes the
kernel reads (:func:`reads_caches`: the query's own, or an int8 cache of
:mod:`asyncllm.attention.kv_int8`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from asyncllm.attention.backend_registry import AttentionMetadata
from asyncllm.kernels import native

if TYPE_CHECKING:
    from asyncllm.attention.cpu_paged import CpuPagedPlan

#: The query dtypes the kernel reads (float16 goes through the torch path); its caches are
#: the query's dtype or int8 (:func:`reads_caches`).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def reads_caches(mod: Any, query: torch.dtype, key: torch.dtype, value: torch.dtype) -> bool:
    """Whether the kernel module ``mod`` (None: none) attends a ``query``-typed query over
    caches of these dtypes: the query's, one of :data:`KERNEL_DTYPES`, or int8 where the
    build reads int8 caches (its ``int8_kv``; builds before it lack it)."""
    if mod is None or query not in KERNEL_DTYPES or key != value:
        return False
    return key == query or (key == torch.int8 and bool(getattr(mod, "int8_kv", False)))


def write_and_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: CpuPagedPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """A decode-only step's whole attention layer in one kernel call: the new K/V written at
    ``slot_mapping`` and every sequence's one query attended (``window``, ``softcap`` as
    :func:`decode_attention`), ``query [R, H, D]``,
    ``key/value [R, Hkv, D]`` -> ``[R, H, D]``, rows past the plan's sequences (padding of
    a compiled step) a copy of the last real row and not written. None where the step has
    prefills or the kernel cannot run it (the caller writes and attends separately then)."""
    if query.dtype != key.dtype:
        return None
    mod, tables = _decode_kernel(plan, key_cache, query.dtype)
    if mod is None:
        return None
    out = torch.empty(query.shape, dtype=query.dtype)
    mod.paged_write_decode(
        query, key, value, key_cache, value_cache, slot_mapping, tables, plan.dec_lens,
        float(scale), int(window), float(softcap), out,
    )  # fmt: skip
    return out


def _decode_kernel(
    plan: CpuPagedPlan, key_cache: torch.Tensor, query: torch.dtype | None = None
) -> tuple[Any, Any]:
    """(the extension, the block tables) where the decode kernel can write and attend the
    whole step (decode-only, one table row per sequence, a CPU cache it reads for a
    ``query``-typed query; None: the cache's own dtype, or bfloat16 over int8), else
    ``(None, None)``."""
    d = plan.base.decodes
    if (
        plan.base.prefills
        or d is None
        or not d.identity
        or plan.dec_lens is None
        or key_cache.device.type != "cpu"
    ):
        return None, None
    mod = native.module("attention")
    q = query or (key_cache.dtype if key_cache.dtype in KERNEL_DTYPES else torch.bfloat16)
    ok = reads_caches(mod, q, key_cache.dtype, key_cache.dtype)
    return (mod, d.block_tables) if ok else (None, None)


def arm_decode(meta: AttentionMetadata) -> Callable[[], None] | None:
    """Hand a decode-only step's caches, slots, block tables and lengths to the kernel's
    C++ implementation of ``asyncllm::paged_attention`` on this thread, so that a compiled
    graph's attention calls run :func:`write_and_decode`'s kernel without Python around it.
    With layer groups each layer gets its group's slots and block tables.

    Returns:
        The function that disarms it (call it after the step), or None where the step or
        the caches do not suit the kernel (then the op runs its Python implementation).
    """
    mod, tables = _decode_kernel(meta.plan, meta.key_caches[0]) if meta.key_caches else (None, None)
    if mod is None:
        return None
    if not meta.layer_groups:
        mod.arm_decode(
            meta.key_caches, meta.value_caches, meta.slot_mapping, tables, meta.plan.dec_lens
        )
        return mod.disarm_decode  # type: ignore[no-any-return]
    arm_groups = getattr(mod, "arm_decode_groups", None)  # not in builds before layer groups
    if arm_groups is None:
        return None
    arm_groups(
        meta.key_caches,
        meta.value_caches,
        list(meta.slot_mappings),
        [_decode_kernel(p, meta.key_caches[0])[1] for p in meta.plans],
        meta.plan.dec_lens,
        list(meta.layer_groups),
    )
    return mod.disarm_decode  # type: ignore[no-any-return]
