"""Builds asyncllm's C++ CPU kernels (``csrc/``) when the package is installed.

The variants of ``asyncllm/kernels/variants.py`` that this machine's CPU runs are compiled
(one extension module per kernel family and variant; an AVX-512 BF16 machine builds the
AVX2 variant too, which the tests compare against), against the torch in the build
environment, so install with that torch present and without build isolation::

    pip install torch==2.13.0 && pip install --no-build-isolation -e .

The build is optional: where torch is missing from the build environment, no C++ compiler
is found, or a compile fails, the package installs without the kernels (one warning here, one
at start) and runs on torch's own paths. ``ASYNCLLM_BUILD_VARIANTS=all`` builds every
variant of the architecture (a wheel for other CPUs of the kind), ``avx2,...`` those named;
``ASYNCLLM_BUILD_KERNELS=0`` none.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import platform
import sys
import threading

from setuptools import setup

ROOT = pathlib.Path(__file__).resolve().parent


def _variants_table():
    spec = importlib.util.spec_from_file_location(
        "asyncllm_variants", ROOT / "asyncllm" / "kernels" / "variants.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _warn(msg: str) -> None:
    print(
        f"asyncllm: {msg}; the package installs without its C++ CPU kernels "
        "(torch's paths run instead)",
        file=sys.stderr,
    )


def _last_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else type(e).__name__


def _cpu_flags() -> frozenset[str]:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty elsewhere: the generic variant)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _extensions():
    if os.environ.get("ASYNCLLM_BUILD_KERNELS", "1").strip().lower() in ("0", "false", "no"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _warn(
            "torch is not importable in the build environment (install torch first, then "
            "`pip install --no-build-isolation`)"
        )
        return [], {}
    table = _variants_table()
    wanted = os.environ.get("ASYNCLLM_BUILD_VARIANTS", "").strip()
    variants = table.variants_for(platform.machine())
    if not wanted:  # what this CPU runs
        flags = _cpu_flags()
        variants = [v for v in variants if table.VARIANTS[v][2] <= flags]
    elif wanted != "all":
        variants = [v for v in variants if v in {w.strip() for w in wanted.split(",")}]
    exts = []
    for variant in variants:
        _, arch_flags, _ = table.VARIANTS[variant]
        for family, (sources, flags) in table.FAMILIES.items():
            exts.append(
                CppExtension(
                    name=f"asyncllm._kernels.{table.module_name(family, variant)}",
                    sources=[f"csrc/{s}" for s in sources],
                    include_dirs=[str(ROOT / "csrc")],
                    depends=["csrc/common.h", "csrc/python_module.h"],
                    extra_compile_args=[*table.COMMON_FLAGS, *arch_flags, *flags],
                    extra_link_args=["-fopenmp"],
                )
            )

    class OptionalBuild(BuildExtension):
        """Builds the kernel modules side by side (one per core, ``self.parallel``), each in
        a temp folder of its own: torch's ninja build writes one build.ninja per temp folder,
        and variants compile the same sources with other flags. ``build_temp`` is therefore
        per thread (setuptools runs ``build_extension`` in a thread pool). A failure warns
        and installs without that module."""

        _local = threading.local()

        @property  # type: ignore[override]
        def build_temp(self) -> str:
            return getattr(self._local, "build_temp", None) or self._build_temp

        @build_temp.setter
        def build_temp(self, value: str) -> None:
            self._build_temp = value

        def finalize_options(self) -> None:
            super().finalize_options()
            self.parallel = max(1, min(len(self.extensions), os.cpu_count() or 1))

        def build_extensions(self) -> None:
            self.failed: set[str] = set()
            try:
                super().build_extensions()
            except Exception as e:  # torch's compiler checks: no usable compiler at all
                _warn(f"no C++ kernel was built ({_last_line(e)})")
                self.failed = {ext.name for ext in self.extensions}
            # What did not build is not an output (the install goes on without it).
            self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

        def build_extension(self, ext) -> None:
            self._local.build_temp = os.path.join(self._build_temp, ext.name)
            try:
                super().build_extension(ext)
            except Exception as e:  # a compile error: torch's paths instead
                _warn(f"{ext.name} did not build ({_last_line(e)})")
                self.failed.add(ext.name)
            finally:
                self._local.build_temp = None

    return exts, {"build_ext": OptionalBuild.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
