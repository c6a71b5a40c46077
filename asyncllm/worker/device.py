"""Where the engine runs and in which dtype: ``EngineConfig.device``, ``dtype``,
``num_threads`` and ``compile`` resolved to concrete values.

``dtype="auto"`` (the default) computes in the precision the weight file defines its
function in (:func:`asyncllm.models.loader.stored_dtype`): float32 for a GGUF file (the
default model) and for float32 or float16 checkpoints; bfloat16 for a bfloat16 checkpoint on
CUDA and on CPUs with native bfloat16 arithmetic (x86's AVX-512 BF16 or AMX-BF16:
``avx512_bf16`` / ``amx_bf16`` in ``/proc/cpuinfo``, as torch's own CPU feature probe
reports them) where torch's vectorized kernels run at AVX-512 and oneDNN is available;
float32 on other CPUs, where bfloat16 matmuls are emulated and slower than float32. Rounding
a GGUF model's activations to bfloat16 moved its greedy answers away from the file's own
(the fidelity table of docs/benchmarks.md); its int4 kernels read the same weight bytes in
float32. The KV cache takes the same dtype.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Literal

import torch

from asyncllm import envs
from asyncllm.kernels.native import cpu_flags

logger = logging.getLogger("asyncllm")

#: The x86 feature flags that mean native bfloat16 dot products (oneDNN uses them for
#: bfloat16 matmuls: ``vdpbf16ps`` with AVX-512 BF16, tile matmuls with AMX).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(device: str) -> torch.device:
    """``EngineConfig.device`` to a torch device: "auto" -> CUDA when available, else CPU.

    Raises:
        ValueError: a CUDA device asked for where torch has none.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device={device!r} but torch has no CUDA device here")
    return torch.device(device)


def cpu_bf16_reason() -> tuple[bool, str]:
    """Whether bfloat16 is the faster dtype on this CPU, and why (for the log line).

    True where the CPU has one of :data:`BF16_FLAGS`, torch's vectorized kernels run at
    AVX-512 (``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=avx2``
    lowers it) and oneDNN is available (the packed linears of
    :mod:`asyncllm.layers.cpu_linear`).
    """
    have = [f for f in BF16_FLAGS if f in cpu_flags()]
    capability = torch.backends.cpu.get_cpu_capability()
    if not have:
        return False, "the CPU has no native bfloat16 (avx512_bf16 / amx_bf16)"
    if not capability.startswith("AVX512"):
        return False, f"torch runs its CPU kernels at {capability}, not AVX512"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False, "torch has no oneDNN"
    return True, f"the CPU has {' and '.join(have)} (torch at {capability})"


