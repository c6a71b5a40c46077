"""Weight-only quantized linear layers and embeddings on torch's own CPU kernels.

* :class:`Int4Linear`: 4-bit codes in groups of ``group_size`` input columns, each group with
  a scale and a zero point, run by ``aten._weight_int4pack_mm_for_cpu`` (the kernel torchao's
  CPU int4 layout calls too; torchao adds nothing on CPU that this needs). The kernel computes
  ``w = (q - 8) * scale + zero`` (checked bit for bit in the tests), so GGUF's ``Q4_1``
  (``d * q + m``: scale ``d``, zero ``m + 8 d``) and ``Q4_0`` (``d * (q - 8)``: zero 0) map
  onto it without loss when the scales are float32 (a float32 model). That kernel is a
  matrix-vector kernel (its time grows with the row count): a call with more than
  :data:`INT4_KERNEL_MAX_ROWS` rows instead multiplies with the weight dequantized block by
  block into a small per-thread scratch (:mod:`asyncllm.kernels.int4_dequant`, C++; bfloat16
  GEMM), several times faster at 64 rows (docs/tuning.md, "Many rows: dequantize then
  GEMM"), with only the int4 weight kept. The whole layer is one C++ op,
  ``asyncllm_cpu::int4_linear`` (the Python around 210 kernel calls per decode step was a
  large share of a batch-1 step: docs/tuning.md, "Compiled forward"), in eager steps and
  compiled graphs alike; where it
  cannot be built, :func:`int4_linear` (torch's int4 kernel at every row count).
* :class:`Int8Linear`: int8 codes with one scale per output channel,
  ``aten._weight_int8pack_mm``.
* :class:`QuantEmbedding`: an embedding table kept as integer codes with per-group scale and
  offset; a lookup dequantizes only the rows it gathers (``scale * q + offset`` in float32:
  GGUF's own dequantization, bit for bit).

:func:`quantize_model` swaps a model's ``nn.Linear`` layers (and, with them, what the
precision table in docs/configuration.md says) for these. Measured on the decode shapes in
docs/tuning.md (``benchmarks/quant_kernels.py``).
"""

from __future__ import annotations

import collections
import logging
import typing
from collections.abc import Iterator

import torch
from torch import nn

from asyncllm.kernels import int4_dequant, ops

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GROUP_SIZES",
    "Int4Linear",
    "Int8Linear",
    "QuantEmbedding",
    "check_kernel",
    "int4_codes",
    "int8_codes",
    "weight_bytes",
]

logger = logging.getLogger("asyncllm")

#: Group sizes ``quantization="int4"`` accepts (input columns per scale and zero point).
GROUP_SIZES = (32, 64, 128)
#: The default int4 group size: GGUF's Q4 block, and the only one of :data:`GROUP_SIZES` that
#: divides every input width of the common small models (SmolLM2-135M: 576 = 9 x 64).
DEFAULT_GROUP_SIZE = 32


