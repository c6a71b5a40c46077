"""docs/architecture.md is the newcomer's map: its folder table names every package module
(``asyncllm/**/*.py`` but ``__init__.py`` files and the built extensions of ``_kernels/``),
and its rows are in import order (a row imports only the rows below it, or modules of its
own folder), so the table stays true as the code moves."""

from __future__ import annotations

import re
from pathlib import Path

from tests.project.test_import_graph import MODULES, _folder, _imports

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
_PATH = re.compile(r"`(?:asyncllm/)?([\w/]+\.py)`")


def _table_rows(text: str) -> list[set[str]]:
    """Per row of the folder table, top to bottom, the modules its ``files`` cell names."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|")
        if not line.startswith("| ") or len(cells) < 4 or cells[1].strip() == "layer":
            continue
        named = (p.removesuffix(".py").removesuffix("/__init__") for p in _PATH.findall(cells[2]))
        rows.append({"asyncllm." + p.replace("/", ".") for p in named})
    return rows


def _mapped_modules() -> list[str]:
    return sorted(
        m
        for m, path in MODULES.items()
        if path.name != "__init__.py" and path.parent.name != "_kernels"
    )


def _unnamed(text: str) -> list[str]:
    named = set().union(*_table_rows(text))
    return [m for m in _mapped_modules() if m not in named]


def test_every_package_module_is_named() -> None:
    assert _unnamed(DOC.read_text()) == []


def test_a_module_left_out_is_found() -> None:
    text = DOC.read_text().replace("`worker/sampling/sampler.py`", "the sampler")
    assert _unnamed(text) == ["asyncllm.worker.sampling.sampler"]


def test_the_rows_import_only_rows_below_them() -> None:
    row = {}
    for i, modules in enumerate(_table_rows(DOC.read_text())):
        for m in modules:
            row.setdefault(m, i)
    upward = [
        f"{m} -> {t}"
        for m in row
        if m in MODULES
        for t in _imports(m, any_depth=True)
        if t in row and row[t] < row[m] and _folder(t) != _folder(m)
    ]
    assert upward == []
