"""The attention backend registry: the paged attention backends (torch, Triton; the CPU
kernel registers its own in :mod:`asyncllm.attention.cpu_paged`) the model runner picks from,
and their registration with transformers' attention interface.

transformers' modeling code calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
in every attention layer and forwards the model's extra keyword arguments to it. A model
switched to :data:`ATTN_IMPLEMENTATION` therefore runs unchanged while its K/V go to our
paged cache. The per-step state travels as the keyword argument :data:`METADATA_KWARG` of the
model call, so each engine passes its own cache and nothing lives in a module global.

Under ``torch.compile`` (:mod:`asyncllm.worker.compiled`) the metadata stays out of the
graph: the attention function calls the custom op ``asyncllm::paged_attention`` with tensors
and the layer index only, and the op reads the step's metadata from :func:`step_metadata`,
a thread-local the runner sets around the call (every torch call of an engine runs on its
one compute thread, so engines on other threads do not see it). Dynamo treats the op as
opaque (its fake implementation gives the output's shape), so the code around attention
traces without a graph break and Inductor fuses it. A backend may arm a step for a native
implementation of the op (``AttentionBackend.arm_step``; the CPU kernel's runs decode-only
steps in C++ without calling back into Python, which shortens a batch-1 step; docs/tuning.md,
"The attention op in C++ for decode steps").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from asyncllm.attention import triton_paged
from asyncllm.attention.torch_paged import PagedAttentionPlan, paged_attention, write_kv_cache
from asyncllm.kernels import ops  # declares asyncllm::paged_attention

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
        attend: ``(query, key_cache, value_cache, plan, scale, window, softcap) ->
            [num_tokens, H, D]``; ``window`` > 0: a query at position ``p`` sees only
            positions ``> p - window`` (a sliding window, transformers'
            ``sliding_window_overlay``); ``softcap`` > 0: each scaled score ``s`` becomes
            ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma 2's attention
            logit soft-capping); 0 turns either off.
        write_and_decode: optional fast path for decode-only steps, ``(query, key, value,
            key_cache, value_cache, slot_mapping, plan, scale, window, softcap) -> [R, H,
            D]`` with rows past the plan's sequences zero (padding), or None where it does
            not apply.
        arm_step: optional, ``(metadata) -> disarm or None``: called by
            :func:`step_metadata` to hand a step to a native implementation of
            ``asyncllm::paged_attention`` (the CPU kernel's), ``disarm()`` after the step.
        retable: optional, ``(plan, query_lens, seq_lens, block_tables, block_size,
            device) -> plan``: ``plan`` over other block tables of the same step (another
            layer group's), cheaper than ``build_plan`` (:func:`grouped_metadata`).
    """

    name: str
    build_plan: Callable[..., Any]
    write: Callable[..., None]
    attend: Callable[..., torch.Tensor]
    write_and_decode: Callable[..., torch.Tensor | None] | None = None
    arm_step: Callable[[AttentionMetadata], Callable[[], None] | None] | None = None
    retable: Callable[..., Any] | None = None


