"""The C++ CPU kernels, built when the package was installed (``setup.py``, ``csrc/``):
which variant this CPU runs, and each kernel family's module.

Each family (``attention``: the paged attention; ``int4``: the int4 linear layer; ``q8``:
GGUF's Q8_0 layer; ``decoder``: the C++ forward of :mod:`asyncllm.worker.native_forward`)
is one extension module per instruction-set variant
(:mod:`asyncllm.kernels.variants`). :func:`module` imports the best variant whose CPU flags
this machine has, registers its op kernels (:mod:`asyncllm.kernels.ops`) and returns it;
nothing is ever compiled at run time and no process is started. Where no variant is
installed (no compiler at install time, another torch than the one it was built against),
the callers keep torch's paths; one warning says why, once per process.

The weight families have a switch, read on every call (tests and benchmarks flip it):
``ASYNCLLM_INT4_DEQUANT_KERNEL``, ``ASYNCLLM_Q8_KERNEL``; ``0``/``false``/``no``/``off`` runs
torch's path instead. The attention's is ``EngineConfig.attention_backend`` ("torch"), an
engine's setting rather than the process's.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import pathlib
import platform
import threading
from functools import cache
from typing import Any

from asyncllm import envs
from asyncllm.kernels.variants import FAMILIES, VARIANTS, module_name, variants_for

__all__ = ["SWITCHES", "cpu_flags", "enabled", "failure", "import_variant", "module", "status"]

logger = logging.getLogger("asyncllm")

#: Family -> the environment variable that switches it off (attention: none, see above).
SWITCHES = {
    "int4": "ASYNCLLM_INT4_DEQUANT_KERNEL",
    "q8": "ASYNCLLM_Q8_KERNEL",
    "decoder": "ASYNCLLM_NATIVE_FORWARD",
}

_lock = threading.Lock()
_modules: dict[str, Any] = {}
_failures: dict[str, str] = {}
_warned = False


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: torch's own probe (cpuinfo) where it has one, united with
    the ``flags`` line of ``/proc/cpuinfo`` (Linux); empty where neither answers."""
    import torch

    flags: set[str] = set()
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is not None:
        # A torch build whose private probe changed: /proc/cpuinfo still answers.
        with contextlib.suppress(Exception):
            flags.update(k for k, v in probe().items() if v is True)
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return frozenset(flags)


#: Caps the variant :func:`module` imports, e.g. ``avx2`` on an AVX-512 machine (with torch's
#: ``ATEN_CPU_CAPABILITY=avx2`` and oneDNN's ``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2 CPU's paths,
#: for tests and benchmarks of another CPU kind).
VARIANT_ENV = "ASYNCLLM_CPU_VARIANT"


def _runnable_variants() -> list[str]:
    """The variants of this architecture whose CPU flags this machine has, best first (none
    better than :data:`VARIANT_ENV` names, where it is set)."""
    flags = cpu_flags()
    names = variants_for(platform.machine())
    cap = envs.text(VARIANT_ENV)
    if cap in names:
        names = names[: names.index(cap) + 1]
    return [v for v in reversed(names) if VARIANTS[v][2] <= flags]


def enabled(family: str) -> bool:
    """The family is not switched off (its :data:`SWITCHES` variable, where it has one)."""
    return family not in SWITCHES or envs.switch(SWITCHES[family])


def import_variant(family: str, name: str) -> Any:
    """One variant's module of ``family``, imported without registering its op kernels
    (tests compare variants' functions; the engine uses :func:`module`).

    Raises:
        ImportError: that variant was not built (or does not load with this torch).
    """
    return importlib.import_module(f"asyncllm._kernels.{module_name(family, name)}")


def _load(family: str) -> Any:
    reasons = []
    for name in _runnable_variants():
        try:
            mod = import_variant(family, name)
        except ImportError as e:  # not built, or built against another torch
            reasons.append(f"{name}: {str(e).strip().splitlines()[-1] if str(e) else e!r}")
            continue
        if family == "int4" and mod.int4_pack_block_n() == 0:
            # Nothing of ours reads that packing (and a float32 layer's tile-major scales
            # would need converting at every call): torch's path with its own kernel.
            reasons.append(f"{name}: torch packs int4 weights in a layout unknown here")
            continue
        import asyncllm.kernels.ops  # noqa: F401  (the schemas the kernels implement)

        mod.register_ops()
        return mod
    if not reasons:
        raise ImportError(f"no kernel variant runs on this CPU ({platform.machine()})")
    raise ImportError("; ".join(reasons))


def module(family: str) -> Any:
    """``family``'s kernel module (``attention``, ``int4`` or ``q8``) in the best variant this
    CPU runs, its op kernels registered; None where it is switched off or not installed
    (the reason in :func:`failure`, one warning per process). Thread-safe, cheap after the
    first call, never compiles anything."""
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; one of {sorted(FAMILIES)}")
    if not enabled(family):
        return None
    mod = _modules.get(family)
    if mod is not None or family in _failures:
        return mod
    global _warned
    with _lock:
        if family not in _modules and family not in _failures:
            try:
                _modules[family] = _load(family)
            except ImportError as e:
                _failures[family] = str(e)
                if not _warned:
                    _warned = True
                    logger.warning(
                        "asyncllm: the C++ CPU kernels are not installed (%s); torch's paths "
                        "run instead (slower). Reinstall with a C++ compiler: `pip install "
                        "--no-build-isolation -e .` (README)",
                        e,
                    )
    return _modules.get(family)


def failure(family: str) -> str | None:
    """Why ``family`` could not be loaded, or None (loaded, not tried, or switched off)."""
    return _failures.get(family)


def status() -> dict[str, str]:
    """Per family, what runs: the variant's name, "off" (switched off) or "torch" (not
    installed); for ``stats()`` and the start-up line."""
    out = {}
    for family in FAMILIES:
        mod = module(family)
        if mod is not None:
            out[family] = str(mod.__name__).rpartition(".")[2].removeprefix(f"_{family}_")
        else:
            out[family] = "off" if not enabled(family) else "torch"
    return out
