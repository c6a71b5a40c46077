"""GGUF's ``Q8_0`` (and ``Q5_0``, ``Q6_K``, ``Q5_K``) linear layer: int8 codes with one scale
per 32 input columns (16 for ``Q6_K``), and for ``Q5_K`` an offset per 32.

GGUF files of llama.cpp ship the LM head (or the token embedding table it is tied to) as
``Q8_0`` (ggml's ``block_q8_0``: a float16 ``d`` and 32 signed bytes, ``w = d * q``); no torch
kernel takes int8 codes with a scale per 32 columns (``aten._weight_int8pack_mm`` has one per
output channel). :class:`Q8Linear` keeps the codes (SmolLM2-135M's 49152 x 576 head: 31 MB
instead of 57 MB of bfloat16) and computes ``y = x W^T (+ b)`` as one op,
``asyncllm::q8_0_linear``, with float32 output whatever the model's dtype: the logits as the
kernels sum them, not rounded to bfloat16 (8 significant bits make exact ties of distinct
logits: the default model's first answer to "What is the capital of France?" tied "L" with
"The" at -1.9743 and greedy took "L'Étoile..."; the float32 sums put "The" ahead):

* up to :data:`MAX_ROWS` rows (decode of a few sequences, the last prompt token of a
  prefill): this module's C++ matrix-vector kernel over the codes, float32 arithmetic from
  the exact weights (a float16 ``d`` times a code is exact in float32). At one row it reads
  half the bytes of the bfloat16 head;
* more rows, bfloat16 where oneDNN's brgemm runs natively (AMX or AVX-512 BF16:
  :func:`mm_available`): ``q8_mm``, per block of 64 outputs the codes dequantized into a
  per-thread scratch (the values the dense head held: ``d * q`` rounded once to bfloat16)
  and multiplied there by brgemm, with float32 accumulation, no dense copy of the weight
  anywhere. W1 on the default model (batch 64): faster than the packed copy on AMX, as fast
  on AVX-512 BF16, with 57 MB less resident memory (docs/tuning.md, "Weight-only
  quantization kernels" and "A CPU without AMX");
* more rows otherwise (float32 models, CPUs without native bfloat16): ``q8_mm_f32``, the
  same per block of 64 outputs in float32 (oneDNN's float32 brgemm, ``at::mm`` above 128
  rows), the weights exact. A packed dense copy of the weight in the model's dtype
  (:meth:`Q8Linear.pack`, called by :func:`asyncllm.layers.cpu_linear.pack_linears`) is made
  only where the C++ kernel is not loaded; without either, the float32 weight is dequantized
  per call.

The decoder layers' ``Q8_0``, ``Q5_0`` and ``Q6_K`` linears (``Q5_0``'s ``d * (q - 16)`` is a
``Q8_0`` block of codes ``q - 16``; ``Q6_K``'s ``(d * sc) * (q - 32)`` per 16 weights is one of
codes ``q - 32`` and a float32 scale ``d * sc`` per 16 columns, exact) run through the same op
with ``logits=False``: the output in the
activations' dtype, and no packed dense copy: more rows than :data:`MAX_ROWS` take ``q8_mm``
(bfloat16, where it runs) or ``q8_mm_f32`` (float32: per block of 64 outputs the codes
dequantized exactly into a per-thread scratch ``W^T`` [K, 64], by which oneDNN's float32
brgemm multiplies a tile of rows: as fast as the packed dense GEMM at 9-512 rows,
docs/tuning.md, "GGUF Q8_0 and Q5_0 decoder linears as codes"), so a float32
model computes ``x W^T`` of the file's exact weights up to float32 summation order and holds
~1.13 bytes a weight instead of 4 (1.25 for ``Q6_K``).

``Q5_K`` (``(d * sc) * q - dmin * m`` per 32 weights, q in 0..31) keeps its codes ``q``, the
exact scale ``d * sc`` and an offset ``-(dmin * m)`` per 32 columns (``offset``): the
matrix-vector kernel adds ``offset . (x's sums per group)`` to each output (1/32 of the
multiply-adds), the many-row kernels dequantize ``scale * q + offset`` (the product exact, so
one rounding: gguf's values). No centring of the codes folds the offset away exactly: ``q - 16``
with the offset ``-(dmin * m) + 16 * d * sc`` would round that sum (as the int4 layers' zero
of ``Q4_K`` does), and 5-bit codes do not fit the int4 kernels.

The kernel (``csrc/q8_linear.cpp``) is built when the package is installed
(:mod:`asyncllm.kernels.native`; ``ASYNCLLM_Q8_KERNEL=0`` turns it off).
:mod:`asyncllm.models.quantization` uses this layer only where the kernel has its AVX-512
path (:func:`fast`); elsewhere the head stays dense.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.kernels import native, ops

__all__ = ["ENV_SWITCH", "GROUPS", "MAX_ROWS", "Q8Linear", "fast", "kernel"]

#: The input width is a multiple of this (Q8_0's block; the kernels dequantize 32 at a time).
BLOCK = 32
#: Input columns per scale the kernels take: 32 (Q8_0, Q5_0, Q5_K), 16 (Q6_K).
GROUPS = (32, 16)

#: Rows dequantized at a time for the dense copy (4096 x 576 float32: 9 MiB).
_DEQUANT_ROWS = 4096

ENV_SWITCH = native.SWITCHES["q8"]

#: Calls with more rows than this take the many-row path (``q8_mm`` or ``q8_mm_f32``); up to
#: this many, the matrix-vector kernel, whose time grows with the rows.
MAX_ROWS = 8


def kernel() -> Any:
    """The Q8_0 kernel module, or None where it is switched off or not installed."""
    return native.module("q8")


def fast() -> bool:
    """The kernel has its AVX-512 path here (the one worth using)."""
    mod = kernel()
    return mod is not None and bool(mod.q8_fast())


def mm_available() -> bool:
    """The many-row kernel (``q8_mm``: dequantize per block of 64 outputs + oneDNN's
    brgemm, bfloat16) runs here (native bfloat16); else more than :data:`MAX_ROWS` rows take
    ``q8_mm_f32``."""
    return _mm_runs(kernel())


def _mm_runs(mod: Any) -> bool:
    return mod is not None and bool(mod.q8_mm_available())


#: Bytes of 5-bit codes per :data:`BLOCK` columns: 16 bytes, then a 32-bit word.
Q5_BLOCK_BYTES = 20


def pack5(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes [out, in] in -16..15 (``in`` a multiple of 32) as 5-bit codes, uint8
    [out, in / 32 * 20]: per 32 columns of ``u = code + 16``, 16 bytes (byte ``j``: column
    ``j``'s ``u`` in bits 0-4, bits 2-4 of column ``j + 16``'s in bits 5-7) and a
    little-endian 32-bit word (bits ``2j``, ``2j + 1``: bits 0-1 of column ``j + 16``'s).
    The layout ``csrc/q8_linear.cpp`` reads: a byte widened to 32 bits is column ``j``'s
    index into a 32-entry table as it is, column ``j + 16``'s after one shift and one
    bitwise select, with no mask for either (``vpermi2ps`` reads the low 5 bits)."""
    out, cols = codes.shape
    u = (codes.to(torch.int64) + 16).view(out, cols // BLOCK, BLOCK)
    lo, hi = u[..., :16], u[..., 16:]
    first = lo | ((hi >> 2) << 5)
    word = ((hi & 3) << (2 * torch.arange(16))).sum(-1, keepdim=True)
    last = (word >> torch.arange(0, 32, 8)) & 255
    return torch.cat([first, last], -1).to(torch.uint8).view(out, -1).contiguous()


def unpack5(blocks: torch.Tensor) -> torch.Tensor:
    """The int8 codes [out, in] of :func:`pack5`'s blocks [out, in / 32 * 20]."""
    out = blocks.shape[0]
    b = blocks.view(out, -1, Q5_BLOCK_BYTES).to(torch.int64)
    first = b[..., :16]
    word = (b[..., 16:] << torch.arange(0, 32, 8)).sum(-1, keepdim=True)
    hi = ((first >> 5) << 2) | ((word >> (2 * torch.arange(16))) & 3)
    return (torch.cat([first & 31, hi], -1) - 16).to(torch.int8).view(out, -1)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """``scale * q (+ offset)`` per group of ``in / scale.shape[1]`` columns (``q`` int8
    codes, or :func:`pack5`'s 5-bit codes): float32 [out, in], what the kernels compute
    (gguf's values bit for bit)."""
    codes = unpack5(q) if q.dtype == torch.uint8 else q
    out, cols = codes.shape
    w = codes.view(out, scale.shape[1], -1).float() * scale.float()[..., None]
    return (w if offset is None else w + offset[..., None]).view(out, cols)


@ops.implement("q8_0_linear")
def q8_0_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    max_rows: int,
    logits: bool = True,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., in]`` (float32 or bfloat16) -> ``[..., out]``, float32 with ``logits`` (the
    LM head), else in ``x``'s dtype (a decoder layer): :class:`Q8Linear`'s forward where the
    C++ kernel is not loaded (its CPU implementation of the op, ``csrc/q8_linear.cpp``,
    takes the paths of the module docstring): the packed dense copy where there is one, else
    ``x`` times the dequantized weight in float32. The scales' group is
    ``in / scale.shape[1]``; ``offset`` (as ``scale``) or None."""
    out, cols = q.shape
    if q.dtype == torch.uint8:  # 5-bit codes: 20 bytes per 32 columns
        cols = scale.shape[1] * BLOCK
    if packed is not None:
        dense: torch.Tensor = torch.ops.asyncllm.packed_linear(x, packed, bias, cols, out)
        return dense.float() if logits else dense
    y = nn.functional.linear(x.reshape(-1, cols).float(), dequantize(q, scale, offset))
    y = y.view(*x.shape[:-1], out)
    y = y if bias is None else y + bias.float()
    return y if logits else y.to(x.dtype)


class Q8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` as GGUF ``Q8_0`` (or ``Q5_0``, ``Q6_K``, ``Q5_K``): int8
    codes and a float scale per group of 32 or 16 input columns (``w = scale * q``, plus a
    per-group ``offset`` where given), run by ``asyncllm::q8_0_linear``; ``y`` is float32
    (the LM head's logits as summed, see the module docstring), or in ``x``'s dtype for a
    decoder layer (``logits=False``).

    Args:
        q: int8-range codes [out, in], ``in`` a multiple of 32.
        scale: float [out, in / group], group 32 or 16 (:data:`GROUPS`): GGUF's float16
            ``d`` (K-quants: ``d * sc``), kept exact in float32 (float16 with ``bits=5``).
        bias: [out] or None (added in float32).
        dtype: the model's dtype: the packed copy's (:meth:`pack`) and :attr:`weight`'s.
        logits: True (the LM head): float32 output, and a packed dense copy for many rows
            where :meth:`pack` makes one; False (a decoder layer): the output in the
            activations' dtype and never a dense copy where the kernel has ``q8_mm_f32``.
        offset: float [out, in / group] (``Q5_K``'s ``-(dmin * m)``), or None: no offset.
        bits: 8 (int8 codes) or 5 (``Q5_0``'s: codes in -16..15, a scale per 32 columns
            exact in float16, no offset; kept as :func:`pack5`'s 5-bit codes, 5.5 bits a
            weight with the scale, as in the file).

    Raises:
        ValueError: ``in`` not a multiple of 32, ``scale`` not [out, in / 32] or
            [out, in / 16], ``offset`` not of ``scale``'s shape, or (``bits=5``) codes,
            scales or an offset that 5-bit codes cannot hold.
    """

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    offset: torch.Tensor | None
    #: The oneDNN-packed dense copy (:meth:`pack`), or None.
    packed: torch.Tensor | None = None
    #: float32 output (the LM head); False: the activations' dtype (a decoder layer).
    logits: bool = True
    #: The dense weight eager calls use where the kernel is not loaded (switched off, or a
    #: cached model loaded without it: a per-call dequantization of the default model's
    #: head was slow; docs/tuning.md, "Costs behind smaller code choices").
    _interim: torch.Tensor | None = None

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype = torch.bfloat16,
        logits: bool = True,
        offset: torch.Tensor | None = None,
        bits: int = 8,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        shapes = [(q.shape[0], q.shape[1] // g) for g in GROUPS]
        if (
            self.in_features % BLOCK
            or tuple(scale.shape) not in shapes
            or (offset is not None and offset.shape != scale.shape)
        ):
            raise ValueError(
                f"Q8_0 weight [{self.out_features}, {self.in_features}] needs an input width "
                f"that is a multiple of {BLOCK}, scales [out, in / 32] or [out, in / 16] and "
                f"offsets none or as the scales, got {list(scale.shape)}"
                + ("" if offset is None else f" and {list(offset.shape)}")
            )
        self.out_dtype = dtype
        self.logits = logits
        if bits == 5:
            scale16 = scale.half()
            if (
                offset is not None
                or scale.shape[1] * BLOCK != self.in_features
                or (q.numel() and (int(q.min()) < -16 or int(q.max()) > 15))
                or not torch.equal(scale16.float(), scale.float())
            ):
                raise ValueError(
                    "5-bit codes need codes in -16..15, a scale per 32 columns exact in "
                    "float16 and no offset (GGUF's Q5_0)"
                )
            self.register_buffer("q", pack5(q))
            self.register_buffer("scale", scale16.contiguous())
        elif bits == 8:
            self.register_buffer("q", q.to(torch.int8).contiguous())
            self.register_buffer("scale", scale.float().contiguous())
        else:
            raise ValueError(f"Q8Linear codes have 8 or 5 bits, not {bits}")
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("offset", None if offset is None else offset.float().contiguous())

    @classmethod
    def concat(cls, parts: list[Q8Linear]) -> Q8Linear | None:
        """One layer whose output is ``parts``' outputs side by side (their codes, scales,
        offsets and biases concatenated), or None where they differ in input width, group,
        dtype, device or role (``logits``), or have an offset or a bias on some but not all
        (a Q8_0 and a Q5_0 layer fuse: both are codes with a scale per 32 columns)."""
        first = parts[0]
        if any(
            p.in_features != first.in_features
            or p.group != first.group
            or p.bits != first.bits
            or p.out_dtype != first.out_dtype
            or p.q.device != first.q.device
            or p.logits != first.logits
            or (p.offset is None) != (first.offset is None)
            or (p.bias is None) != (first.bias is None)
            or p.packed is not None
            for p in parts
        ):
            return None

        def cat(name: str) -> torch.Tensor | None:
            ts = [getattr(p, name) for p in parts]
            return None if ts[0] is None else torch.cat(ts)

        codes = torch.cat([p.codes() for p in parts])
        scale = cat("scale")
        assert scale is not None
        bias, offset = cat("bias"), cat("offset")
        return cls(codes, scale, bias, first.out_dtype, first.logits, offset, first.bits)

    @property
    def bits(self) -> int:
        """Bits a code: 8 (int8), or 5 (:func:`pack5`'s codes)."""
        return 5 if self.q.dtype == torch.uint8 else 8

    def codes(self) -> torch.Tensor:
        """The codes as int8 [out, in] (unpacked from 5 bits where they are)."""
        return unpack5(self.q) if self.bits == 5 else self.q

    @property
    def group(self) -> int:
        """Input columns per scale (32, or 16 for ``Q6_K``)."""
        return int(self.in_features // self.scale.shape[1])

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in the model's dtype (a dense copy: not the hot path),
        made a few thousand rows at a time (no float32 copy of the whole weight)."""
        out = torch.empty(self.out_features, self.in_features, dtype=self.out_dtype)
        for i in range(0, self.out_features, _DEQUANT_ROWS):
            rows = slice(i, i + _DEQUANT_ROWS)
            o = None if self.offset is None else self.offset[rows]
            out[rows] = dequantize(self.q[rows], self.scale[rows], o)
        return out

    def pack(self) -> None:
        """Make the oneDNN-packed dense copy that every call uses where the C++ kernel is
        not loaded (in the model's dtype; idempotent). None where it is: its many-row paths
        (``q8_mm``, ``q8_mm_f32``) read the codes, and a dense copy would hold the weight a
        second time, four times its size in float32.

        Raises:
            RuntimeError: oneDNN refuses the reorder.
        """
        from asyncllm.layers.cpu_linear import PACK_HINT_ROWS

        if self.packed is None and kernel() is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_HINT_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None and not torch.compiler.is_compiling():
            if kernel() is None:  # switched off or not installed: a dense copy
                if self._interim is None:
                    self._interim = self.weight
                d = nn.functional.linear(x, self._interim).float()
                d = d if self.bias is None else d + self.bias.float()
                return d if self.logits else d.to(x.dtype)
            self._interim = None
        y: torch.Tensor = torch.ops.asyncllm.q8_0_linear(
            x, self.q, self.scale, self.packed, self.bias, MAX_ROWS, self.logits, self.offset
        )
        return y

    def extra_repr(self) -> str:
        packed = ", packed copy" if self.packed is not None else ""
        head = "" if self.logits else ", decoder"
        offset = " + offset" if self.offset is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits} g{self.group}{offset}{packed}{head}"
        )
