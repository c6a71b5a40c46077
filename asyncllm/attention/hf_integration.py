"""Our paged attention registered with transformers' attention interface.

transformers' modeling code calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
in every attention layer and forwards the model's extra keyword arguments to it. A model
switched to :data:`ATTN_IMPLEMENTATION` therefore runs unchanged while its K/V go to our
paged cache. The per-step state travels as the keyword argument :data:`METADATA_KWARG` of the
model call, so each engine passes its own cache and nothing lives in a module global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from asyncllm.attention import triton_paged
from asyncllm.attention.torch_paged import PagedAttentionPlan, paged_attention, write_kv_cache

ATTN_IMPLEMENTATION = "asyncllm_paged"
METADATA_KWARG = "asyncllm_attn"


@dataclass(frozen=True)
class AttentionBackend:
    """One paged attention implementation; the model runner picks one per engine.

    Attributes:
        name: "torch" (:mod:`~asyncllm.attention.torch_paged`) or "triton"
            (:mod:`~asyncllm.attention.triton_paged`).
        build_plan: ``(query_lens, seq_lens, block_tables, block_size, device) -> plan``.
        write: ``(key, value, key_cache, value_cache, slot_mapping) -> None``.
        attend: ``(query, key_cache, value_cache, plan, scale) -> [num_tokens, H, D]``.
    """

    name: str
    build_plan: Callable[..., Any]
    write: Callable[..., None]
    attend: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend("torch", PagedAttentionPlan.build, write_kv_cache, paged_attention)
TRITON_BACKEND = AttentionBackend(
    "triton",
    triton_paged.TritonPagedPlan.build,
    triton_paged.write_kv_cache,
    triton_paged.paged_attention,
)


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one step reads.

    Attributes:
        key_caches, value_caches: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 flat cache slot of each new token.
        plan: the step's query/context layout, built by ``backend.build_plan``.
        backend: the implementation that writes and attends.
    """

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    plan: Any
    backend: AttentionBackend = TORCH_BACKEND


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]``.

    Writes the new K/V to the layer's cache, then attends over the paged context.

    Returns:
        ``([1, T, H, D], None)`` as transformers expects.

    Raises:
        RuntimeError: the model was called without the engine's metadata.
    """
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the {METADATA_KWARG} kwarg")
    layer = module.layer_idx
    k_cache, v_cache = meta.key_caches[layer], meta.value_caches[layer]
    meta.backend.write(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = meta.backend.attend(query[0].transpose(0, 1), k_cache, v_cache, meta.plan, scale)
    return out[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # Masking is implied by the plan; skip transformers' dense [T, T] mask.
    return None


def register() -> str:
    """Register the attention and its (absent) mask with transformers; idempotent.

    Returns:
        The ``attn_implementation`` name to set on a model.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
