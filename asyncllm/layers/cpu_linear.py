"""Prepacked oneDNN linear layers for float32 and bfloat16 inference on x86 CPUs.

On CPU, ``nn.Linear`` runs through MKL's sgemm on the weight as stored. oneDNN (bundled with
torch as ``mkldnn``) can reorder a weight once into its blocked layout and multiply it with
any number of rows afterwards; on the default model that is faster at every shape decoding
uses, the LM head at 64 rows most (docs/tuning.md, "CPU fast paths", oneDNN-packed linears).
:func:`pack_linears` swaps each ``nn.Linear`` of a model for a :class:`PackedLinear` holding
only the reordered weight (no second copy), so transformers' modeling code runs unchanged.

The reordered weight is the same numbers; results differ from MKL's in the last bits (another
summation order), as MKL's own results differ between batch sizes.

bfloat16 weights are reordered the same way and multiplied with bfloat16 rows (oneDNN
accumulates in float32 and rounds the output to bfloat16, as ``F.linear`` does). On a CPU
with AVX-512 BF16 / AMX this is where bfloat16 pays: half the weight bytes per decode step
and native bfloat16 dot products (docs/tuning.md, "Weight-only quantization kernels", has
the table: the LM head at 64 rows gains most); without them oneDNN emulates bfloat16 and
:func:`asyncllm.worker.device.resolve_dtype` keeps float32.

Row buckets: oneDNN builds (JIT-compiles) a primitive for every input shape it meets and keeps
it in two caches of 1024 entries each (oneDNN's primitive cache and ideep's, torch's wrapper;
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``), each entry with its scratchpad,
growing with the row count. A server whose steps hold every token count from 1 to the token
budget filled them: RSS grew by hundreds of MiB over minutes of traffic, and each new shape
took a JIT build (docs/benchmarks.md, "Server soak: RSS under bursts of streaming clients",
has the sizes and times).
So a :class:`PackedLinear` only ever runs :func:`bucket_rows` row counts: rows are padded up
to the next bucket (48 buckets up to :data:`CHUNK_ROWS`) and longer inputs go through in
chunks of :data:`CHUNK_ROWS`. Padding costs < 12.5% extra rows on the steps it touches (none
below 17 rows); ``benchmarks/soak_server.py`` shows the resulting flat RSS.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from asyncllm import envs
from asyncllm.kernels import ops

logger = logging.getLogger("asyncllm")

#: Rows the weights are reordered for (oneDNN's hint; any row count works).
PACK_HINT_ROWS = 64

ENV_DISABLE = "ASYNCLLM_CPU_PACKED_LINEAR"

#: The most rows one oneDNN call gets; longer inputs go through in chunks of this many
#: (511 rows of the default model's four projections: 2 threads about as fast in two chunks
#: as in one, 1 thread 5% slower; a bucket per 32 rows beyond 256 would hold ~2.5 MiB each).
CHUNK_ROWS = 256


def bucket_rows(m: int) -> int:
    """The row count ``m`` (0 <= m <= :data:`CHUNK_ROWS`) is padded to: ``m`` itself up to 16
    (small decode batches; 16 buckets), then eight buckets per octave (18, 20, ..., 32, 36,
    ..., 256: 32 more, each < 1.125 m)."""
    if m <= 16:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


_BUCKETS = [bucket_rows(m) for m in range(CHUNK_ROWS + 1)]


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` reordered for oneDNN (float32 or bfloat16, CPU, inference
    only). Inputs of another dtype than the weight's (or on another device, or with autograd
    on) go through ``F.linear`` on the plain weight.

    Args:
        linear: the layer to replace; its weight is reordered (and not kept unless
            ``keep_weight``: a weight tied to the input embeddings stays shared).
        keep_weight: keep ``linear.weight`` as :attr:`weight` (tied weights).
    """

    def __init__(self, linear: nn.Linear, *, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            w.contiguous(), PACK_HINT_ROWS
        )
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = w.dtype
        self._weight = linear.weight if keep_weight else None

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight (a dense copy is made when it was not kept)."""
        if self._weight is not None:
            return self._weight
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Opaque to Inductor (see packed_linear_op). Dynamo's trace only: is_compiling() is
        # process-wide, True for eager steps too while another thread compiles.
        if torch.compiler.is_dynamo_compiling():
            y: torch.Tensor = torch.ops.asyncllm.packed_linear(
                x, self.packed, self.bias, self.in_features, self.out_features
            )
            return y
        if x.dtype != self.dtype or x.device.type != "cpu" or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        m = x.numel() // self.in_features
        if m <= CHUNK_ROWS and _BUCKETS[m] == m:  # the common case: no copy, no slicing
            return _onednn_linear(x, self.packed, self.bias)
        rows = x.reshape(m, self.in_features)
        outs = [self._padded(rows[i : i + CHUNK_ROWS]) for i in range(0, m, CHUNK_ROWS)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(*x.shape[:-1], self.out_features)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [m <= CHUNK_ROWS, in_features] through oneDNN at a bucketed row count."""
        m = rows.shape[0]
        if _BUCKETS[m] != m:
            rows = nn.functional.pad(rows, (0, 0, 0, _BUCKETS[m] - m))
        return _onednn_linear(rows, self.packed, self.bias)[:m]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={str(self.dtype).removeprefix('torch.')}, packed=oneDNN"
        )


