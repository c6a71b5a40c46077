"""Content fingerprints of weight files: what asyncllm's on-disk caches are keyed by.

The quantized-weights cache (:mod:`asyncllm.models.quantization`), the GGUF conversion cache
(:func:`asyncllm.models.loader.resolve_model_dir`) and the GGUF tensor-type cache
(:func:`asyncllm.models.gguf_quant.tensor_kinds`) key their entries by :func:`fingerprint`
of the files they were made from, never by a file's or folder's name, path or modification
time: two models in ``run1/final`` and ``run2/final``, or a checkpoint rewritten in place
with its modification time kept, are told apart by their bytes. Each entry also records
the fingerprint it was made for, and a load checks it (a mismatch rebuilds the entry).

A file up to :data:`FULL_HASH_BYTES` (64 MiB) is hashed whole (SHA-256). A larger one is
sampled, so that a multi-GB checkpoint costs milliseconds, not seconds; see
:func:`fingerprint` for what is read and what a sample can miss (docs/tuning.md, "Costs
behind smaller code choices", has the default model's files sampled and hashed whole).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import pathlib
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO

__all__ = ["FULL_HASH_BYTES", "fingerprint", "fingerprints", "memoized"]

#: Files up to this size are hashed whole (a tiny test model's); larger ones are sampled.
FULL_HASH_BYTES = 64 << 20
_VERSION = b"asyncllm-fingerprint-1\0"
_END = 1 << 20  # bytes read at each end of a sampled file
_SAMPLES = 256  # evenly spaced chunks of a sampled file
_SAMPLE = 16 << 10
_TENSOR_SAMPLE = 4 << 10  # bytes read at the start, middle and end of each tensor
_BUFFER = 1 << 20

_memo: contextvars.ContextVar[dict[tuple[object, ...], str] | None] = contextvars.ContextVar(
    "asyncllm_fingerprint_memo", default=None
)


def fingerprint(path: os.PathLike[str] | str) -> str:
    """The SHA-256 hex digest of ``path``'s content, or of a sample of it for a large file.

    Up to :data:`FULL_HASH_BYTES`, every byte is hashed. Above it, what is hashed is the
    size and: the first and last MiB, 256 chunks of 16 KiB evenly spaced over the whole
    file, and, for a safetensors file, its whole JSON header (every tensor's name, dtype,
    shape and byte range) and 4 KiB at the start, middle and end of every tensor's data.
    That is a few MiB for a multi-GB file. The name, path and times of the file are not
    part of it.

    What a sampled fingerprint can miss: a change confined to bytes no sample covers, with
    the size and header unchanged, e.g. a few rows in the interior of one tensor of a
    large safetensors file, or anything between the samples of a large GGUF or ``.bin``
    file (whose headers are not parsed). Retraining or fine-tuning a tensor changes all of
    its bytes, which its samples see.

    Inside a :func:`memoized` block, a file already fingerprinted there (same path, inode,
    size and times) is not read again.

    Args:
        path: the file.

    Returns:
        64 hex digits.

    Raises:
        OSError: the file cannot be read.
    """
    path = pathlib.Path(path)
    memo = _memo.get()
    st = path.stat()
    ident = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if memo is not None and ident in memo:
        return memo[ident]
    h = hashlib.sha256(_VERSION + st.st_size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if st.st_size <= FULL_HASH_BYTES:
            while chunk := f.read(_BUFFER):
                h.update(chunk)
        else:
            for start, end in _sample_ranges(f, st.st_size, path.suffix == ".safetensors"):
                f.seek(start)
                h.update(struct.pack("<QQ", start, end) + f.read(end - start))
    digest = h.hexdigest()
    if memo is not None:
        memo[ident] = digest
    return digest


def fingerprints(files: Iterable[pathlib.Path]) -> str:
    """One SHA-256 hex digest for several files: each one's name (not its folder) and
    :func:`fingerprint`, in the order given.

    Raises:
        OSError: a file cannot be read.
    """
    h = hashlib.sha256(_VERSION)
    for f in files:
        h.update(f"{f.name}\0{fingerprint(f)}\0".encode())
    return h.hexdigest()


@contextlib.contextmanager
def memoized() -> Iterator[None]:
    """Within the block (one model load), each file is read for its fingerprint once: the
    conversion, tensor-type and quantization caches of a GGUF model all key by its file."""
    outer = _memo.get()
    token = _memo.set({} if outer is None else outer)
    try:
        yield
    finally:
        _memo.reset(token)


def _sample_ranges(f: BinaryIO, size: int, safetensors: bool) -> list[tuple[int, int]]:
    """The sorted, merged byte ranges :func:`fingerprint` hashes in a file of ``size``."""
    ranges = [(0, _END), (size - _END, size)]
    step = (size - _SAMPLE) // (_SAMPLES - 1)
    ranges += [(i * step, i * step + _SAMPLE) for i in range(_SAMPLES)]
    if safetensors:
        ranges += _tensor_ranges(f, size)
    merged: list[tuple[int, int]] = []
    for start, end in sorted((max(0, s), min(size, e)) for s, e in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif start < end:
            merged.append((start, end))
    return merged


def _tensor_ranges(f: BinaryIO, size: int) -> list[tuple[int, int]]:
    """A safetensors file's header and, for each tensor, 4 KiB at the start, middle and end
    of its data; none where the header does not parse (the loader reports such a file)."""
    f.seek(0)
    try:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            return []
        header = json.loads(f.read(n))
        spans = [t["data_offsets"] for k, t in header.items() if k != "__metadata__"]
        base = 8 + n
        out = [(0, base)]
        for begin, end in spans:
            mid = (begin + end) // 2
            for s in (begin, mid - _TENSOR_SAMPLE // 2, end - _TENSOR_SAMPLE):
                s = max(begin, s)
                out.append((base + s, base + min(end, s + _TENSOR_SAMPLE)))
        return out
    except (ValueError, TypeError, KeyError, AttributeError, struct.error):
        return []
