"""Read a GGUF file's quantized weight blocks as integer codes plus scales and offsets.

Only the block layouts that :mod:`asyncllm.layers.quant_linear` or
:mod:`asyncllm.layers.q8_linear` has a kernel for are unpacked (ggml's ``ggml-common.h`` /
gguf-py's ``gguf.quants`` define them; 32 weights a block along the input dimension, 16 for
``Q6_K``):

* ``Q4_0``: ``d`` (float16), 16 bytes of 4-bit codes; ``w = d * (q - 8)``;
* ``Q4_1``: ``d``, ``m`` (float16), 16 bytes of codes; ``w = d * q + m``;
* ``Q8_0``: ``d`` (float16), 32 signed bytes; ``w = d * q``;
* ``Q5_0``: ``d`` (float16), 4 bytes of high bits (bit ``i`` of the little-endian word is
  weight ``i``'s fifth bit), 16 bytes of low nibbles (as ``Q4_0``'s); ``w = d * (q - 16)``:
  exactly a ``Q8_0`` block of codes ``q - 16`` (-16..15) and scale ``d``;
* ``Q4_K``: 256 weights a super-block: ``d``, ``dmin`` (float16), 12 bytes packing eight
  6-bit scales ``sc`` and minimums ``m`` (one per 32 weights), 128 bytes of 4-bit codes;
  ``w = (d * sc) * q - dmin * m``: exactly a 32-weight block of scale ``d * sc`` and offset
  ``-(dmin * m)`` (both products exact in float32), so it unpacks to the same blocks as
  ``Q4_1``;
* ``Q6_K``: 256 weights a super-block: 128 bytes of low nibbles ``ql``, 64 bytes of high
  bit pairs ``qh``, sixteen int8 sub-block scales ``sc``, ``d`` (float16, last);
  ``w = (d * sc) * (q - 32)`` per 16 weights, q in 0..63: exactly a 16-weight block of
  int8 codes ``q - 32`` and scale ``d * sc`` (exact in float32: 11 by 8 significant bits);
* ``Q5_K``: 256 weights: ``d``, ``dmin``, Q4_K's 12 bytes of 6-bit ``sc`` and ``m``, 32
  bytes of fifth bits ``qh`` (bit ``j`` of byte ``l`` is weight ``l`` of sub-block ``j``), 128
  bytes of low nibbles (Q4_K's order); ``w = (d * sc) * q - dmin * m``, q in 0..31: a
  32-weight block of codes ``q``, scale ``d * sc`` and offset ``-(dmin * m)``, as ``Q4_K``.

In a ``Q4_0``/``Q4_1`` block, byte ``j`` of the codes holds weight ``j`` in its low nibble
and weight ``j + 16`` in its high nibble; in ``Q4_K`` and ``Q5_K``, each 32 bytes hold two
32-weight blocks, the first in the low nibbles; in each 128-weight half of ``Q6_K``, 64
bytes of ``ql`` hold weights 0-63 (low nibbles) and 64-127 (high) and byte ``l`` of its 32
bytes of ``qh`` the high bits of weights ``l``, ``l + 32``, ``l + 64``, ``l + 96`` (bits 0-1,
2-3, 4-5, 6-7). Every value is returned as is (float16 scales widened to float32, K-quant
sub-block scales multiplied out exactly), so a caller that computes ``scale * q + offset``
in float32 reproduces gguf's own dequantization bit for bit (gguf computes the same
product, rounded once; with an offset, the product is exact and the sum rounds once). A
block whose float16 scale or minimum is inf or NaN is refused as a corrupt tensor
(:class:`~asyncllm.errors.ModelLoadError` naming it), not passed through.

GGUF files may store a weight with its rows permuted (llama.cpp reorders the query and key
projections of Llama-family models); :func:`match_rows` finds the permutation that maps a
GGUF tensor onto the Hugging Face weight transformers dequantized from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from asyncllm.errors import ModelLoadError
from asyncllm.models.fingerprint import fingerprint
from asyncllm.models.gguf_parse import dequantized, reader

__all__ = [
    "INT4_TYPES",
    "INT8_TYPES",
    "KERNEL_TYPES",
    "OFFSET_TYPES",
    "QuantBlocks",
    "TensorKind",
    "content_key",
    "dequantize_tensor",
    "match_rows",
    "read_tensors",
    "tensor_finder",
    "tensor_kinds",
    "unpack",
]

BLOCK = 32
#: GGUF tensor types with a quantized kernel (:mod:`asyncllm.layers.quant_linear`,
#: :mod:`asyncllm.layers.q8_linear`).
KERNEL_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"})
#: Of those, the types that run as int4 group 32 (``quant_linear.Int4Linear``).
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
#: Of those, the types that run as int8 codes with a float32 scale per group of columns
#: (``q8_linear.Q8Linear``): ``w = d * q`` with ``q`` signed (``Q5_0``'s ``q - 16`` and
#: ``Q6_K``'s ``q - 32``; groups of 32, ``Q6_K``'s of 16), plus an offset for ``Q5_K``.
INT8_TYPES = frozenset({"Q5_0", "Q5_K", "Q6_K", "Q8_0"})
#: Of those, the types whose Q8Linear has per-group offsets (``w = d * q + offset``).
OFFSET_TYPES = frozenset({"Q5_K"})
#: Weights a K-quant super-block holds.
SUPER_BLOCK = 256
#: Bytes of the K-quant super-blocks unpacked here.
_SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
#: Types that are plain floating point (kept as they are: norms, biases, small tensors).
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    """One GGUF weight [rows, cols] as ``w = scale * q + offset`` per block of 32 columns
    (16 for ``Q6_K``: :attr:`group`).

    Attributes:
        kind: ``"Q4_0"``, ``"Q4_1"``, ``"Q4_K"``, ``"Q5_0"``, ``"Q5_K"``, ``"Q6_K"`` or
            ``"Q8_0"``.
        q: codes, int16 [rows, cols]: 0..15 for Q4_*, -128..127 for Q8_0, -16..15 for
            Q5_0 (its ``q - 16``), 0..31 for Q5_K, -32..31 for Q6_K (its ``q - 32``).
        scale: float32 [rows, cols / group], the blocks' ``d`` (K-quants: ``d * sc``).
        offset: float32 [rows, cols / group]: ``m`` for Q4_1, ``-8 d`` for Q4_0,
            ``-(dmin * m)`` for Q4_K and Q5_K, 0 for Q8_0, Q5_0 and Q6_K (``w = d * q``).
    """

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def group(self) -> int:
        """Columns per scale: 32, or 16 (``Q6_K``)."""
        return int(self.q.shape[1] // self.scale.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], equal bit for bit to ``gguf.quants.dequantize``."""
        rows, cols = self.q.shape
        q = self.q.view(rows, cols // self.group, self.group).float()
        s, o = self.scale[..., None], self.offset[..., None]  # broadcast over each block
        if self.kind == "Q4_0":  # d * (q - 8): exact in float32, like gguf's
            return (s * (q - 8)).view(rows, cols)
        if self.kind in INT8_TYPES - OFFSET_TYPES:  # d * q, no offset added (gguf's -0.0)
            return (s * q).view(rows, cols)
        return (s * q + o).view(rows, cols)

    def take_rows(self, index: torch.Tensor) -> QuantBlocks:
        """The same weight with its rows reordered: row ``i`` is this one's ``index[i]``."""
        return QuantBlocks(self.kind, self.q[index], self.scale[index], self.offset[index])


def unpack(kind: str, raw: np.ndarray, shape: tuple[int, int], name: str = "") -> QuantBlocks:
    """Unpack the raw bytes of a tensor of ``shape`` (rows, cols) and type ``kind`` (one of
    :data:`KERNEL_TYPES`); ``name`` (the GGUF tensor's) is for error messages.

    Raises:
        ModelLoadError: a block's float16 scale or minimum (``d``, ``m``, ``dmin``) is inf
            or NaN: a corrupt file (ggml itself would compute inf/NaN weights from it).
        ValueError: ``kind`` has no layout here, or the byte count does not match ``shape``.
    """
    rows, cols = shape
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
    if kind not in sizes and kind not in _SUPER_BYTES:
        raise ValueError(f"GGUF tensor type {kind} has no quantized kernel in asyncllm")
    width = SUPER_BLOCK if kind in _SUPER_BYTES else BLOCK
    if cols % width:
        raise ValueError(f"{kind} tensor of shape {shape}: columns not a multiple of {width}")
    if kind in _SUPER_BYTES:
        sb = np.ascontiguousarray(raw, dtype=np.uint8)
        sb = sb.reshape(rows, cols // SUPER_BLOCK, _SUPER_BYTES[kind])
        unpack_k = {"Q4_K": _unpack_q4_k, "Q5_K": _unpack_q5_k, "Q6_K": _unpack_q6_k}[kind]
        return unpack_k(sb, rows, cols, name)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, sizes[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    _check_finite(name, kind, d=d)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
        offset = np.zeros_like(d)
    elif kind == "Q5_0":
        high = blocks[..., 2:6].copy().view("<u4")  # [rows, n, 1]: bit i is weight i's 5th
        bits = ((high >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int16)
        nib = blocks[..., 6:]
        low = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int16)
        q = (low | (bits << 4)) - 16
        offset = np.zeros_like(d)
    else:
        start = 4 if kind == "Q4_1" else 2
        nib = blocks[..., start:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int16)
        if kind == "Q4_1":
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            _check_finite(name, kind, m=offset)
        else:
            offset = -8 * d
    return QuantBlocks(
        kind,
        torch.from_numpy(q.reshape(rows, cols)),
        torch.from_numpy(np.ascontiguousarray(d)),
        torch.from_numpy(np.ascontiguousarray(offset)),
    )


def dequantize_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``gguf.dequantize(data, qtype)`` bit for bit (float32, the same shape): a 2-D tensor
    of a type :func:`unpack` reads through its codes and torch's elementwise product (about
    twice as fast as gguf-py's numpy here), anything else (and a block with a non-finite
    scale, which gguf-py dequantizes as it is) by gguf-py."""
    kind = GGMLQuantizationType(qtype).name
    if kind not in KERNEL_TYPES or data.ndim != 2 or data.dtype != np.uint8:
        return dequantize(data, qtype)
    width, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    try:
        blocks = unpack(kind, data, (data.shape[0], data.shape[1] // nbytes * width))
    except ModelLoadError:
        return dequantize(data, qtype)
    return blocks.dequantize().numpy()


def _check_finite(name: str, kind: str, **scales: np.ndarray) -> None:
    """Raise ModelLoadError when a block's scale or minimum in ``scales`` is inf or NaN."""
    for field, values in scales.items():
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            raise ModelLoadError(
                f"corrupt GGUF tensor {name or '(unnamed)'}: a non-finite {field} (inf/NaN) "
                f"in {bad} of its {values.size} {kind} blocks, which would make its weights "
                "inf/NaN"
            )


def _unpack_q4_k(sb: np.ndarray, rows: int, cols: int, name: str) -> QuantBlocks:
    """``Q4_K`` super-blocks ``sb`` [rows, n, 144] as 32-weight blocks: ggml's
    ``block_q4_K`` (gguf-py's ``Q4_K.dequantize_blocks`` is the reference)."""
    scale, offset = _k_scales_mins(sb, "Q4_K", name)
    codes = sb[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (codes & 0x0F).astype(np.int16)  # [rows, n, 4 pairs, low/high, 32]
    return _k_blocks("Q4_K", q, scale, offset, rows, cols)


def _unpack_q5_k(sb: np.ndarray, rows: int, cols: int, name: str) -> QuantBlocks:
    """``Q5_K`` super-blocks ``sb`` [rows, n, 176] as 32-weight blocks of codes 0..31:
    ggml's ``block_q5_K`` (``dequantize_row_q5_K``; gguf-py's ``Q5_K.dequantize_blocks``
    is the reference): ``Q4_K``'s scales, minimums and nibbles, and bit ``j`` of ``qh``'s
    byte ``l`` the fifth bit of weight ``l`` of sub-block ``j``."""
    scale, offset = _k_scales_mins(sb, "Q5_K", name)
    low = sb[..., 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    high = sb[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = (low & 0x0F).reshape(rows, -1, 8, 32) | ((high & 1) << 4)
    return _k_blocks("Q5_K", q.astype(np.int16), scale, offset, rows, cols)


def _k_scales_mins(sb: np.ndarray, kind: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The 32-weight blocks' scales ``d * sc`` and offsets ``-(dmin * m)`` [rows, n, 8] of
    ``Q4_K``/``Q5_K`` super-blocks ``sb`` (``d``, ``dmin`` float16, then 12 bytes packing
    eight 6-bit ``sc`` and ``m``: ggml's ``get_scale_min_k4``); both products exact."""
    d = sb[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
    dmin = sb[..., 2:4].copy().view(np.float16).astype(np.float32)
    _check_finite(name, kind, d=d, dmin=dmin)
    packed = sb[..., 4:16].reshape(*sb.shape[:2], 3, 4)
    lo, hi, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_blocks(
    kind: str, q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, rows: int, cols: int
) -> QuantBlocks:
    """A K-quant tensor's :class:`QuantBlocks` (no ``offset``: zeros)."""
    scale = np.ascontiguousarray(scale.reshape(rows, -1))
    return QuantBlocks(
        kind,
        torch.from_numpy(q.reshape(rows, cols)),
        torch.from_numpy(scale),
        torch.zeros(scale.shape) if offset is None else torch.from_numpy(offset.reshape(rows, -1)),
    )


def _unpack_q6_k(sb: np.ndarray, rows: int, cols: int, name: str) -> QuantBlocks:
    """``Q6_K`` super-blocks ``sb`` [rows, n, 210] as 16-weight blocks of codes ``q - 32``
    and scales ``d * sc``: ggml's ``block_q6_K`` (``dequantize_row_q6_K``; gguf-py's
    ``Q6_K.dequantize_blocks`` is the reference)."""
    n = cols // SUPER_BLOCK
    d = sb[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
    _check_finite(name, "Q6_K", d=d)
    scale = d * sb[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, n, 16]
    # Per 128-weight half h: ql's 64 bytes -> weights 0-63 (low nibbles), 64-127 (high);
    # qh's 32 bytes -> bits 4-5 of weights l, l + 32, l + 64, l + 96 (bit pairs 0..3).
    ql = sb[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = sb[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = (ql & 0x0F).reshape(rows, n, 2, 128)
    high = (qh & 0x03).reshape(rows, n, 2, 128)
    q = (low | (high << 4)).astype(np.int16) - 32
    return _k_blocks("Q6_K", q, scale, None, rows, cols)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """A 2-D GGUF tensor: its name, type name, [rows, cols] and raw bytes (a memmap view)."""

    name: str
    kind: str
    shape: tuple[int, int]
    raw: np.ndarray
    type_id: GGMLQuantizationType

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] by gguf-py's reference dequantization."""
        out = dequantize(self.raw, self.type_id)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)


def read_tensors(path: pathlib.Path) -> list[GGUFTensor]:
    """The 2-D tensors of the GGUF file ``path`` (memory-mapped; nothing dequantized; the
    file parsed once per :func:`asyncllm.models.gguf_parse.parsed_once` block)."""
    out = []
    for t in reader(path).tensors:
        dims = [int(x) for x in t.shape]
        if len(dims) != 2:
            continue
        cols, rows = dims  # GGUF lists the fastest-varying dimension first
        out.append(GGUFTensor(t.name, t.tensor_type.name, (rows, cols), t.data, t.tensor_type))
    return out


@dataclasses.dataclass(frozen=True)
class TensorKind:
    """A 2-D GGUF tensor's name and type name (no data)."""

    name: str
    kind: str


def tensor_kinds(path: pathlib.Path, cache: pathlib.Path) -> list[TensorKind]:
    """The 2-D tensors' names and types of the GGUF file ``path``, kept in a small JSON file
    under ``cache`` keyed by the file's content (:func:`~asyncllm.models.fingerprint.
    fingerprint`, recorded in the JSON file and checked when it is read). gguf-py's reader
    parses every metadata field (the tokenizer's ~100,000 strings: 3.6 s for the default
    model's file on the 2-core machine) before it lists the tensors; an engine start only
    needs their types, so only the first start of a file pays that.

    Raises:
        OSError: ``path`` cannot be read.
    """
    ident = fingerprint(path)
    f = cache / f"gguf-kinds-{ident[:16]}.json"
    try:
        data = json.loads(f.read_text())
        if data["file"] == ident:
            return [TensorKind(n, k) for n, k in data["tensors"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    kinds = [TensorKind(t.name, t.kind) for t in read_tensors(path)]
    text = json.dumps({"file": ident, "tensors": [[t.name, t.kind] for t in kinds]})
    try:  # best effort: written whole or not at all
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{f.name}-", dir=cache)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, f)
    except OSError:
        pass
    return kinds


def _row_bytes(weight: torch.Tensor) -> np.ndarray:
    """``weight`` [rows, cols] of any dtype as uint8 [rows, cols * itemsize] (its bytes)."""
    return weight.detach().cpu().contiguous().view(torch.uint8).numpy()


#: Elements of each row that :func:`content_key` reads (evenly spaced; all of a shorter row).
_KEY_COLUMNS = 64


def content_key(weight: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """A key equal for two tensors of one dtype that hold the same rows in any order: the
    shape and a hash of the rows' sorted signatures. A row's signature is an exact integer
    function of the bytes of :data:`_KEY_COLUMNS` of its elements (evenly spaced): their
    16-bit words times fixed pseudo-random multipliers below 2**20, summed by a float64
    matrix-vector product (exact: every partial sum stays below 2**53). The same row gives
    the same signature wherever it sits. Equal keys are not proof (rows may differ in other
    elements): :func:`match_rows` compares the bytes."""
    raw = _row_bytes(weight)
    rows, cols = weight.shape
    step = max(1, cols // _KEY_COLUMNS)
    picked = raw.reshape(rows, cols, -1)[:, ::step][:, :_KEY_COLUMNS].reshape(rows, -1)
    if picked.shape[1] % 2:  # a zero byte makes whole 16-bit words (the same for every row)
        picked = np.pad(picked, ((0, 0), (0, 1)))
    words = torch.from_numpy(np.ascontiguousarray(picked).view(np.int16))
    gen = torch.Generator().manual_seed(words.shape[1])
    mult = torch.randint(1, 1 << 20, (words.shape[1],), generator=gen).double()
    sig = words.double() @ mult
    return tuple(weight.shape), hash(tuple(sig.sort().values.tolist()))


def match_rows(weight: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor | None:
    """The row order that turns ``candidate`` into ``weight`` exactly, or None.

    Returns an index tensor ``idx`` with ``candidate[idx]`` equal to ``weight`` (rows compared
    bit for bit), or None when the two hold different rows (or differ in shape or dtype).
    """
    if weight.shape != candidate.shape or weight.dtype != candidate.dtype:
        return None
    if torch.equal(weight, candidate):
        return torch.arange(weight.shape[0])
    where: dict[bytes, int] = {}
    for i, row in enumerate(_row_bytes(candidate)):
        where.setdefault(row.tobytes(), i)
    idx = []
    for row in _row_bytes(weight):
        j = where.get(row.tobytes())
        if j is None:
            return None
        idx.append(j)
    return torch.tensor(idx, dtype=torch.long)


def tensor_finder(
    tensors: list, held: torch.dtype
) -> Callable[[str, torch.Tensor], tuple[Any, QuantBlocks | None, torch.Tensor]]:
    """``find(name, weight) -> (tensor, its unpacked blocks or None, row order)``: the GGUF
    tensor among ``tensors`` (:func:`read_tensors`'s) whose rows are ``weight``'s, whatever
    its name and with llama.cpp's q/k row reordering (``weight[i]`` is the tensor's row
    ``order[i]``).

    Each tensor's dequantization (gguf-py's values; within a load, the conversion's, computed
    once: :func:`~asyncllm.models.gguf_parse.dequantized`) is rounded to ``held`` (the dtype
    the model holds its weights in, as the conversion rounded them) and indexed by its rows' content
    (:func:`content_key`; a key is not proof: :func:`match_rows` compares the rows). Blocks
    with a kernel are unpacked here once (gguf-py's dequantization bit for bit).
    ``find`` raises ValueError (naming ``name``) where no tensor matches.
    """
    index: dict[tuple[tuple[int, ...], int], list[tuple[Any, torch.Tensor, QuantBlocks | None]]]
    index = {}
    for t in tensors:
        blocks = unpack(t.kind, t.raw, t.shape, t.name) if t.kind in KERNEL_TYPES else None
        dense = torch.from_numpy(dequantized(t.raw, t.type_id)).reshape(t.shape).to(held)
        index.setdefault(content_key(dense), []).append((t, dense, blocks))

    def find(name: str, weight: torch.Tensor) -> tuple[Any, QuantBlocks | None, torch.Tensor]:
        w = weight.detach().cpu()
        for t, dense, blocks in index.get(content_key(w), ()):
            idx = match_rows(w, dense)
            if idx is not None:
                return t, blocks, idx
        raise ValueError(f"{name}: no tensor of the GGUF file matches this weight")

    return find
