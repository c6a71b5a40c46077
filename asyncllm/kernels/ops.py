"""asyncllm's custom ops, declared once: schema, shape function (fake) and torch reference.

Every op lives in the namespace ``asyncllm`` and is declared here with
``torch.library.Library`` (a plain definition: the attention op runs 30 times a decode step,
and ``torch.library.custom_op``'s Python dispatch adds to every call: docs/tuning.md,
"Costs behind smaller code choices"). Each has:

* its fake implementation, for ``torch.compile`` (:mod:`asyncllm.worker.compiled`), which
  keeps the ops opaque in its graphs;
* an implementation for every device (``CompositeExplicitAutograd``): the torch reference,
  or the layer's own dispatch over the C++ kernels where that is Python, registered by the
  module that owns it with :func:`implement` (``paged_attention``'s by
  :mod:`asyncllm.attention.backend_registry`; this package never imports the layers or the
  attention backends);
* where a C++ kernel exists, its CPU kernel, registered by the kernel module's
  ``register_ops()`` when :func:`asyncllm.kernels.native.module` loads it (``csrc/``).

=================  ==========================================  =============================
op                 what                                        C++ CPU kernel
=================  ==========================================  =============================
paged_attention    write a layer's K/V, attend (the step's     ``csrc/paged_attention.cpp``
                   metadata: attention.backend_registry)
int4_linear        ``x W^T + b``, W int4 with group scales     ``csrc/int4_linear.cpp``
q8_0_linear        ``x W^T + b``, W int8 codes, scales per     ``csrc/q8_linear.cpp``
                   16/32 columns (+ offsets): GGUF Q8_0,
                   Q5_0, Q6_K, Q5_K (logits: float32 out)
packed_linear      ``x W^T + b``, W packed by oneDNN           (oneDNN)
materialize        copies Inductor does not fuse through       (clone)
=================  ==========================================  =============================
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["LIB", "implement", "int4_linear_reference", "torch_scales"]

LIB = torch.library.Library("asyncllm", "DEF")

_F = TypeVar("_F", bound=Callable[..., Any])

LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
    "int window, float softcap) -> Tensor"
)
LIB.define(
    "int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor? bias, "
    "int group_size, int in_features, int out_features, int max_rows, int gemv_rows) -> Tensor"
)
LIB.define(
    "q8_0_linear(Tensor x, Tensor q, Tensor scale, Tensor? packed, Tensor? bias, int max_rows,"
    " bool logits=True, Tensor? offset=None) -> Tensor"
)
LIB.define(
    "packed_linear(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features)"
    " -> Tensor"
)
LIB.define("materialize(Tensor[] xs) -> Tensor[]")


def implement(name: str) -> Callable[[_F], _F]:
    """Register the decorated function as op ``name``'s implementation for every device
    (the C++ CPU kernel, where one is loaded, takes precedence on CPU tensors)."""

    def register(fn: _F) -> _F:
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


# --- paged_attention ---------------------------------------------------------------------


@torch.library.register_fake("asyncllm::paged_attention", lib=LIB)
def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    return query.new_empty(query.shape)


# Its implementation for every device is registered by the attention backend
# (asyncllm.attention.backend_registry.paged_attention_op): the step's metadata and KV caches
# live there, not in arguments (they stay out of compiled graphs).


# --- int4_linear -------------------------------------------------------------------------


@torch.library.register_fake("asyncllm::int4_linear", lib=LIB)
def _int4_linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    in_features: int,
    out_features: int,
    max_rows: int,
    gemv_rows: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


#: Tile-major scales converted by :func:`torch_scales`, by ``id`` of the tensor: (a weak
#: reference to it, the conversion). An entry goes when its tensor does.
_TORCH_LAYOUT: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def torch_scales(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """An ``Int4Linear``'s scales in torch's int4 layout: ``[K / group, N, 2]`` (scale, zero)
    as it is, or from the tile-major float32 ``[N / 64, K / group, 2, 64]`` (scale, offset)
    with ``zero = offset + 8 * scale`` rounded once from float64 to float32 (what
    ``Int4Linear`` stored in that layout before). Converted once per tensor (the weights are
    never written in place): a decode step would otherwise convert each layer's again."""
    if scales_and_zeros.dim() != 4:
        return scales_and_zeros
    key = id(scales_and_zeros)
    entry = _TORCH_LAYOUT.get(key)
    if entry is None or entry[0]() is not scales_and_zeros:
        t = scales_and_zeros.double().permute(1, 2, 0, 3).flatten(2)  # [G, 2, N]
        scale, offset = t[:, 0], t[:, 1]
        converted = torch.stack([scale, offset + 8 * scale], -1).float().contiguous()

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            if _TORCH_LAYOUT.get(key, (None,))[0] is ref:
                del _TORCH_LAYOUT[key]

        entry = (weakref.ref(scales_and_zeros, forget), converted)
        _TORCH_LAYOUT[key] = entry
    return entry[1]


@implement("int4_linear")
def int4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    in_features: int,
    out_features: int,
    max_rows: int = 0,
    gemv_rows: int = 0,
) -> torch.Tensor:
    """``y = x W^T + b`` for an ``Int4Linear``'s buffers with torch's int4 kernel
    (``aten._weight_int4pack_mm_for_cpu``) at every row count: ``x [..., in_features]`` ->
    ``[..., out_features]`` in ``x``'s dtype, computed in ``scales_and_zeros``' dtype.
    ``w[n, k] = (q - 8) * scale + zero`` (the packed layout: ``asyncllm.kernels.int4_dequant``;
    tile-major scales and offsets are converted by :func:`torch_scales`). The path where the
    C++ kernel (``csrc/int4_linear.cpp``, the same plus its few-row and many-row paths) is
    not installed or switched off; ``max_rows``/``gemv_rows`` are that kernel's thresholds,
    unused here."""
    rows = x.reshape(-1, in_features).to(scales_and_zeros.dtype).contiguous()  # torch's kernel
    sz = torch_scales(scales_and_zeros)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, sz)
    y = y.view(*x.shape[:-1], out_features).to(x.dtype)
    return y if bias is None else y + bias


# --- q8_0_linear -------------------------------------------------------------------------


@torch.library.register_fake("asyncllm::q8_0_linear", lib=LIB)
def _q8_0_linear_fake(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    max_rows: int,
    logits: bool = True,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    dtype = torch.float32 if logits else x.dtype
    return x.new_empty((*x.shape[:-1], q.shape[0]), dtype=dtype)


# --- packed_linear -----------------------------------------------------------------------


@torch.library.register_fake("asyncllm::packed_linear", lib=LIB)
def _packed_linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# --- materialize -------------------------------------------------------------------------


@torch.library.register_fake("asyncllm::materialize", lib=LIB)
def _materialize_fake(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


@implement("materialize")
def materialize(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``xs``, as one op Inductor does not fuse through: what computes ``xs`` is
    run once into buffers, instead of being inlined into (recomputed by) every consumer.
    Inductor inlines a cheap pointwise result into each of its readers; for the rotary
    cos/sin (read by every layer's query and key) that meant ``cos``/``sin`` of the
    positions once per layer and per head element (docs/tuning.md, "Compiled forward",
    "Rotary cos/sin once per step")."""
    return [x.clone() for x in xs]
