"""The package stays readable: no module over 600 lines, no function over 80 (issue 15).

A Triton kernel's argument lists do not count: the signature of a function in
``asyncllm/kernels`` and the arguments of a kernel launch (``kernel[grid](...)``) are
long lists of strides and constexprs that a reader skims.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "asyncllm"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _launch_argument_lines(fn: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            for arg in [*node.args, *node.keywords]:
                assert arg.end_lineno is not None
                lines.update(range(arg.lineno, arg.end_lineno + 1))
    return lines


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, kernel_module: bool) -> int:
    """Lines of ``fn``; in a kernel module, without its signature and launch arguments."""
    assert fn.end_lineno is not None
    lines = set(range(fn.lineno, fn.end_lineno + 1))
    if kernel_module:
        lines -= set(range(fn.lineno, fn.body[0].lineno))
        lines -= _launch_argument_lines(fn)
    return len(lines)


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_over_the_line_limit() -> None:
    long = {}
    for p in _modules():
        kernel_module = p.parent.name == "kernels"
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = function_lines(node, kernel_module)
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert long == {}


def test_the_counter_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (fn,) = ast.parse(f"def f():\n{body}\n").body
    assert isinstance(fn, ast.FunctionDef)
    assert function_lines(fn, kernel_module=False) == MAX_FUNCTION_LINES + 1
    launch = "def k(\n    a,\n    b,\n):\n    kernel[(1,)](\n        a,\n        b,\n    )\n"
    (fn,) = ast.parse(launch).body
    assert isinstance(fn, ast.FunctionDef)
    assert function_lines(fn, kernel_module=True) == 2
