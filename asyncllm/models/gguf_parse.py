"""One parse of a GGUF file per model load.

gguf-py's ``GGUFReader`` parses every metadata field when it is constructed (the default
model's tokenizer holds ~100,000 strings). Converting a GGUF file with transformers
constructs three readers of the same file (config, weights, tokenizer:
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``), parses every field's
value in each, and builds gguf-py's tensor-name map once per module of the model
(``get_tensor_name_map`` is called recursively: ~400 maps) and dequantizes every tensor;
asyncllm's own quantization then reads the file again and needs the same dequantized
tensors. All are pure functions of their arguments, so within :func:`parsed_once` they are
memoized: ``gguf.GGUFReader``, ``gguf.get_tensor_name_map``, ``gguf.dequantize`` and
transformers' ``_gguf_parse_value`` are replaced by memoizing versions and restored (the
memos dropped) when the outermost block exits. The reader itself reads a plain view of the
memory map and walks arrays without per-element calls (:class:`_PlainReader`). The same
tensors bit for bit and the same tokenizer; docs/tuning.md ("The first load of a GGUF
file") has the times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import transformers.modeling_gguf_pytorch_utils as _hf_gguf
from gguf import GGUFReader, GGUFValueType

__all__ = ["dequantized", "parsed_once", "reader"]

_ORIGINAL_NAME_MAP = gguf.get_tensor_name_map
_ORIGINAL_PARSE_VALUE = _hf_gguf._gguf_parse_value
_ORIGINAL_DEQUANTIZE = gguf.dequantize
_lock = threading.Lock()
_depth = 0
_readers: dict[tuple[str, str], GGUFReader] = {}
#: id(part) -> (part, types, value) of transformers' ``_gguf_parse_value`` on a shared
#: reader's field part (the part is kept: its id cannot be reused meanwhile).
_values: dict[int, tuple[Any, list[int], Any]] = {}
#: (address, shape, strides, type) of a shared reader's tensor data -> its dequantization.
_dense: dict[tuple[int, tuple[int, ...], tuple[int, ...], int], np.ndarray] = {}
#: What computes :func:`dequantized` inside the outermost block (None: gguf-py's own).
_dequantize: Callable[[np.ndarray, Any], np.ndarray] | None = None


def dequantized(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``gguf.dequantize(data, qtype)`` (float32; shared, not to be written), computed once
    per tensor inside :func:`parsed_once`: transformers' conversion dequantizes every tensor
    of the file, and the quantization then needs the same values to find each weight's
    tensor (:func:`asyncllm.models.gguf_quant.tensor_finder`); both read the block's shared
    reader, so the tensors' data are the same views of its map. Outside a block, computed
    anew."""
    key = (data.__array_interface__["data"][0], data.shape, data.strides, int(qtype))
    with _lock:
        active = _depth > 0
        hit = _dense.get(key) if active else None
    if hit is not None:
        return hit
    dense = (_dequantize or _ORIGINAL_DEQUANTIZE)(data, qtype)
    if active:
        with _lock:
            if _depth > 0:
                _dense[key] = dense
    return dense


def _parse_value_once(part: Any, types: Any) -> Any:
    """transformers' ``_gguf_parse_value`` (a field part to an int, float, bool or str:
    immutable), once per part of the shared readers: transformers parses every metadata
    value of the file in each of its three ``load_gguf_checkpoint`` calls."""
    hit = _values.get(id(part))
    if hit is not None and hit[0] is part and hit[1] == types:
        return hit[2]
    if _is_string(part, types):  # transformers': array("B", list(part)).tobytes().decode()
        value = part.tobytes().decode()
    else:
        value = _ORIGINAL_PARSE_VALUE(part, types)
    _values[id(part)] = (part, list(types) if isinstance(types, list) else [types], value)
    return value


def _is_string(part: Any, types: Any) -> bool:
    """A string's bytes (a 1-D uint8 part of type 8, alone or as an array's element type)."""
    kind = types if isinstance(types, list) else [types]
    return (
        kind in ([GGUFValueType.STRING], [GGUFValueType.ARRAY, GGUFValueType.STRING])
        and isinstance(part, np.ndarray)
        and part.dtype == np.uint8
        and part.ndim == 1
    )


