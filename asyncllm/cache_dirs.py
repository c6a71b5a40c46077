"""Where asyncllm keeps its on-disk caches: one root directory (:func:`cache_dir`) holding
``gguf/`` (GGUF files converted to safetensors, :mod:`asyncllm.models.loader`), ``quant/``
(quantized modules, :mod:`asyncllm.models.quantization`), ``compiled/`` and ``inductor/``
(compiled forwards and Inductor's caches, :mod:`asyncllm.worker.compiled`). Pure Python, no
torch: the loader, the compiler driver and the benchmarks all read it.
"""

from __future__ import annotations

import os
import pathlib

from asyncllm import envs

__all__ = ["cache_dir"]


def cache_dir() -> pathlib.Path:
    """Return the directory asyncllm caches converted models in (not created here).

    ``$ASYNCLLM_CACHE`` if set, else ``$XDG_CACHE_HOME/asyncllm``, else ``~/.cache/asyncllm``.
    """
    explicit = envs.path("ASYNCLLM_CACHE")
    if explicit is not None:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "asyncllm"
