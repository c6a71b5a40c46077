"""The instruction-set variants asyncllm's C++ CPU kernels are built in, and the kernel
families each variant holds: one table read by ``setup.py`` (at install, which builds every
variant of this machine's architecture) and by :mod:`asyncllm.kernels.native` (at run time,
which imports the best variant the CPU runs). No imports: ``setup.py`` loads this file by
path, before torch or asyncllm can be imported.

Variants, as llama.cpp builds its CPU backends (one build runs on every CPU of a kind):

* ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI2): every x86-64 server CPU since 2015.
* ``avx512_bf16``: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) with AVX-512 BF16, VBMI and VNNI: AMD
  Zen 4/5, Intel Cooper Lake and Sapphire Rapids onwards. AMX is used through oneDNN's
  brgemm, which torch dispatches at run time, so it needs no variant of its own.
* ``generic``: other architectures (aarch64...): the compiler's defaults, no ``-march``.

A variant is chosen at run time by the CPU's feature flags (``/proc/cpuinfo`` names).
"""

from __future__ import annotations

#: Variant -> (architecture, compiler flags, CPU flags it needs), best last.
VARIANTS: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {
    "avx2": (
        "x86_64",
        ("-march=x86-64-v3", "-mtune=generic"),
        frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}),
    ),
    "avx512_bf16": (
        "x86_64",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi", "-mavx512vnni", "-mtune=generic"),
        frozenset(
            {
                "avx2",
                "fma",
                "f16c",
                "bmi2",
                "movbe",
                "avx512f",
                "avx512bw",
                "avx512cd",
                "avx512dq",
                "avx512vl",
                "avx512_bf16",
                "avx512vbmi",
                "avx512_vnni",
            }
        ),
    ),
    "generic": ("other", (), frozenset()),
}

#: Kernel family -> (C++ sources under ``csrc/``, compiler flags of its own). Each family is
#: its own extension module per variant, ``asyncllm._kernels._<family>_<variant>``.
#: -ffast-math (attention): GCC vectorizes expf through glibc's libmvec and reassociates the
#: sums (the kernel keeps every value finite: the running max starts at -1e30, not -inf).
#: -ffast-math (decoder): the SiLU's exp vectorized through libmvec, as the attention's.
#: -ffp-contract=off (int4): no fused multiply-add, so dequantized values equal torch's float32
#: arithmetic bit for bit.
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attention": (("paged_attention.cpp",), ("-ffast-math",)),
    "int4": (("int4_linear.cpp", "int4_gemv.cpp", "int4_gemv_f32.cpp"), ("-ffp-contract=off",)),
    "q8": (("q8_linear.cpp",), ()),
    "decoder": (("decoder_layer.cpp",), ("-ffast-math",)),
}

#: Flags of every kernel. -g0: Python's own CFLAGS ask for debug info, which made the build
#: markedly slower (torch's headers are large; docs/kernels.md has the times) for symbols no
#: user reads.
COMMON_FLAGS = ("-O3", "-g0", "-fopenmp")


def module_name(family: str, variant: str) -> str:
    """The extension module of one family in one variant, e.g. ``_int4_avx2``."""
    return f"_{family}_{variant}"


def variants_for(machine: str) -> list[str]:
    """The variants built on an architecture (``platform.machine()``), worst first."""
    arch = "x86_64" if machine in ("x86_64", "AMD64", "amd64") else "other"
    return [name for name, (a, _, _) in VARIANTS.items() if a == arch]