def int4_codes(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of ``weight`` [out, in] per group of ``group_size`` columns.

    Returns ``(q, scale, offset)``: q int16 [out, in] in 0..15, scale and offset float32
    [out, in / group_size], with ``w ~= scale * q + offset`` (offset = the group's minimum,
    scale = its range / 15; the round-to-nearest error is at most scale / 2).

    Raises:
        ValueError: ``group_size`` does not divide ``in``.
    """
    out, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features={cols}")
    g = weight.detach().float().reshape(out, cols // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.int16)
    return q.reshape(out, cols), scale, lo


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of ``weight`` [out, in], one scale per output channel.

    Returns ``(q, scale)``: q int8 [out, in] in -127..127, scale float32 [out] (max |w| / 127),
    with ``w ~= scale * q``.
    """
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / safe[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


#: The dtype the quantized kernels compute in on CPU: torch's int4 and int8 weight-only CPU
#: kernels have a vectorized path for bfloat16 activations only; with float32 or float16
#: ones they run a scalar path, far slower (docs/tuning.md, "Weight-only quantization
#: kernels").
COMPUTE_DTYPE = torch.bfloat16


def int4_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an :class:`Int4Linear` of a ``model_dtype`` model computes in (its rows,
    scales and zero points): float32 in a float32 model (a GGUF file's float16 scales kept
    exact, float32 rows: the C++ float32 kernels, ``csrc/int4_gemv_f32.cpp`` at few rows and
    a float32 GEMM over the dequantized weight at many), else :data:`COMPUTE_DTYPE`."""
    return torch.float32 if model_dtype == torch.float32 else COMPUTE_DTYPE


def _rows(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, in_features).to(dtype)


def _finish(
    y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's rows back in ``x``'s shape and dtype, plus the bias (in that dtype)."""
    y = y.view(*x.shape[:-1], out_features).to(x.dtype)
    return y if bias is None else y + bias


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` as 4-bit codes, per-group scale and zero point (CPU).

    Args:
        q: int [out, in], codes 0..15.
        scale: [out, in / group_size], float.
        offset: [out, in / group_size]: ``w = scale * q + offset``.
        group_size: input columns per group; 32, 64 or 128 and a divisor of ``in``.
        bias: [out] or None (kept in its dtype, added to the output).
        dtype: the dtype the kernel computes in (activations, scales and zero points):
            :func:`int4_dtype` of the model's dtype; float32 keeps float16 GGUF scales
            exact.

    Buffers: ``packed`` uint8 [out, in / 2] (torch's CPU int4 packing), ``scales_and_zeros``
    either torch's int4 layout, [in / group_size, out, 2] of ``dtype`` holding (scale, zero)
    with ``w = (q - 8) * scale + zero``, or, in float32 where ``out`` is a multiple of 64,
    tile-major [out / 64, in / group_size, 2, 64] holding a group's 64 scales then its 64
    offsets, ``w = q * scale + offset`` (the offsets as given: no zero rounded from them;
    each tile's scales one run, which the few-row kernel streams beside its codes;
    :func:`asyncllm.kernels.ops.torch_scales` converts it for torch's kernel).

    Raises:
        ValueError: a group size that the kernel lacks or that does not divide ``in``.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        out, cols = q.shape
        if group_size not in GROUP_SIZES or cols % group_size:
            raise ValueError(
                f"int4 group size {group_size} must be one of {GROUP_SIZES} and divide "
                f"in_features={cols}"
            )
        self.in_features, self.out_features, self.group_size = cols, out, group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        if dtype == torch.float32 and out % 64 == 0:
            pairs = torch.stack([scale.float(), offset.float()])  # [2, out, groups]
            sz = pairs.view(2, out // 64, 64, -1).permute(1, 3, 0, 2).contiguous()
        else:
            zero = offset.double() + 8 * scale.double()  # exact in float64 for float16 inputs
            sz = torch.stack([scale.T.double(), zero.T], -1).to(dtype).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def concat(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One layer whose output is ``parts``' outputs side by side (their packed codes,
        scales and zero points concatenated; no repacking), or None where they differ in
        input width, group size, scale dtype or layout or device, have a bias on some but not
        all, or a part's rows are not a multiple of 64 (the packed layout's row block)."""
        first = parts[0]
        if any(
            p.in_features != first.in_features
            or p.group_size != first.group_size
            or p.scales_and_zeros.dtype != first.scales_and_zeros.dtype
            or p.scales_and_zeros.dim() != first.scales_and_zeros.dim()
            or p.packed.device != first.packed.device
            or p.out_features % 64
            or (p.bias is None) != (first.bias is None)
            for p in parts
        ):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.group_size = first.in_features, first.group_size
        fused.out_features = sum(p.out_features for p in parts)
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))
        tiled = first.scales_and_zeros.dim() == 4  # tiles stack; torch's layout joins outputs
        fused.register_buffer(
            "scales_and_zeros", torch.cat([p.scales_and_zeros for p in parts], 0 if tiled else 1)
        )
        biases = [p.bias for p in parts if p.bias is not None]
        fused.register_buffer("bias", torch.cat(biases) if biases else None)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.packed, self.scales_and_zeros, self.bias)
        sizes = (self.group_size, self.in_features, self.out_features)
        y: torch.Tensor
        if int4_dequant.op_available() or torch.compiler.is_dynamo_compiling():
            # one op call: the C++ kernel (the whole layer), else the torch reference
            rows = (int4_max_rows(self.scales_and_zeros.dtype), INT4_GEMV_MAX_ROWS)
            y = torch.ops.asyncllm.int4_linear.default(*args, *sizes, *rows)
        else:
            y = int4_linear(*args, *sizes)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 g{self.group_size}"
        )


#: Calls with more rows than this multiply with the dequantized int4 weight
#: (:mod:`.int4_dequant`: block by block into a per-thread L2 scratch, oneDNN's brgemm
#: micro-kernel); up to this many go through torch's int4 kernel, whose cost grows with the
#: row count (a matrix-vector kernel). ``benchmarks/int4_many_rows.py --rows 2 4 8 16 32 64
#: --candidates old new int4`` puts the crossover at 8 rows (docs/tuning.md, "Many rows:
#: dequantize then GEMM", has the table; it was 16 when the many-row path dequantized the
#: whole weight to memory and then ran one ``torch.mm``, slower than the fused path).
INT4_KERNEL_MAX_ROWS = 8

#: The crossover where the fused path cannot run (no native bfloat16): the whole weight is
#: dequantized to memory, then one ``torch.mm``; measured at 16 rows (2 threads) when that
#: was the only form.
INT4_KERNEL_MAX_ROWS_UNFUSED = 16


#: Float32 scales: calls with up to this many rows run the float32 few-row kernel
#: (``csrc/int4_gemv_f32.cpp``), more the float32 many-row path (block by block, float32
#: brgemm). The crossover was measured against the former many-row path (the whole weight
#: dequantized, then one GEMM: the right-hand figures), slower than today's.
#: ``python benchmarks/int4_f32.py`` (AMD EPYC Zen 3, AVX2, 1 thread, us per call, weights in
#: cache; few-row kernel / dequantize + GEMM; torch's bfloat16 int4 kernel beside)::
#:
#:     rows               1           2          8          16          32
#:     1536x576    93 / 320   122 / 367  524 / 662  1819 /  741  2897 / 1917   (bf16 146 at 1)
#:     576x1536    93 / 305   120 / 386  535 / 526  1819 / 1647  3694 / 1884   (bf16 151 at 1)
#:     192x576     17 /  45    21 /  57   67 /  64   126 /   84   254 /  129   (bf16  28 at 1)
INT4_F32_MAX_ROWS = 8


def int4_max_rows(dtype: torch.dtype = COMPUTE_DTYPE) -> int:
    """The most rows an int4 call with scales of ``dtype`` sends through a few-row kernel
    (bfloat16: torch's int4 kernel or ``int4_gemv.cpp``; float32: ``int4_gemv_f32.cpp``) on
    this machine: :data:`INT4_F32_MAX_ROWS` for float32, :data:`INT4_KERNEL_MAX_ROWS` where
    the fused many-row path runs, else :data:`INT4_KERNEL_MAX_ROWS_UNFUSED` (read per call:
    tests and profiles change them)."""
    if dtype == torch.float32:
        return INT4_F32_MAX_ROWS
    if int4_dequant.fused_available():
        return INT4_KERNEL_MAX_ROWS
    return max(INT4_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS_UNFUSED)


#: Calls with up to this many rows run the few-row kernel (``int4_gemv.cpp``: AVX-512 BF16
#: and VBMI) instead of torch's int4 kernel, where it is built. ``python
#: benchmarks/int4_gemv.py`` (the default model's 30 layers of q/k/v, o, gate/up and down,
#: weights out of cache, 2 threads): the few-row kernel is the faster at 1-3 rows; at 4 rows
#: torch's kernel wins, its cost per extra row being lower (docs/tuning.md, "int4 few-row
#: kernel", has the times). Set to 0 to run torch's kernel instead (read per
#: call, as the thresholds above).
INT4_GEMV_MAX_ROWS = 3


def load_kernels(model: nn.Module | None = None) -> None:
    """Load the C++ kernels ``model``'s quantized layers call (all of them without a model),
    registering their ops before a graph is traced or loaded; milliseconds, nothing built."""
    from asyncllm.layers import q8_linear

    kinds = (
        {type(m) for m in model.modules()}
        if model is not None
        else {Int4Linear, q8_linear.Q8Linear}
    )
    if Int4Linear in kinds:
        int4_dequant.kernel()
    if q8_linear.Q8Linear in kinds:
        q8_linear.kernel()


#: Calls of the Python fallback :func:`int4_linear` (torch's int4 kernel), for tests.
_PY_CALLS = collections.Counter[str]()


def path_calls() -> collections.Counter[str]:
    """Int4 linear calls so far per path, for tests and profiles: "int4" (torch's int4
    kernel, in C++ or the Python fallback), "dequant" (dequantize, then one GEMM) and "gemv"
    (the few-row kernel, ``int4_gemv.cpp``)."""
    int4, dense, gemv = int4_dequant.path_calls()
    return collections.Counter({"int4": int4 + _PY_CALLS["int4"], "dequant": dense, "gemv": gemv})


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    """``y = x W^T + b`` for an :class:`Int4Linear`'s buffers by the torch reference
    (:func:`asyncllm.kernels.ops.int4_linear_reference`), counted in :func:`path_calls`:
    the eager path where the C++ kernel is not installed or switched off."""
    _PY_CALLS["int4"] += 1
    y: torch.Tensor = ops.int4_linear_reference(
        x, packed, scales_and_zeros, bias, group_size, in_features, out_features
    )
    return y


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` as int8 codes and one scale per output channel.

    Args:
        q: int8 [out, in]. scale: [out]. bias: [out] or None (kept in its dtype).
        dtype: the dtype the kernel computes in (activations and scales), as for
            :class:`Int4Linear`.
    """

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, self.in_features, self.scale.dtype)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale)
        return _finish(y, x, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class QuantEmbedding(nn.Module):
    """An embedding table as codes plus per-group scale and offset; rows dequantized on lookup.

    Args:
        q: int [vocab, dim] (int8 range). scale, offset: float32 [vocab, dim / group];
            offset None: zero (GGUF's ``Q8_0``). An int8 ``q`` and float32 ``scale`` are
            kept as they are (shared with a tied ``Q8Linear`` head).
        dtype: the output dtype.
        padding_idx: kept for transformers code that reads it.
        embed_scale: a factor the looked-up rows are multiplied by in ``dtype``, as the
            scaled embeddings of some families do in their own ``forward`` (Gemma 3's
            ``Gemma3TextScaledWordEmbedding``: ``sqrt(hidden_size)``); None: none.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    embed_scale: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor | None,
        dtype: torch.dtype,
        padding_idx: int | None = None,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.group = self.embedding_dim // scale.shape[1]
        self.padding_idx = padding_idx
        self.out_dtype = dtype
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("offset", None if offset is None else offset.float().contiguous())
        self.register_buffer(
            "embed_scale", None if embed_scale is None else embed_scale.detach().clone()
        )

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (a dense copy: for inspection, not for the hot path)."""
        return self._dequantize(self.q, self.scale, self.offset)

    def _dequantize(self, q: torch.Tensor, s: torch.Tensor, o: torch.Tensor | None) -> torch.Tensor:
        w = s.repeat_interleave(self.group, -1) * q.float()
        return (w if o is None else w + o.repeat_interleave(self.group, -1)).to(self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        o = None if self.offset is None else self.offset[ids]
        rows = self._dequantize(self.q[ids], self.scale[ids], o)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)

    def same_lookups(self, table: nn.Embedding) -> bool:
        """This module returns what ``table`` (the model's own embedding, possibly a
        subclass with a ``forward`` of its own) returns, within float32 rounding, on 64 ids
        spread over the vocabulary: the check before it replaces ``table``."""
        ids = torch.linspace(0, table.num_embeddings - 1, 64).long().to(table.weight.device)
        with torch.no_grad():
            got, want = self(ids), table(ids)
        return got.dtype == want.dtype and bool(
            (got.float() - want.float()).abs().max() <= 1e-6 * want.float().abs().max()
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 codes g{self.group}"


def check_kernel(kind: str, device: torch.device, dtype: torch.dtype) -> None:
    """Run ``kind``'s kernel ("int4" or "int8") once on a tiny input on ``device``.

    Raises:
        ValueError: the kernel does not exist for that device and dtype (naming both).
    """
    try:
        x = torch.zeros(1, 64, dtype=dtype, device=device)
        if kind == "int4":
            if device.type != "cpu":  # the CUDA kernel needs another packing: not wired
                raise NotImplementedError("only the CPU int4 kernel is wired")
            q = torch.zeros(64, 64, dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.ones(2, 64, 2, dtype=dtype)
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        else:
            q8 = torch.zeros(64, 64, dtype=torch.int8, device=device)
            torch.ops.aten._weight_int8pack_mm(x, q8, torch.ones(64, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(
            f"quantization={kind!r} has no kernel on device {device} with dtype "
            f"{str(dtype).removeprefix('torch.')} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); use quantization=None"
        ) from exc


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each shared tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for t in _tensors(model):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def holds_experts(model: nn.Module) -> bool:
    """``model`` is a mixture of experts: it holds 3-D weights (transformers keeps a MoE
    layer's experts as one ``[experts, out, in]`` tensor)."""
    return any(p.dim() == 3 for p in model.parameters())


def unquantized_experts(model: nn.Module) -> str:
    """What quantization left out of ``model`` for being no ``nn.Linear``: ``""``, or
    ``" (MoE experts dense: N tensors)"`` (:func:`holds_experts`), which stay in the
    model's dtype; the router is no ``nn.Linear`` either."""
    n = sum(1 for p in model.parameters() if p.dim() == 3)
    return f" (MoE experts dense: {n} tensors)" if n else ""


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def module_state(module: nn.Module) -> dict[str, object]:
    """What :func:`module_from_state` needs to rebuild a quantized ``module`` without
    quantizing again: its class name, sizes and buffers (packed as the kernel wants them)."""
    state: dict[str, object] = {"cls": type(module).__name__}
    state.update({k: v for k, v in module.__dict__.items() if k in _META})
    state["buffers"] = {k: v for k, v in module.named_buffers(recurse=False) if v is not None}
    return state


def module_from_state(state: dict[str, object]) -> nn.Module:
    """Rebuild a module saved by :func:`module_state` (the buffers are used as they are).

    Raises:
        ValueError: an unknown class name (a cache written by another version).
    """
    from asyncllm.layers.q8_linear import Q8Linear

    classes: dict[str, type[nn.Module]] = {
        c.__name__: c for c in (Int4Linear, Int8Linear, QuantEmbedding, Q8Linear)
    }
    cls = classes.get(str(state["cls"]))
    if cls is None:
        raise ValueError(f"unknown quantized module class {state['cls']!r}")
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for k in _META:
        if k in state:
            setattr(module, k, state[k])
    buffers = typing.cast(dict[str, torch.Tensor], state["buffers"])
    for k in _BUFFERS[cls.__name__]:
        module.register_buffer(k, buffers.get(k))
    return module


_META = (
    "in_features",
    "out_features",
    "group_size",
    "num_embeddings",
    "embedding_dim",
    "group",
    "padding_idx",
    "out_dtype",
    "logits",
)
_BUFFERS = {
    "Int4Linear": ("packed", "scales_and_zeros", "bias"),
    "Int8Linear": ("q", "scale", "bias"),
    "QuantEmbedding": ("q", "scale", "offset", "embed_scale"),
    "Q8Linear": ("q", "scale", "bias", "offset"),
}


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Set the submodule at dotted path ``name`` of ``model`` to ``module``."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)
