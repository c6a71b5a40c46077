"""The package's layering: no import cycles between modules nor between folders, and a
torch-free core and front end.

The core (``asyncllm.core``: scheduler, block manager) is pure Python; the async front end
(``asyncllm.engine`` but the engine core ``llm_engine``, its ``asyncllm.tool_calling`` and
``asyncllm.output_processing``, and the plain-data modules it shares with callers) must not
load torch either: it runs on the event loop and owns no model state (docs/architecture.md).
Only the engine core and the worker import torch.

Folders depend one way (docs/architecture.md): counting every import, at any depth (inside
functions, under ``if TYPE_CHECKING``), the graph of the package's folders has no cycle, and
the folders under the worker (``kernels``, ``layers``, ``attention``) import none of the
folders above them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncllm"

#: The folders whose every module is torch-free (asyncllm.engine's but ENGINE_CORE).
TORCH_FREE_FOLDERS = (
    "asyncllm.core",
    "asyncllm.engine",
    "asyncllm.tool_calling",
    "asyncllm.output_processing",
)
#: Front-end and plain-data modules besides those of TORCH_FREE_FOLDERS.
TORCH_FREE_EXTRA = [
    "asyncllm",
    "asyncllm.config",
    "asyncllm.cache_dirs",
    "asyncllm.config_args",
    "asyncllm.preflight",
    "asyncllm.chat_templates",
    "asyncllm.errors",
    "asyncllm.outputs",
    "asyncllm.sampling_params",
    "asyncllm.llm",
    "asyncllm.server",
    "asyncllm.worker.runner_output",
]
#: Modules of asyncllm.engine that build and run the model (they import torch).
ENGINE_CORE = {"asyncllm.engine.llm_engine"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: module level, in classes, ``if``
    (but ``if TYPE_CHECKING``), ``try`` and ``with`` blocks; not inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _import_nodes(node.body)
            found += _import_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += _import_nodes(block)
            for handler in node.handlers:
                found += _import_nodes(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found += _import_nodes(node.body)
    return found


def _imports(name: str, *, any_depth: bool = False) -> set[str]:
    """The package modules ``name`` imports at import time, or with ``any_depth`` anywhere
    in its source (function bodies and ``if TYPE_CHECKING`` blocks too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    if any_depth:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        nodes = _import_nodes(tree.body)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # "from pkg import sub" imports the submodule (its package's __init__ runs first,
            # as for every import of a submodule; implicit parent imports are not edges).
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in MODULES]
            if len(targets) < len(subs):  # names defined by the module itself
                targets.append(base)
        out.update(t for t in targets if t in MODULES and t != name)
    return out


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_import_graph_has_no_cycles() -> None:
    graph = {name: _imports(name) for name in MODULES}
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _folder(module: str) -> str:
    """The folder a module belongs to: ``asyncllm.worker.sampling.sampler`` -> ``worker`` (a
    sub-package is its folder's); a module at the package's top (``asyncllm.config``) is its
    own node, the package itself ``asyncllm``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "asyncllm"


def _folder_graph(*, any_depth: bool = True) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {_folder(m): set() for m in MODULES}
    for name in MODULES:
        graph[_folder(name)] |= {_folder(t) for t in _imports(name, any_depth=any_depth)}
    return {folder: deps - {folder} for folder, deps in graph.items()}


#: What the folders under the worker may import from the package: the kernels know nothing
#: of the layers and attention backends that call them, and none of them knows the worker,
#: the models, the engine or the server.
BELOW_THE_WORKER = {
    "kernels": {"envs", "errors"},
    "layers": {"kernels", "envs", "errors"},
    "attention": {"kernels", "envs", "errors"},
}


def test_the_folder_import_graph_has_no_cycles() -> None:
    """Counting every import (inside functions too: a function-level import hides a cycle
    from the interpreter, not from a reader), the folders depend one way."""
    graph = _folder_graph()
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_the_folder_graph_counts_imports_inside_functions() -> None:
    """The check above sees deeper than import time: some folder edges exist only through
    imports inside functions (e.g. the engine core's lazy imports)."""
    deep, shallow = _folder_graph(), _folder_graph(any_depth=False)
    assert all(shallow[f] <= deep[f] for f in shallow)
    assert any(deep[f] - shallow[f] for f in deep)


def test_the_folders_under_the_worker_import_only_below_them() -> None:
    graph = _folder_graph()
    over = {f: graph[f] - allowed for f, allowed in BELOW_THE_WORKER.items() if graph[f] - allowed}
    assert over == {}


def _torch_free_modules() -> list[str]:
    inside = [
        m for m in MODULES
        if m.startswith(TORCH_FREE_FOLDERS) and m not in ENGINE_CORE
    ]  # fmt: skip
    return sorted(inside) + TORCH_FREE_EXTRA


def test_core_and_front_end_do_not_import_torch() -> None:
    """In a fresh interpreter, importing each core and front-end module (one after the
    other) leaves torch unloaded; the first module that loads it is named."""
    code = (
        "import importlib, sys\n"
        f"for m in {_torch_free_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(m); break\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {out.stdout.strip()} loads torch"


def test_the_engine_core_does_import_torch() -> None:
    """The check above can fail: the engine core does load torch."""
    code = "import sys, asyncllm.engine.llm_engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


#: The most modules (``.py`` files other than ``__init__.py``) one folder holds (issue 37:
#: "no folder over ~12 modules"): a folder that grows past it is split by job into
#: well-named folders or sub-packages.
MAX_FOLDER_MODULES = 12


def test_no_folder_holds_too_many_modules() -> None:
    sizes = {
        str(folder.relative_to(PACKAGE.parent)): n
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := sum(p.name != "__init__.py" for p in folder.glob("*.py"))) > MAX_FOLDER_MODULES
    }
    assert sizes == {}
