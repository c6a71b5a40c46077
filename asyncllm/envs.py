"""Every environment variable asyncllm reads, in one registry: its name, kind, default and
meaning, parsed by one function per kind. docs/configuration.md's table of them is
:func:`markdown_table`'s output (a test keeps the two equal), and the engine's start-up log
line and ``stats()["env"]`` name the ones set to something other than their default
(:func:`non_default`).

Settings of an engine are :class:`~asyncllm.config.EngineConfig` fields; these variables
are for what is not one engine's choice: where caches live, switching a native kernel family
off to compare it with torch's path, the server's API keys, and the build (read by
``setup.py`` itself, which cannot import the package it builds). asyncllm leaves the
process's environment as it found it: torch's ``TORCHINDUCTOR_CACHE_DIR`` is set (to
asyncllm's cache directory, unless already set) only while a compiled forward is built or
loaded, and restored after (torch itself writes its default there whenever Inductor runs
with none set).

Pure Python; no torch.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

__all__ = ["VARS", "EnvVar", "choice", "markdown_table", "non_default", "path", "switch", "text"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One variable.

    Attributes:
        name: the variable.
        kind: "switch" (1/0, true/false, yes/no, on/off), "choice" (one of ``choices``),
            "path", "text" or "secret" (text never logged or reported).
        default: the value when unset ("" when unset means "not given").
        doc: what it does (Markdown, one sentence or two).
        choices: a "choice" variable's values ("" always allowed: unset).
        read_by: where it is read (a module, or ``setup.py``).
    """

    name: str
    kind: str
    default: str
    doc: str
    choices: tuple[str, ...] = ()
    read_by: str = "asyncllm"


VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("ASYNCLLM_CACHE", "path", "",
               "where converted models, quantized weights and compiled forwards are cached; "
               "unset: `$XDG_CACHE_HOME/asyncllm`, else `~/.cache/asyncllm`",
               read_by="asyncllm.cache_dirs"),
        EnvVar("ASYNCLLM_COMPILE", "choice", "",
               "`1`/`0` overrides `EngineConfig.compile=\"auto\"` and `\"cached\"` (on or "
               "off); unset: auto",
               choices=("0", "1"), read_by="asyncllm.worker.device"),
        EnvVar("ASYNCLLM_CPU_VARIANT", "text", "",
               "caps the native kernels' CPU variant (e.g. `avx2` on an AVX-512 machine), to "
               "run another CPU kind's paths; unset or a name not built here: the best this "
               "CPU runs", read_by="asyncllm.kernels.native"),
        EnvVar("ASYNCLLM_INT4_DEQUANT_KERNEL", "switch", "1",
               "`0`: int4 linears run torch's path instead of the C++ kernels",
               read_by="asyncllm.kernels.native"),
        EnvVar("ASYNCLLM_Q8_KERNEL", "switch", "1",
               "`0`: int8-code (Q8_0, Q6_K, Q5_K) linears run torch's path instead of the C++ "
               "kernels", read_by="asyncllm.kernels.native"),
        EnvVar("ASYNCLLM_NATIVE_FORWARD", "switch", "1",
               "`0`: Llama-family and Gemma 3 models run transformers' modeling code (eager or "
               "compiled) instead of the C++ forward",
               read_by="asyncllm.kernels.native"),
        EnvVar("ASYNCLLM_CPU_PACKED_LINEAR", "switch", "1",
               "`0`: float linears on CPU run `torch.nn.functional.linear` instead of oneDNN's "
               "packed weights", read_by="asyncllm.layers.cpu_linear"),
        EnvVar("ASYNCLLM_FUSED_SIBLINGS", "switch", "1",
               "`0`: sibling projections (q/k/v, gate/up) stay separate linears",
               read_by="asyncllm.layers.sibling_linears"),
        EnvVar("ASYNCLLM_API_KEY", "secret", "",
               "the server's API keys (comma-separated) when `--api-key` is not given",
               read_by="asyncllm.server.cli"),
        EnvVar("ASYNCLLM_BENCH_VLLM_VENV", "path", "",
               "the virtual environment of vLLM-CPU for `python -m asyncllm bench`",
               read_by="asyncllm.bench.processes"),
        EnvVar("ASYNCLLM_BENCH_LLAMACPP_VENV", "path", "",
               "the virtual environment of llama-cpp-python for `python -m asyncllm bench`",
               read_by="asyncllm.bench.processes"),
        EnvVar("ASYNCLLM_BUILD_KERNELS", "switch", "1",
               "`0`: `pip install` builds no native kernels (torch's paths run)",
               read_by="setup.py"),
        EnvVar("ASYNCLLM_BUILD_VARIANTS", "text", "",
               "`all`: build every CPU variant of the architecture (a wheel for other CPUs), "
               "`avx2,...`: those named; unset: the ones this CPU runs", read_by="setup.py"),
    )
}  # fmt: skip


def _raw(name: str) -> str:
    if name not in VARS:
        raise KeyError(f"{name} is not a registered asyncllm variable (asyncllm/envs.py)")
    return os.environ.get(name, "").strip()


def switch(name: str) -> bool:
    """A "switch" variable's value (its default when unset or empty).

    Raises:
        ValueError: a value that is not 1/0, true/false, yes/no or on/off.
    """
    value = _raw(name).lower() or VARS[name].default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"${name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def choice(name: str) -> str:
    """A "choice" variable's value ("" when unset).

    Raises:
        ValueError: a value not among its choices.
    """
    value = _raw(name)
    allowed = VARS[name].choices
    if value and value not in allowed:
        raise ValueError(f"${name} must be one of {', '.join(allowed)} (or unset), got {value!r}")
    return value


def text(name: str) -> str:
    """A "text" or "secret" variable's value ("" when unset)."""
    return _raw(name)


def path(name: str) -> pathlib.Path | None:
    """A "path" variable's value, ``~`` expanded (None when unset or empty)."""
    value = _raw(name)
    return pathlib.Path(value).expanduser() if value else None


def non_default() -> dict[str, str]:
    """The registered variables set to something other than their default (a secret's
    value shown as "***"), for the start-up log and ``stats()``."""
    out = {}
    for v in VARS.values():
        value = os.environ.get(v.name, "").strip()
        if value and value != v.default:
            out[v.name] = "***" if v.kind == "secret" else value
    return out


def markdown_table() -> str:
    """The registry as docs/configuration.md's Markdown table."""
    rows = ["| variable | default | read by | what it does |", "|---|---|---|---|"]
    for v in VARS.values():
        default = f"`{v.default}`" if v.default else "unset"
        rows.append(f"| `{v.name}` | {default} | `{v.read_by}` | {v.doc} |")
    return "\n".join(rows) + "\n"
