"""pyproject.toml declares what asyncllm imports, and only that (issue 15)."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Distribution name -> the module it is imported as, where they differ.
MODULE_OF = {"prometheus-client": "prometheus_client", "ray[serve]": "ray"}
#: Declared but not imported, and why.
NOT_IMPORTED: dict[str, str] = {}
#: Imported but run only in the benchmark's peer processes, from venvs of their own.
PEER_ONLY = {"vllm", "llama_cpp"}


def _names(requirements: list[str]) -> set[str]:
    out = set()
    for req in requirements:
        name = re.split(r"[<>=;!~ ]", req, maxsplit=1)[0].strip().lower()
        out.add(MODULE_OF.get(name, name.replace("-", "_")))
    return out


def _imports(stdlib: bool = False) -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package (lazy imports included), each with
    the subpackages that import it: third-party ones, or with ``stdlib`` the standard
    library's."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "asyncllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top != "asyncllm" and (top in sys.stdlib_module_names) == stdlib:
                    found.setdefault(top, set()).add(path.relative_to(ROOT).parts[1])
    return found


def test_dependencies_are_what_the_package_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items() if k != "dev"}
    imported = _imports()
    optional = set().union(*extras.values())
    # the harness's own modules, imported by bare name where a peer's venv runs
    # bench/engine_process.py by path (no asyncllm there)
    by_path = {f.stem for f in (ROOT / "asyncllm" / "bench").glob("*.py")}
    undeclared = set(imported) - required - optional - PEER_ONLY - by_path
    assert not undeclared, f"imported but not declared: {sorted(undeclared)}"
    unused = required - set(imported) - set(NOT_IMPORTED)
    assert not unused, f"declared but never imported: {sorted(unused)}"


def test_no_platform_specific_file_lock():
    """The conversion cache's lock is filelock's (portable), not fcntl's (POSIX only)."""
    assert "fcntl" not in _imports(stdlib=True)


def test_cpu_engine_runs_without_triton(tiny_llama_dir):
    """Triton is the ``gpu`` extra's: a CPU install has none. With ``import triton`` failing
    (as when it is not installed), the engine loads, picks the CPU attention backend and
    generates; torch._dynamo (the compiled forward's loader) imports without it."""
    import subprocess

    code = f"""
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as without the package
import torch._dynamo
from asyncllm import LLM, SamplingParams
with LLM({str(tiny_llama_dir)!r}, compile=False, kv_cache_bytes=4 * 2**20) as llm:
    out = llm.generate([[5, 9, 200]], SamplingParams(max_tokens=3, temperature=0.0,
                       ignore_eos=True), use_tqdm=False)
    print(llm.engine.core.runner.attention_backend.name, len(out[0].token_ids))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] in (["cpu", "3"], ["torch", "3"])