class _PlainReader(GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map: gguf-py slices the file
    once per metadata value (~3.7 million slices for the default model's vocabulary), and a
    ``np.memmap`` slice runs Python code (``__getitem__``, ``__array_finalize__``) where a
    plain view does not: the same fields and tensors (views of the same read-only map) in
    about a third of the time."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """gguf-py's parts of one field, with arrays of strings and of numbers walked
        without its per-element calls (the vocabulary: ~100,000 strings, two views each):
        the same parts (views of the same bytes, the same dtypes), data indices and types.
        Other fields, and files in the other byte order, go to gguf-py's own code."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        data = self._plain
        head = [data[orig_offs : orig_offs + 4].view(np.uint32)]
        head.append(data[orig_offs + 4 : orig_offs + 12].view(np.uint64))
        item, count = int(head[0][0]), int(head[1][0])
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(item))
        if item != GGUFValueType.STRING and scalar is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY] + [GGUFValueType(item)] * (count > 0)
        offs = orig_offs + 12
        if scalar is not None:
            width = np.dtype(scalar).itemsize
            values = data[offs : offs + width * count].view(scalar)
            parts = head + [values[i : i + 1] for i in range(count)]
            return 12 + width * count, parts, list(range(2, 2 + count)), types
        parts, idxs = head, []
        for _ in range(count):
            (length,) = struct.unpack_from("=Q", data, offs)  # the file is in native order
            parts.append(data[offs : offs + 8].view(np.uint64))
            parts.append(data[offs + 8 : offs + 8 + length])
            idxs.append(len(parts) - 1)
            offs += 8 + length
        return offs - orig_offs, parts, idxs, types


class _SharedReader(GGUFReader):
    """Stands in for ``gguf.GGUFReader`` inside :func:`parsed_once`: construction returns
    the file's one parsed reader (a plain ``GGUFReader``, so ``__init__`` does not run
    again)."""

    def __new__(cls, path: os.PathLike[str] | str, mode: str = "r") -> Any:
        return _shared(path, mode)


def _shared(path: os.PathLike[str] | str, mode: str = "r") -> GGUFReader:
    key = (str(pathlib.Path(path).resolve()), mode)
    with _lock:
        found = _readers.get(key)
    if found is not None:
        return found
    parsed = _PlainReader(path, mode)  # type: ignore[arg-type]  # parsed outside the lock
    with _lock:
        if _depth == 0:  # the block ended meanwhile: keep nothing
            return parsed
        return _readers.setdefault(key, parsed)


def reader(path: os.PathLike[str] | str) -> GGUFReader:
    """A reader of ``path``: the one shared inside :func:`parsed_once`, else a fresh one.

    Raises:
        OSError, ValueError: gguf-py's, for an unreadable or malformed file.
    """
    with _lock:
        active = _depth > 0
    return _shared(path) if active else _PlainReader(path)


@contextlib.contextmanager
def parsed_once(
    dequantize: Callable[[np.ndarray, Any], np.ndarray] | None = None,
) -> Iterator[None]:
    """Within this block (re-entrant, any thread), every ``gguf.GGUFReader`` of one file is
    one parse, every ``gguf.get_tensor_name_map(arch, n)`` one map and every tensor one
    ``gguf.dequantize`` (:func:`dequantized`); the memos are dropped when the outermost
    block exits. ``dequantize(data, qtype)``, given to the outermost block, computes those
    dequantizations (it must equal gguf-py's bit for bit; default: gguf-py's)."""
    global _depth, _dequantize
    with _lock:
        if _depth == 0:
            _dequantize = dequantize
            gguf.GGUFReader = _SharedReader  # type: ignore[misc]
            gguf.get_tensor_name_map = functools.cache(_ORIGINAL_NAME_MAP)
            gguf.dequantize = dequantized
            _hf_gguf._gguf_parse_value = _parse_value_once
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader = GGUFReader  # type: ignore[misc]
                gguf.get_tensor_name_map = _ORIGINAL_NAME_MAP
                gguf.dequantize = _ORIGINAL_DEQUANTIZE
                _hf_gguf._gguf_parse_value = _ORIGINAL_PARSE_VALUE
                _readers.clear()
                _values.clear()
                _dense.clear()
                _dequantize = None