def resolve_dtype(
    dtype: str | None, device: torch.device, stored: torch.dtype | None = None
) -> torch.dtype:
    """``EngineConfig.dtype`` to a torch dtype, logging one line that says which and why.

    An explicit dtype is returned as is. "auto" (or None, its alias) picks bfloat16 where the
    weights are stored in bfloat16 (``stored``, from
    :func:`asyncllm.models.loader.stored_dtype`) and the device runs it natively (CUDA, or a
    CPU where :func:`cpu_bf16_reason` says so); float32 otherwise: a GGUF file, a float32 or
    float16 checkpoint, or a precision not known (``stored`` None).

    Raises:
        ValueError: a dtype name that is none of "auto", "float32", "float16", "bfloat16".
    """
    if dtype not in (None, "auto", "float32", "float16", "bfloat16"):
        raise ValueError(f"unknown dtype {dtype!r}")
    if dtype not in (None, "auto"):
        return getattr(torch, dtype)  # type: ignore[no-any-return]
    if stored != torch.bfloat16:
        kind = "not known" if stored is None else str(stored).removeprefix("torch.")
        chosen, why = torch.float32, f"the weights' own precision is {kind}: computed in float32"
    elif device.type == "cuda":
        chosen, why = torch.bfloat16, "bfloat16 weights on CUDA"
    elif device.type == "cpu":
        fast, why = cpu_bf16_reason()
        chosen = torch.bfloat16 if fast else torch.float32
        why = f"bfloat16 weights; {why}"
    else:
        chosen, why = torch.float32, f"device type {device.type!r}"
    logger.info("dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen


def dtype_name(dtype: torch.dtype) -> Literal["float32", "float16", "bfloat16"]:
    """``torch.bfloat16`` -> "bfloat16" (the ``EngineConfig.dtype`` spelling)."""
    return str(dtype).removeprefix("torch.")  # type: ignore[return-value]


def default_num_threads() -> int:
    """Torch intra-op threads on CPU: one per core this process may run on (docs/tuning.md)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


#: Overrides what ``EngineConfig.compile="auto"`` resolves to: "0" off, "1" on (an explicit
#: True or False in the config still wins). The test suite sets "0" (tests/conftest.py).
COMPILE_ENV = "ASYNCLLM_COMPILE"


def resolve_compile(
    compile: str | bool, device: torch.device, experts: bool = False
) -> bool | Literal["cached"]:
    """``EngineConfig.compile`` -> whether to compile the forward on ``device``: True, False,
    or "cached" (use one built before, never build one).

    True and False are returned as they are; "cached" is "cached" where "auto" is on, else
    False. "auto" is on on CPU and off on CUDA, unless
    ``$ASYNCLLM_COMPILE`` says "1" (on) or "0" (off); off for a mixture-of-experts model
    (``experts``): transformers' expert routing gives Dynamo a data-dependent token count
    ("Constraints violated (L['input_ids'].size()[1])" on a tiny Mixtral), so the compile
    child would fail after a minute of CPU on every start, the engine serving eagerly anyway.

    Why on on CPU: on the 2-core x86 machine (AVX-512 BF16; bfloat16 with Q4_1 linears, the
    defaults; ``benchmarks/profile_step.py --ab compile --threads 2 --context 100``, steps
    alternating in one process) the compiled decode step was the faster at batch 1 and at
    batch 64 (docs/tuning.md, "Compiled forward", has the times). It costs nothing at
    start: the compile runs in a child process at the lowest priority while the engine
    serves eagerly (about a minute the first time), and later starts load the saved
    artifact in ~3 s (:mod:`asyncllm.worker.compiled`). CUDA: "auto" leaves it off there
    (docs/benchmarks.md, "GPU": the one GPU run so far had a torch without precompilation).
    A torch without precompilation (:func:`precompilation_available`) turns "auto" and
    "cached" off.

    Raises:
        ValueError: ``$ASYNCLLM_COMPILE`` set to something other than "0" or "1"; True on a
            torch without precompilation.
    """
    if compile is True and not precompilation_available():
        raise ValueError(
            f"EngineConfig.compile=True needs torch's precompilation (torch.compile(...)"
            f".aot_compile and torch.compiler.load_compiled_function), which torch "
            f"{torch.__version__} lacks: install torch 2.13 or later, or pass compile=False"
        )
    if isinstance(compile, bool):
        return compile
    env = envs.choice(COMPILE_ENV)
    on = env == "1" if env else device.type == "cpu" and not experts
    on = on and precompilation_available()
    return "cached" if on and compile == "cached" else on


@functools.cache
def precompilation_available() -> bool:
    """This torch can save and load a compiled forward (:mod:`asyncllm.worker.compiled`
    builds one with ``torch.compile(...).aot_compile`` and reads it back with
    ``torch.compiler.load_compiled_function``; torch 2.11 has neither). Wrapping a function
    in ``torch.compile`` compiles nothing until it is called."""
    wrapped = torch.compile(lambda x: x)
    return hasattr(wrapped, "aot_compile") and hasattr(torch.compiler, "load_compiled_function")


def set_cpu_threads(device: torch.device, num_threads: int | None) -> None:
    """On CPU, set torch's intra-op thread count for the calling thread's work
    (``EngineConfig.num_threads``; None: :func:`default_num_threads`). Call it on the
    engine's compute thread (see ``LLMEngine.from_config`` for why one thread)."""
    if device.type == "cpu":
        torch.set_num_threads(num_threads or default_num_threads())


def trim_host_memory() -> int:
    """Hand the C heap's free pages back to the OS: glibc's ``malloc_trim(0)`` (every
    arena, not only the top of the main heap). Loading a model and compiling its forward
    free a lot of transient memory (conversions, packing, Inductor) that glibc otherwise
    keeps mapped: with the default model, 118 MiB of an engine's 817 MiB resident after
    start. Returns 1 when memory was released, 0 when none was or the C library has no
    ``malloc_trim`` (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return 0
    return int(trim(0))
