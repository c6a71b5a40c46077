"""One parse of a GGUF file per model load.

gguf-py's ``GGUFReader`` parses every metadata field when it is constructed (the default
model's tokenizer holds ~100,000 strings). Converting a GGUF file with transformers
constructs three readers of the same file (config, weights, tokenizer:
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``), parses every field's
value in each, and builds gguf-py's tensor-name map once per module of the model
(``get_tensor_name_map`` is called recursively: ~400 maps); asyncllm's own quantization then
reads the file again. All are pure functions of their arguments, so within
:func:`parsed_once` they are memoized: ``gguf.GGUFReader``, ``gguf.get_tensor_name_map`` and
transformers' ``_gguf_parse_value`` are replaced by memoizing versions and restored (the
memos dropped) when the outermost block exits. The reader itself reads a plain view of the
memory map (:class:`_PlainReader`). The same tensors bit for bit and the same tokenizer;
docs/tuning.md ("The first load of a GGUF file") has the times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import transformers.modeling_gguf_pytorch_utils as _hf_gguf
from gguf import GGUFReader

__all__ = ["parsed_once", "reader"]

_ORIGINAL_NAME_MAP = gguf.get_tensor_name_map
_ORIGINAL_PARSE_VALUE = _hf_gguf._gguf_parse_value
_lock = threading.Lock()
_depth = 0
_readers: dict[tuple[str, str], GGUFReader] = {}
#: id(part) -> (part, types, value) of transformers' ``_gguf_parse_value`` on a shared
#: reader's field part (the part is kept: its id cannot be reused meanwhile).
_values: dict[int, tuple[Any, list[int], Any]] = {}


def _parse_value_once(part: Any, types: Any) -> Any:
    """transformers' ``_gguf_parse_value`` (a field part to an int, float, bool or str:
    immutable), once per part of the shared readers: transformers parses every metadata
    value of the file in each of its three ``load_gguf_checkpoint`` calls."""
    hit = _values.get(id(part))
    if hit is not None and hit[0] is part and hit[1] == types:
        return hit[2]
    value = _ORIGINAL_PARSE_VALUE(part, types)
    _values[id(part)] = (part, list(types) if isinstance(types, list) else [types], value)
    return value


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
def parsed_once() -> Iterator[None]:
    """Within this block (re-entrant, any thread), every ``gguf.GGUFReader`` of one file is
    one parse and every ``gguf.get_tensor_name_map(arch, n)`` one map; both memos are
    dropped when the outermost block exits."""
    global _depth
    with _lock:
        if _depth == 0:
            gguf.GGUFReader = _SharedReader  # type: ignore[misc]
            gguf.get_tensor_name_map = functools.cache(_ORIGINAL_NAME_MAP)
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
                _hf_gguf._gguf_parse_value = _ORIGINAL_PARSE_VALUE
                _readers.clear()
                _values.clear()
