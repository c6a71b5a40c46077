"""Measurements live in docs/tuning.md and docs/benchmarks.md, not in the package's
docstrings and comments, where they go stale as the code changes (issue 37): no figure with
a unit of time (``ms``, ``us``), a speed ratio (``1.3x``) or a rate (``GB/s``,
``tokens/s``) in a docstring or comment under ``asyncllm/``. Strings the code uses (report
labels, messages) are not docstrings and may name units."""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "asyncllm"

MEASUREMENT = re.compile(
    r"\d(?:\.\d+)?\s?(?:ms|us|µs)\b"  # times
    r"|\d(?:\.\d+)?x\b"  # speed ratios: 1.3x, 4x
    r"|\d\s?(?:[GM]B|GFLOP|tokens?|steps?)/s\b"  # rates
)


def _docstring_lines(tree: ast.AST) -> dict[int, str]:
    """Line -> text of every docstring (module, class, function) and attribute docstring
    (a bare string statement)."""
    out: dict[int, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for i, line in enumerate(node.value.value.splitlines()):
                out[node.lineno + i] = line
    return out


def measured_lines(source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring or comment line of ``source`` that quotes a
    measurement."""
    lines = _docstring_lines(ast.parse(source))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] = tok.string
    return sorted((n, t.strip()) for n, t in lines.items() if MEASUREMENT.search(t))


def test_no_measurements_in_docstrings_or_comments() -> None:
    found = {
        f"{p.relative_to(PACKAGE)}:{n}": text
        for p in sorted(PACKAGE.rglob("*.py"))
        for n, text in measured_lines(p.read_text())
    }
    assert found == {}


def test_a_measurement_is_found() -> None:
    source = '"""Fast: 1.3x the old path."""\nx = 1  # 4 ms a step\ny = "12 ms"  # a label\n'
    assert [n for n, _ in measured_lines(source)] == [1, 2]
