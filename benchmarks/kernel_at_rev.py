"""A C++ kernel family as a git revision has it, built here, for the old-against-new
benchmarks (``attention_kernel.py``, ``int4_many_rows.py``, ``kv_huge_pages.py``).

"New" is this checkout's installed module (``asyncllm._kernels._<family>_<variant>``, built by
``setup.py``: after editing ``csrc/``, ``python setup.py build_ext --inplace`` first). "Old" is
the source at a git revision, compiled by this script with ``torch.utils.cpp_extension`` (g++
and ninja, tens of seconds the first time; kept under asyncllm's cache directory in a folder
keyed by the source, the flags and torch) into a module of its own, its op kernels never
registered over the engine's:

* a revision with ``csrc/``: the family's files there (``asyncllm/kernels/variants.py``,
  before that ``asyncllm/_kernels/variants.py``, at that revision names them), and for
  ``int4`` the op ``asyncllm_old::int4_linear`` bound to that revision's ``int4_linear``;
* an older one: the C++ its Python modules held (``asyncllm/attention/cpu_paged.cpp`` or
  ``cpu_paged.py``'s ``_SOURCE``; ``int4_dequant.py``'s ``_SOURCE`` and ``int4_gemv.cpp``, its
  op renamed ``asyncllm_old::int4_linear``), with ``cpu_extension.py``'s
  ``BRGEMM_BF16_SOURCE`` in front where it calls ``brgemm_bf16_runs()``.

Both are compiled with the flags of the variant named (``native``: the one the engine loads).
"""

from __future__ import annotations

import ast
import hashlib
import pathlib
import subprocess
from typing import Any

import torch

from asyncllm.kernels import native
from asyncllm.kernels.variants import COMMON_FLAGS, FAMILIES, VARIANTS

#: The ``--isa`` choices: the variant the engine loads, or one named.
ISAS = ["native", *VARIANTS]

#: Binds a ``csrc/`` revision's ``int4_linear`` to an op of its own namespace.
_INT4_OLD_OP = pathlib.Path(__file__).with_name("int4_old_op.cpp").read_text()


def variant_of(family: str, isa: str) -> str:
    """The variant ``isa`` names (``native``: the one the engine loads for ``family``)."""
    if isa != "native":
        return isa
    mod = native.module(family)
    if mod is None:
        raise SystemExit(f"this checkout's {family} kernels are unavailable: "
                         f"{native.failure(family) or 'switched off'}")  # fmt: skip
    return str(mod.__name__).rpartition(".")[2].removeprefix(f"_{family}_")


def new_module(family: str, isa: str) -> Any:
    """This checkout's installed module of ``family`` in variant ``isa``."""
    if isa == "native":
        variant_of(family, isa)  # exits where it is unavailable
        return native.module(family)
    try:
        return native.import_variant(family, isa)
    except ImportError as e:
        raise SystemExit(f"the {isa} variant of {family} is not installed: {e}") from e


def show(rev: str, path: str) -> str | None:
    """``path`` at ``rev``, or None where it is not there."""
    cmd = ["git", "show", f"{rev}:{path}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _literal(text: str, name: str) -> str:
    """The string literal assigned to ``name`` at module level of Python ``text``."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return str(ast.literal_eval(node.value))
    raise ValueError(f"no {name} literal")


def _flags(family: str, isa: str) -> list[str]:
    return [*COMMON_FLAGS, *VARIANTS[variant_of(family, isa)][1], *FAMILIES[family][1]]


def _build_dir(name: str, parts: list[str]):  # type: ignore[no-untyped-def]
    from asyncllm.cache_dirs import cache_dir

    key = hashlib.sha256("\0".join([*parts, torch.__version__]).encode()).hexdigest()[:12]
    d = cache_dir() / "bench-kernels" / f"{name}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d, key


def _csrc_files(rev: str, family: str) -> dict[str, str] | None:
    """The C++ files of ``family`` at ``rev`` (sources first, then every header), or None
    for a revision without ``csrc/``."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "csrc/"], capture_output=True, text=True
    )
    names = [n.removeprefix("csrc/") for n in listing.stdout.split()]
    if listing.returncode != 0 or not names:
        return None
    table = show(rev, "asyncllm/kernels/variants.py") or show(rev, "asyncllm/_kernels/variants.py")
    scope: dict[str, Any] = {}
    if table is not None:
        exec(compile(table, "variants_old.py", "exec"), scope)  # our own table, at a rev
    sources = scope.get("FAMILIES", FAMILIES)[family][0]
    headers = [n for n in names if n.endswith((".h", ".hpp"))]
    return {n: show(rev, f"csrc/{n}") or "" for n in [*sources, *headers]}


def _legacy_source(rev: str, family: str) -> tuple[str, list[str]]:
    """The C++ of ``family`` at a revision before ``csrc/``, and the functions to bind."""
    if family == "attention":
        cpp = show(rev, "asyncllm/attention/cpu_paged.cpp")
        if cpp is None:
            py = show(rev, "asyncllm/attention/cpu_paged.py")
            if py is None:
                raise SystemExit(f"no attention kernel at {rev}")
            cpp = _literal(py, "_SOURCE")
        functions = ["paged_decode"]
    elif family == "int4":
        py = show(rev, "asyncllm/kernels/int4_dequant.py") or show(
            rev, "asyncllm/worker/int4_dequant.py"
        )
        if py is None:
            raise SystemExit(f"no int4 kernel at {rev}")
        cpp = _literal(py, "_SOURCE") + (show(rev, "asyncllm/worker/int4_gemv.cpp") or "")
        cpp = cpp.replace("(asyncllm_cpu, m)", "(asyncllm_old, m)")  # its op library
        functions = ["int4_dequant_t"]
    else:
        raise SystemExit(f"no old {family} kernel to build")
    if "brgemm_bf16_runs()" in cpp and "bool brgemm_bf16_runs()" not in cpp:
        ext = show(rev, "asyncllm/worker/cpu_extension.py")
        cpp = (_literal(ext, "BRGEMM_BF16_SOURCE") if ext else "") + cpp
    return cpp, functions


def old_module(family: str, rev: str, isa: str) -> Any:
    """``family``'s kernel module as ``rev`` has it, built with variant ``isa``'s flags (for
    ``int4`` its op is ``torch.ops.asyncllm_old.int4_linear``)."""
    from torch.utils import cpp_extension

    flags = _flags(family, isa)
    files = _csrc_files(rev, family)
    if files is not None:
        if family == "int4":
            files["asyncllm_old_op.cpp"] = _INT4_OLD_OP
        d, key = _build_dir(f"{family}-csrc", [*flags, *files, *files.values()])
        src = d / "src"
        src.mkdir(exist_ok=True)
        for n, text in files.items():
            if not (src / n).is_file() or (src / n).read_text() != text:
                (src / n).write_text(text)
        sources = [str(src / n) for n in files if n.endswith((".cpp", ".cc"))]
        return cpp_extension.load(  # type: ignore[no-untyped-call]
            name=f"asyncllm_old_{family}_{key}",
            sources=sources,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(src)],
            build_directory=str(d),
        )
    cpp, functions = _legacy_source(rev, family)
    d, key = _build_dir(f"{family}-legacy", [*flags, cpp, *functions])
    return cpp_extension.load_inline(  # type: ignore[no-untyped-call]
        name=f"asyncllm_old_{family}_{key}",
        cpp_sources=[cpp],
        functions=functions,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(d),
    )
