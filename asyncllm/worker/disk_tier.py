"""The third tier of the prefix cache: KV blocks in files (``EngineConfig.prefix_cache_dir``),
so that a restarted engine, or another process on the same machine, starts with its
prefixes warm.

Each block is one file in the directory, named by a digest of the *namespace* (model
weights' fingerprint, precision, dtype, KV layout and block size, tokenizer:
:func:`namespace_digest`) and the block's ``(group, chained hash)`` (the hash already
covers the cache salt, so another tenant's or another model's block has another name).
Content::

    MAGIC (8 bytes) | header length (4 bytes, little-endian) | header (JSON) | payload

The header names the namespace, group and hash it was written for, the payload's length and
its SHA-256; the payload is the block's bytes in each CPU-pool tensor, in the pool's order
(every slot's K, then V, and whatever other per-block tensors the pool mirrors). A file is
written to a temporary name and renamed into place (``os.replace``: atomic on POSIX), so a
reader sees a whole file or none; a file that is torn, truncated, corrupt or written for
another namespace or key anyway (copied by hand, a disk error) fails the checks, is
counted, deleted and never loaded.

All file work runs on one background thread per engine (reads first, then writes, batched):
never on the event loop or the compute thread. The compute thread only snapshots the bytes
of newly cached blocks (:meth:`DiskPrefixCache.save`) and checks that a file exists
(:meth:`DiskPrefixCache.has`: one ``stat``). The directory is bounded: past ``max_bytes``
the least recently used files (by modification time: a hit touches its file) are deleted.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asyncllm.core.host_store import Key

logger = logging.getLogger("asyncllm")

MAGIC = b"ASYNCKV1"
#: Seconds between listings of the directory when trimming (other processes write there).
_RESCAN_S = 1.0
_SUFFIX = ".kv"


def namespace_digest(**parts: Any) -> str:
    """SHA-256 hex digest of the JSON of ``parts`` (keys sorted): what every file name and
    header is keyed by besides the block's own key."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class DiskPrefixCache:
    """The disk tier of one engine: a background thread reading block files into CPU-pool
    slots and writing newly cached blocks to files.

    Args:
        directory: where the files live (made when missing; shared with other engines
            and processes of any namespace).
        namespace: :func:`namespace_digest` of the model and KV layout.
        tensors: the CPU pool's per-block tensors (first dimension: slot), each a whole
            block's bytes at ``tensor[slot]``.
        max_bytes: the most bytes of files this engine keeps in the directory (LRU).

    Attributes:
        num_written, num_read: files written and read.
        num_invalid: files found torn, truncated, corrupt or foreign (deleted, not loaded).
        num_deleted: files deleted to stay within ``max_bytes``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        namespace: str,
        tensors: Sequence[torch.Tensor],
        max_bytes: int,
    ) -> None:
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.namespace = namespace
        self._views = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
        self.block_bytes = sum(v.shape[1] for v in self._views)
        self.max_bytes = max_bytes
        self._jobs: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = 0
        self._done: collections.deque[tuple[Key, int, bool]] = collections.deque()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._scanned_at = 0.0  # time.monotonic() of the last listing
        self.num_written = self.num_read = self.num_invalid = self.num_deleted = 0
        self._thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="asyncllm-kv-disk", daemon=True)
        self._thread.start()

    def path(self, key: Key) -> str:
        """The file of ``key`` in this namespace."""
        group, block_hash = key
        h = hashlib.sha256(f"{self.namespace}:{group}:".encode() + block_hash).hexdigest()
        return os.path.join(self.directory, h[:40] + _SUFFIX)

    def has(self, key: Key) -> bool:
        """Whether ``key``'s file exists (checked when read)."""
        return os.path.exists(self.path(key))

    def request_load(self, key: Key, slot: int) -> None:
        """Read ``key``'s file into ``slot`` on the thread (reads go before writes)."""
        self._put(0, ("load", key, slot))

    def completed(self) -> list[tuple[Key, int, bool]]:
        """The reads finished since the last call (see :class:`~asyncllm.core.host_store.
        DiskTier`)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def save(self, kv_blocks: Sequence[torch.Tensor], items: Sequence[tuple[int, Key]]) -> None:
        """Snapshot blocks ``(block, key)`` of ``kv_blocks`` (the device cache's per-block
        tensors, in the same order as the pool's) and queue their files for writing: one
        gather per tensor for all of them, here; the files on the thread."""
        if not items:
            return
        device = kv_blocks[0].device
        ids = torch.tensor([b for b, _ in items], dtype=torch.long, device=device)
        # The gather is the snapshot (the arrays own copies); each block's payload is
        # hashed and written from them, part by part, on the thread.
        parts = [
            t.index_select(0, ids).reshape(len(items), -1).view(torch.uint8).cpu().numpy()
            for t in kv_blocks
        ]
        batch = [(key, [p[i] for p in parts]) for i, (_, key) in enumerate(items)]
        self._put(1, ("write", batch))

    def close(self) -> None:
        """Finish the queued work and stop the thread (idempotent; the next job starts a
        new one)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._seq += 1
            self._jobs.put((2, self._seq, None))
            thread.join()
        self._thread = None

    def _put(self, priority: int, job: Any) -> None:
        if self._thread is None:
            self._start()
        self._seq += 1
        self._jobs.put((priority, self._seq, job))

    def _run(self) -> None:
        self._scan()
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "load":
                    _, key, slot = job
                    self._done.append((key, slot, self._load(key, slot)))
                else:
                    for key, payload in job[1]:
                        self._write(key, payload)
                    self._trim()
            except Exception:  # never a dead thread: a load fails, a write is skipped
                logger.exception("prefix cache directory %s", self.directory)
                if job[0] == "load":
                    self._done.append((job[1], job[2], False))

    def _scan(self) -> None:
        """This directory's files, least recently used first (another namespace's and
        another process's too: the bound is on the directory's bytes). An entry that is
        not a plain file, or that goes away while it is read (another process's trim), is
        passed over; a directory that cannot be listed leaves the list empty."""
        self._lru.clear()
        self._scanned_at = time.monotonic()
        found = []
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if not entry.name.endswith(_SUFFIX):
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime, entry.name, st.st_size))
        except OSError:
            logger.exception("prefix cache directory %s: cannot list it", self.directory)
        for _, name, size in sorted(found):
            self._lru[name] = size

    def _load(self, key: Key, slot: int) -> bool:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return False  # deleted since (by another process's bound)
        payload = self._check(data, key)
        if payload is None:
            self.num_invalid += 1
            self._delete(path)
            return False
        at = 0
        for v in self._views:
            n = v.shape[1]
            v[slot].numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=n, offset=at)
            at += n
        self.num_read += 1
        self._touch(path)
        return True

    def _check(self, data: bytes, key: Key) -> bytes | None:
        """The payload of a whole, intact file written for ``key`` in this namespace."""
        if len(data) < 12 or data[:8] != MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        try:
            header = json.loads(data[12 : 12 + n])
        except ValueError:
            return None
        payload = data[12 + n :]
        ok = (
            isinstance(header, dict)
            and header.get("namespace") == self.namespace
            and header.get("group") == key[0]
            and header.get("hash") == key[1].hex()
            and header.get("payload_bytes") == len(payload) == self.block_bytes
            and header.get("sha256") == hashlib.sha256(payload).hexdigest()
        )
        return payload if ok else None

    def _write(self, key: Key, payload: Sequence[np.ndarray]) -> None:
        """Write ``key``'s file: ``payload`` is the block's bytes, one uint8 row per tensor
        of the pool (concatenated in the file)."""
        path = self.path(key)
        if os.path.exists(path):
            self._touch(path)
            return
        digest = hashlib.sha256()
        for part in payload:
            digest.update(part.data)
        size = sum(part.nbytes for part in payload)
        header = json.dumps({
            "namespace": self.namespace, "group": key[0], "hash": key[1].hex(),
            "payload_bytes": size, "sha256": digest.hexdigest(),
        }).encode()  # fmt: skip
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            for part in payload:
                f.write(part.data)
        os.replace(tmp, path)
        self.num_written += 1
        name = os.path.basename(path)
        self._lru[name] = 12 + len(header) + size
        self._lru.move_to_end(name)

    def _touch(self, path: str) -> None:
        name = os.path.basename(path)
        try:
            os.utime(path)
        except FileNotFoundError:
            self._lru.pop(name, None)
            return
        if name in self._lru:
            self._lru.move_to_end(name)

    def _delete(self, path: str) -> None:
        self._lru.pop(os.path.basename(path), None)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def _trim(self) -> None:
        if time.monotonic() - self._scanned_at > _RESCAN_S:
            self._scan()  # other processes' files count against the bound too
        total = sum(self._lru.values())
        while total > self.max_bytes and self._lru:
            name, size = self._lru.popitem(last=False)
            total -= size
            try:
                os.remove(os.path.join(self.directory, name))
                self.num_deleted += 1
            except FileNotFoundError:
                pass