def _onednn_linear(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y


@ops.implement("packed_linear")
def packed_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    """A :class:`PackedLinear`'s forward as one op for ``torch.compile``
    (:mod:`asyncllm.worker.compiled`): Inductor cannot trace oneDNN's packed (mkldnn) weight,
    and as an opaque op the row buckets keep bounding oneDNN's caches."""
    layer = PackedLinear.__new__(PackedLinear)
    layer.__dict__.update(
        packed=packed,
        bias=bias,
        dtype=x.dtype,
        _weight=None,
        in_features=in_features,
        out_features=out_features,
    )
    return PackedLinear.forward(layer, x)


def packing_supported(model: nn.Module) -> bool:
    """Float32 or bfloat16 weights on CPU, oneDNN available (with bfloat16 support for
    bfloat16 weights), and not ``ASYNCLLM_CPU_PACKED_LINEAR=0``."""
    if not envs.switch(ENV_DISABLE):
        return False
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return p.dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, and give each
    :class:`~asyncllm.layers.q8_linear.Q8Linear` its packed copy where its C++ kernel is not
    loaded (:meth:`~asyncllm.layers.q8_linear.Q8Linear.pack`); returns how many layers were
    packed.

    A linear whose weight is tied to the input embeddings keeps it (shared). Does nothing,
    and returns 0, where :func:`packing_supported` is False or oneDNN refuses the reorder.
    """
    from asyncllm.layers.q8_linear import Q8Linear

    if not packing_supported(model):
        return 0
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    # Only a plain table's weight can be tied (a quantized table's is a dequantized copy).
    tied = emb.weight if isinstance(emb, nn.Embedding) else None
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear or isinstance(child, Q8Linear)
    ]
    n = 0
    try:
        for parent, name, child in targets:
            if isinstance(child, Q8Linear):
                child.pack()
            else:
                keep = tied is not None and child.weight is tied
                setattr(parent, name, PackedLinear(child, keep_weight=keep))
            n += 1
    except RuntimeError as e:  # a torch build whose oneDNN cannot reorder: leave the rest
        logger.warning("oneDNN weight packing failed after %d layers: %s", n, e)
    if n:
        own_weights(model)
    return n


def own_weights(model: nn.Module) -> int:
    """Copy every parameter and buffer of ``model`` whose memory torch did not allocate (a
    memory-mapped weight file: transformers loads safetensors so) into torch's own; returns
    how many were copied. Tied weights stay tied (one copy per parameter object).

    After packing, only the embedding, the norms and a tied head still point into the file,
    but they keep the whole mapping, with every page the packing read, resident: a float32
    engine held its weights twice (the default model: RSS 1537 -> 1132 MB with this). A file
    mapping is detected by its storage not being resizable.
    """
    copied = 0
    for t in [*model.parameters(), *model.buffers()]:  # a tied one, once copied, is resizable
        if t.device.type == "cpu" and not t.untyped_storage().resizable():
            t.data = t.data.clone()
            copied += 1
    return copied
