"""Build-once, import-fast C++ CPU extensions (the attention, int4 and Q8_0 kernels).

Each kernel is C++ source compiled with ``torch.utils.cpp_extension.load_inline`` (g++ and
ninja; 20-30 s each on 2 cores, once per machine). The build is kept under asyncllm's cache
directory (:func:`asyncllm.models.loader.cache_dir`), in a folder keyed by the source, the
flags, torch, Python and the machine, so a change of any rebuilds it and later processes find
the ``.so`` and import it in milliseconds, without calling the compiler. Where it cannot be
built (no compiler, no ninja, no headers...) or its switch variable is ``0``,
:meth:`CpuExtension.load` returns None and the caller keeps its torch path; the reason is
logged once.

An engine never waits for a build: its steps ask :meth:`CpuExtension.ready`, which imports a
built kernel at once or starts the build in a background process (``nice`` 10, so that it
yields the cores to the steps) and answers None until it is done; the steps run the torch
path meanwhile (a fresh machine's first answer in seconds instead of ~70 s of compiling).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from filelock import FileLock

logger = logging.getLogger("asyncllm")

__all__ = ["BRGEMM_BF16_SOURCE", "CpuExtension", "wait_for_builds"]

#: C++ for the extensions that multiply with oneDNN's bfloat16 brgemm micro-kernel
#: (``at::native::cpublas::brgemm``, B in the VNNI layout ``[K / 2][N][2]``):
#: ``brgemm_bf16_runs()``, whether it runs here at native speed. torch's ``could_pack`` says
#: AMX only, yet brgemm also runs on AVX-512 BF16 (``vdpbf16ps``): on a 2-core AMD EPYC
#: (Zen 5, no AMX) 64 x 64 x 576 ran at ~250 GFLOP/s per thread, 1.3x torch.mm's bfloat16.
#: Native bfloat16 is a compile-time fact (the extensions are built with ``-march=native``);
#: one small product, checked against exact values, tells that the call works.
BRGEMM_BF16_SOURCE = r"""
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <vector>
static bool brgemm_bf16_runs() {
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
  static const bool ok = [] {
    try {
      constexpr int64_t M = 2, N = 16, K = 32;  // A[m][k] = m + 1, B[k][n] = n: C = 32 (m+1) n
      std::vector<at::BFloat16> a(M * K), b(K * N);
      for (int64_t i = 0; i < M * K; ++i) a[i] = at::BFloat16(static_cast<float>(i / K + 1));
      for (int64_t i = 0; i < K * N; ++i) b[i] = at::BFloat16(static_cast<float>(i / 2 % N));
      std::vector<float> c(M * N);
      at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release();
      for (int64_t i = 0; i < M * N; ++i)
        if (c[i] != 32.0f * static_cast<float>(i / N + 1) * static_cast<float>(i % N)) return false;
      return true;
    } catch (...) {
      return false;
    }
  }();
  return ok;
#else
  return false;
#endif
}
"""


class CpuExtension:
    """One C++ extension built on first use and cached on disk.

    Args:
        name: the extension's module name (also names its build folder).
        source: the C++ source (``#include <torch/extension.h>`` and the functions).
        functions: the functions to bind.
        cflags: compiler flags (``-fopenmp`` among them links OpenMP too).
        what: a few words naming the kernel in log lines ("CPU attention kernel").
        env_switch: an environment variable that turns the kernel off when ``0``/``false``/
            ``no``/``off`` (read on every :meth:`enabled` call).
    """

    def __init__(
        self,
        name: str,
        source: str,
        functions: Sequence[str],
        cflags: Sequence[str],
        what: str,
        env_switch: str,
    ) -> None:
        self.name, self.source, self.what, self.env_switch = name, source, what, env_switch
        self.functions, self.cflags = list(functions), list(cflags)
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    def enabled(self) -> bool:
        """Not switched off with ``<env_switch>=0``."""
        flag = os.environ.get(self.env_switch, "1").strip().lower()
        return flag not in ("0", "false", "no", "off")

    def build_dir(self) -> pathlib.Path:
        """Where the kernel is built: asyncllm's cache, keyed by the source, the bound
        functions, the flags, torch, Python, the machine and (``-march=native``) the CPU's
        feature flags (a change of any rebuilds it)."""
        from asyncllm.models.loader import cache_dir
        from asyncllm.worker.device import cpu_flags

        parts = [self.source, *self.functions, *self.cflags, torch.__version__, sys.version]
        parts.append(platform.machine())
        if "-march=native" in self.cflags:  # built for this CPU: not another's (a copied cache)
            parts.append(" ".join(sorted(cpu_flags())))
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        return cache_dir() / "kernels" / f"{self.name.removeprefix('asyncllm_')}-{key}"

    def load(self) -> Any:
        """The compiled extension, building it on first use (or waiting for the background
        build that :meth:`start` began); None where it cannot be built (the reason is logged
        once and kept in :meth:`failure`). Thread-safe."""
        if self._module is not None or self._failed is not None:
            return self._module
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            if self._module is not None or self._failed is not None:
                return self._module
            try:
                self._module = self._import_or_none() or self._build()
            except Exception as e:  # no compiler, no ninja, no headers...
                self._fail(e)
        return self._module

    def _fail(self, e: Exception) -> None:
        lines = str(e).strip().splitlines()
        self._failed = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        logger.warning("asyncllm: %s unavailable, using torch (%s)", self.what, self._failed)

    def ready(self) -> Any:
        """The extension if it can be used now, else None, never waiting: a built one is
        imported (milliseconds), a missing one starts building in the background
        (:meth:`start`) and is returned by a later call once done. For the hot paths, which
        run their torch path while this is None."""
        if self._module is None and self._failed is None:
            self.start()
        return self._module

    def expected(self) -> bool:
        """Whether the kernel is, or is likely to become, available: enabled, not failed, and
        built already or a C++ compiler (``$CXX``, else ``c++``) and ninja found to build it
        (then the build starts in the background: :meth:`start`). For choices made once at
        load time (a weight layout) that the kernel's arrival should not invalidate."""
        if not self.enabled() or self._failed is not None:
            return False
        if self._module is None and not _toolchain():
            return False
        self.start()
        return self._failed is None

    def start(self) -> None:
        """Import the built extension, or start building it in a child process on a background
        thread; returns at once (while :meth:`load` holds the lock, without doing either)."""
        if self._module is not None or self._failed is not None or self._thread is not None:
            return
        if not self.enabled() or not self._lock.acquire(blocking=False):
            return
        try:
            if self._module is None and self._failed is None and self._thread is None:
                self._module = self._import_or_none()
                if self._module is None and not _toolchain():
                    self._fail(RuntimeError("no C++ compiler ($CXX, else c++) or no ninja found"))
                elif self._module is None:
                    self._thread = threading.Thread(
                        target=self._build_in_background, name=f"{self.name}-build", daemon=True
                    )
                    _STARTED.append(self)
                    self._thread.start()
        finally:
            self._lock.release()

    def _build_in_background(self) -> None:
        started = time.monotonic()
        logger.info(
            "asyncllm: building the %s in the background (once per machine; the torch path "
            "serves meanwhile) in %s",
            self.what,
            self.build_dir(),
        )
        keys = ("name", "source", "functions", "cflags", "what", "env_switch")
        error = _run_build_process({k: getattr(self, k) for k in keys})
        # Imports what the child built; where it failed, its reason (no second build here,
        # at the engine's priority: the next process tries again).
        with self._lock:
            if self._module is None and self._failed is None:
                try:
                    if error is None or error.startswith("OSError"):  # no child: build here
                        self._module = self._import_built() or self._build()
                    else:
                        self._module = self._import_built()
                        if self._module is None:
                            raise RuntimeError(error)
                except Exception as e:
                    self._fail(e)
        if self._module is not None:
            logger.info("asyncllm: %s ready after %.1f s", self.what, time.monotonic() - started)

    def _import_or_none(self) -> Any:
        try:
            return self._import_built()
        except Exception:  # a truncated .so (a build killed while linking): build again
            return None

    def failure(self) -> str | None:
        """Why the kernel could not be built, or None."""
        return self._failed

    def available(self) -> bool:
        """The kernel is enabled and builds (building it now if needed)."""
        return self.enabled() and self.load() is not None

    def _import_built(self) -> Any:
        """The already built extension (a plain import, milliseconds), or None."""
        so = self.build_dir() / f"{self.name}.so"
        if not so.is_file():
            return None
        spec = importlib.util.spec_from_file_location(self.name, so)
        if spec is None or spec.loader is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def _build(self) -> Any:
        """Build and import the extension. Builders of one folder take turns on an OS lock
        (``filelock``: released when its holder dies, however it dies), under which torch's
        own lock file (``lock``, which a builder killed mid-build leaves behind, and on
        which every later build would wait forever) can only be stale, and is removed."""
        from torch.utils.cpp_extension import load_inline

        if not _toolchain():
            raise RuntimeError("no C++ compiler ($CXX, else c++) or no ninja found")
        d = self.build_dir()
        d.mkdir(parents=True, exist_ok=True)
        logger.info("asyncllm: building the %s once (about a minute) in %s", self.what, d)
        with FileLock(d / "asyncllm-build.lock"):
            (d / "lock").unlink(missing_ok=True)
            return load_inline(  # type: ignore[no-untyped-call]
                name=self.name,
                cpp_sources=[self.source],
                functions=self.functions,
                extra_cflags=self.cflags,
                extra_ldflags=["-fopenmp"] if "-fopenmp" in self.cflags else [],
                build_directory=str(d),
                verbose=False,
            )


#: Extensions whose background build :meth:`CpuExtension.start` began, in order.
_STARTED: list[CpuExtension] = []


def wait_for_builds(stop: Callable[[], bool] | None = None) -> bool:
    """Block until every background build started so far ended (built or failed): before
    tracing or loading a compiled forward, whose graph takes the kernels that are there.

    Returns:
        True; False as soon as ``stop()`` turns true (its caller is closing), checked twice a
        second.
    """
    for ext in list(_STARTED):
        thread = ext._thread
        while thread is not None and thread.is_alive():
            if stop is not None and stop():
                return False
            thread.join(0.5)
        ext.load()
    return True


def _run_build_process(spec: dict[str, Any]) -> str | None:
    """Build the extension of ``spec`` (:class:`CpuExtension`'s arguments) in a child process
    and wait for it (the built module is then imported from the build folder).

    Returns:
        None once the child built it; else why not: its last line of error output, its exit
        status, or "OSError: ..." where no child could be started.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-m", "asyncllm.worker.cpu_extension"],
            input=json.dumps(spec).encode(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
        )
    except OSError as e:
        return f"OSError: {e}"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"the build process exited with status {done.returncode}"


def _toolchain() -> bool:
    """A C++ compiler and ninja, as ``torch.utils.cpp_extension`` looks for them."""
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


def _main() -> int:
    """The background build's child process: the extension's arguments as JSON on stdin;
    the reason of a failure as the last line on stderr."""
    os.nice(10)  # g++ yields the cores to the engine's steps
    ext = CpuExtension(**json.loads(sys.stdin.read()))
    if ext.load() is not None:
        return 0
    print(ext.failure(), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(_main())