TORCH_BACKEND = AttentionBackend(
    "torch",
    PagedAttentionPlan.build,
    write_kv_cache,
    paged_attention,
    retable=PagedAttentionPlan.retable,
)
TRITON_BACKEND = AttentionBackend(
    "triton",
    triton_paged.TritonPagedPlan.build,
    triton_paged.write_kv_cache,
    triton_paged.paged_attention,
    retable=triton_paged.TritonPagedPlan.retable,
)


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one step reads.

    Attributes:
        key_caches, value_caches: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (with layer groups, layers of one slot share a tensor:
            :mod:`asyncllm.worker.kv_cache`).
        slot_mapping: ``[num_tokens]`` int64 flat cache slot of each new token (the first
            layer group's).
        plan: the step's query/context layout, built by ``backend.build_plan`` (the first
            layer group's).
        backend: the implementation that writes and attends.
        layer_groups: per layer, its group; empty: one group (every layer reads ``plan``
            and ``slot_mapping``).
        plans, slot_mappings: per group, its plan and slots (empty with one group).
    """

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    plan: Any
    backend: AttentionBackend = TORCH_BACKEND
    layer_groups: tuple[int, ...] = ()
    plans: tuple[Any, ...] = ()
    slot_mappings: tuple[torch.Tensor, ...] = ()

    def of_layer(self, layer: int) -> tuple[Any, torch.Tensor]:
        """The plan and slot mapping ``layer`` reads (its group's)."""
        if not self.layer_groups:
            return self.plan, self.slot_mapping
        g = self.layer_groups[layer]
        return self.plans[g], self.slot_mappings[g]


def grouped_metadata(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    layer_groups: tuple[int, ...],
    backend: AttentionBackend,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[Sequence[int]]],
    slots: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """A step's metadata: a plan per layer group.

    Args:
        key_caches, value_caches, layer_groups: the cache's
            (:class:`~asyncllm.worker.kv_cache.KVCache`).
        query_lens, seq_lens: per sequence, new tokens and context length (tokens).
        block_tables: per sequence, its block table in each group.
        slots: per group, the flat cache slot of each new token.
    """
    if len(slots) == 1:  # one group: every layer reads the one plan
        plan = backend.build_plan(
            query_lens, seq_lens, [t[0] for t in block_tables], block_size, device
        )
        mapping = torch.tensor(slots[0], dtype=torch.long, device=device)
        return AttentionMetadata(key_caches, value_caches, mapping, plan, backend)
    plans: list[Any] = []
    for g in range(len(slots)):
        tables = [t[g] for t in block_tables]
        if plans and backend.retable is not None:
            plan = backend.retable(plans[0], query_lens, seq_lens, tables, block_size, device)
        else:
            plan = backend.build_plan(query_lens, seq_lens, tables, block_size, device)
        plans.append(plan)
    # One tensor for every group's slots; each group's a contiguous row of it.
    slot_mappings = torch.tensor(slots, dtype=torch.long, device=device).unbind(0)
    return AttentionMetadata(
        key_caches=key_caches,
        value_caches=value_caches,
        slot_mapping=slot_mappings[0],
        plan=plans[0],
        backend=backend,
        layer_groups=layer_groups,
        plans=tuple(plans),
        slot_mappings=tuple(slot_mappings),
    )


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

    Writes the new K/V to the layer's cache, then attends over the paged context, with the
    layer's ``sliding_window`` and ``softcap`` where the modeling code passes them (Gemma
    2/3, Mistral, Qwen2, Phi-3...: see :class:`AttentionBackend`'s ``attend``).

    Returns:
        ``([1, T, H, D], None)`` as transformers expects.

    Raises:
        RuntimeError: the model was called outside a step: without the engine's metadata
            (the keyword or :func:`step_metadata`).
        NotImplementedError: the layer needs attention sinks (``s_aux``, gpt-oss), which the
            paged kernels do not compute (the load-time check refuses such a model).
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    layer = module.layer_idx
    # Dynamo's trace only: torch.compiler.is_compiling() is one flag for the whole process,
    # True on the engine's thread too while the background thread compiles.
    if torch.compiler.is_dynamo_compiling():
        out = torch.ops.asyncllm.paged_attention(q, k, v, layer, scale, window, softcap)
        return out[None], None
    # Some modeling code drops the keyword on its way to the layers (StableLM's decoder
    # layer): the runner also sets the step's metadata on its thread (step_metadata).
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG) or _current()
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention called outside a step (no {METADATA_KWARG} "
            "kwarg and no step_metadata on this thread)"
        )
    return _write_and_attend(meta, layer, q, k, v, scale, window, softcap)[None], None


def _write_and_attend(
    meta: AttentionMetadata,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """``query [R, H, D]``, ``key/value [R, Hkv, D]`` -> contiguous ``[R, H, D]``; rows from
    ``num_tokens`` on (default: none) are padding: no K/V written, and the output of the last
    real row (a padded token repeats the last real one, so the layer's other ops compute it
    as that token and the linear kernels compute a repeated row once)."""
    k_cache, v_cache = meta.key_caches[layer], meta.value_caches[layer]
    plan, slot_mapping = meta.of_layer(layer)
    backend, rows = meta.backend, query.shape[0]
    n = rows if num_tokens is None else min(num_tokens, rows)
    if backend.write_and_decode is not None:
        out = backend.write_and_decode(
            query, key, value, k_cache, v_cache, slot_mapping, plan, scale, window, softcap
        )
        if out is not None:
            return out
    if n < rows:
        out = query.new_zeros(query.shape)
        if n > 0:
            out[:n] = _write_and_attend(
                meta, layer, query[:n], key[:n], value[:n], scale, window, softcap
            )
            out[n:] = out[n - 1]
        return out
    backend.write(key, value, k_cache, v_cache, slot_mapping)
    return backend.attend(query, k_cache, v_cache, plan, scale, window, softcap).contiguous()


_step = threading.local()


def _current() -> AttentionMetadata | None:
    """The metadata :func:`step_metadata` set on this thread, or None."""
    state = getattr(_step, "state", None)
    return None if state is None else state[0]


@contextmanager
def step_metadata(meta: AttentionMetadata | None, num_tokens: int = 0) -> Iterator[None]:
    """Make ``meta`` the metadata ``asyncllm::paged_attention`` reads on this thread.

    Args:
        meta: the step's metadata; None: a dry run (the op writes nothing and returns zeros,
            for compiling a forward without touching a cache).
        num_tokens: the step's real tokens; query rows past them are padding (their output
            rows copy the last real row's and their K/V is not written).
    """
    prev = getattr(_step, "state", None)
    _step.state = (meta, num_tokens)
    arm = None if meta is None else meta.backend.arm_step
    disarm = None if arm is None or meta is None else arm(meta)
    try:
        yield
    finally:
        _step.state = prev
        if disarm is not None:
            disarm()


@ops.implement("paged_attention")
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``asyncllm::paged_attention``: write the new K/V of ``layer`` and attend, with the
    metadata of :func:`step_metadata` (``window``, ``softcap``: as
    :class:`AttentionBackend`'s ``attend``). Registered here as the op's implementation for
    every device (:func:`asyncllm.kernels.ops.implement`): the step's metadata and KV caches
    live with the attention backend, and the torch path and the Triton kernels run here; the
    C++ CPU kernel, where loaded, takes CPU tensors.

    ``query [T, H, D]``, ``key/value [T, Hkv, D]`` -> contiguous ``[T, H, D]``. It writes the
    layer's caches, which are not arguments (they stay out of the compiled graph); the op
    runs once per layer and its output feeds the next layer, so it is never reordered or
    dropped.
    """
    meta, n = getattr(_step, "state", None) or (None, 0)
    if meta is None:
        return query.new_zeros(query.shape)
    return _write_and_attend(meta, layer, query, key, value, scale, window, softcap, n)


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
