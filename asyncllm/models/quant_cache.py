"""The on-disk cache of quantized modules (:mod:`asyncllm.models.quantization`): its file
format, the key that ties a file to a model's weights and setting, atomic writes; and the
record of the GGUF file a converted model directory came from (:func:`gguf_source`).

A cache file is a ``torch.save`` of ``{"version", "name", "key", "precision", "modules"}``
(each module as :func:`asyncllm.layers.quant_linear.module_state` describes it); a file of
another version, under another name or for another key is not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import tempfile

import torch
from torch import nn

from asyncllm.layers import quant_linear as ql
from asyncllm.models.fingerprint import fingerprint, fingerprints

__all__ = [
    "CACHE_VERSION",
    "cache_key",
    "gguf_source",
    "load_cache",
    "remove_other_versions",
    "save_cache",
]

logger = logging.getLogger("asyncllm")

#: 5: a float32 model's int4 scales and zero points are float32 (exact), not bfloat16.
#: 6: a quantized embedding keeps the scale of a scaled embedding module (Gemma 3).
#: 7: Q8_0/Q5_0 decoder linears are Q8Linear codes (``logits`` recorded), not dense.
#: 8: Q6_K (int8 codes, scales per 16 columns) and Q5_K (with offsets) linears too.
#: 9: Q5_0 decoder linears as 5-bit codes with float16 scales.
#: 10: those codes in the layout of ``q8_linear.pack5`` that a table lookup reads.
#: 11: a float32 model's int4 scales and offsets tile-major ([out / 64, in / group, 2, 64]).
CACHE_VERSION = 11


def cache_key(model_dir: pathlib.Path, setting: str, gguf_file: pathlib.Path | None) -> str:
    """A hash of the cache format, ``setting``, torch's version and CPU capability (its int4
    packing), and the content of the model's weight files (and of ``gguf_file``, whose
    blocks "gguf" keeps); not of any folder's name or file's time
    (:mod:`asyncllm.models.fingerprint`)."""
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    # torch packs int4 codes per its CPU capability ([N/64, K, 32] on AVX-512, [N/32, K, 16]
    # on AVX2): an entry packed under one is another layout's garbage under the other.
    layout = torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha256(
        f"v{CACHE_VERSION}:{setting}:torch{torch.__version__}:{layout}".encode()
    )
    digest.update(fingerprints(files).encode())
    if gguf_file is not None:
        digest.update(f":gguf:{fingerprint(gguf_file)}".encode())
    return digest.hexdigest()


def load_cache(path: pathlib.Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
        # The file's own name is stored in it: a file copied or renamed from another
        # model's or setting's name is not this one's.
        if data.get("version") != CACHE_VERSION or data.get("name") != path.name:
            return None
    except Exception as exc:  # a truncated or foreign file: convert again
        logger.warning("asyncllm: ignoring unreadable quantization cache %s: %s", path, exc)
        return None
    # So is the key it was made for: under this name, another model's or other weights'
    # (a prefix of the key in the name matching by chance, or a file copied in place).
    if data.get("key") != key:
        logger.warning(
            "asyncllm: ignoring quantization cache %s: written for other weights; converting again",
            path,
        )
        return {}
    return data  # type: ignore[no-any-return]


def save_cache(path: pathlib.Path, key: str, modules: dict[str, nn.Module], precision: str) -> None:
    data = {
        "version": CACHE_VERSION,
        "name": path.name,
        "key": key,
        "precision": precision,
        "modules": {n: ql.module_state(m) for n, m in modules.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
        os.close(fd)
        torch.save(data, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be readable
        os.replace(tmp, path)  # atomic: readers see the old file, none, or the whole new one
    except OSError as exc:
        logger.warning("asyncllm: cannot cache the quantized model in %s: %s", path, exc)
        return
    remove_other_versions(path)


def remove_other_versions(path: pathlib.Path) -> list[pathlib.Path]:
    """Delete the files beside ``path`` (``<model>-<setting>-v<version>-<key>.pt``) that hold
    the same model folder name and setting in another cache version, or in the names before
    versions were in them (``<model>-<setting>-<key>.pt``): this version never reads them,
    and each is the model's size. Files of other settings, and of other weights at this
    version (another folder of the same name), stay. Returns the files removed."""
    m = re.fullmatch(r"(.+)-v\d+-[0-9a-f]{12}\.pt", path.name)
    if m is None:
        return []
    stale = re.compile(re.escape(m[1]) + r"-(?:v(\d+)-)?[0-9a-f]{12}\.pt")
    removed = []
    for other in path.parent.iterdir():
        s = stale.fullmatch(other.name)
        if s is not None and s[1] != str(CACHE_VERSION):
            try:
                other.unlink()
                removed.append(other)
            except OSError:  # gone already, or not ours to remove: leave it
                pass
    return removed


def gguf_source(model_dir: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file ``model_dir`` was converted from, as its ``asyncllm_source.json``
    records it, or None: none recorded, the file gone, or its content changed since the
    conversion (its fingerprint is not the one recorded; :mod:`asyncllm.models.fingerprint`).
    """
    meta = model_dir / "asyncllm_source.json"
    try:
        record = json.loads(meta.read_text())
        src = pathlib.Path(record["gguf_file"])
        return src if fingerprint(src) == record["fingerprint"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
