"""Write docs/api.md, the API reference, from the docstrings of every public name.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 when docs/api.md is out of date

Covers every name in ``asyncllm.__all__`` and the server package (``asyncllm.server``: its
module docstring is the HTTP reference). Google-style sections (Args, Attributes, Raises,
Returns, Yields) become lists; ``::`` blocks become code blocks. tests/e2e/test_examples.py
checks that the file is current.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
sys.path.insert(0, str(ROOT))

SECTIONS = ("Args", "Attributes", "Raises", "Returns", "Yields", "Example", "Examples")
LISTED = ("Args", "Attributes", "Raises")
ORDER = [
    "AsyncEngine",
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "RequestMetrics",
    "Logprob",
    "EngineConfig",
]

HEADER = """# API reference

Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.

- [The Python API](#the-python-api): every name `import asyncllm` exports.
- [The OpenAI-compatible server](#the-openai-compatible-server): `asyncllm.server` and its
  HTTP endpoints.

See [quickstart.md](quickstart.md) for a first run and [concepts.md](concepts.md) for what
the engine does with a request.

# The Python API
"""


def _item_start(body: str) -> bool:
    return bool(re.match(r"^(\*{0,2}[\w.]+|[A-Z]\w*Error|\w+)( \([^)]*\))?:( |$)", body))


def render_doc(doc: str) -> str:
    """A Google-style docstring as Markdown."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    section: str | None = None
    code = False
    for line in lines:
        stripped = line.strip()
        if code:
            if stripped and not line.startswith("    "):
                out += ["```", ""]
                code = False
            else:
                out.append(line[4:] if line.startswith("    ") else line)
                continue
        head = stripped.rstrip(":")
        if not line.startswith(" ") and stripped.endswith(":") and head in SECTIONS:
            section = head
            out += ["", f"**{head}**", ""]
            if head.startswith("Example"):
                out.append("```python")
                code = True
            continue
        if section is not None and line.startswith("    "):
            body = line[4:]
            if section in LISTED and _item_start(body):
                name, _, rest = body.partition(":")
                out.append(f"- `{name.strip()}`:{rest}")
            elif section in LISTED and out and out[-1].startswith("- "):
                out[-1] += " " + body.strip()
            else:
                out.append(body.strip() if section not in LISTED else "  " + body.strip())
            continue
        if stripped:
            section = None
        if stripped.endswith("::"):
            out.append(line[:-1])
            out += ["", "```python"]
            code = True
            continue
        out.append(line)
    if code:
        out.append("```")
    # a blank line in a list section ends it
    text = "\n".join(out)
    text = re.sub(r"```python\n\n+", "```python\n", text)
    text = re.sub(r"\n+```\n", "\n```\n", text)
    return rst_to_md(text).strip() + "\n"


def rst_to_md(text: str) -> str:
    """Sphinx roles and double backticks as Markdown code spans (outside code blocks)."""
    parts = re.split(r"(```python\n.*?\n```)", text, flags=re.S)
    for i in range(0, len(parts), 2):
        t = re.sub(r":[a-z]+:`~[\w.]*?(\w+)`", r"`\1`", parts[i])
        t = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", t)
        parts[i] = t.replace("``", "`")
    text = "".join(parts)
    return re.sub(r"```python\n(?=(python|pip|curl) )", "```bash\n", text)


def _sig(obj: Any, name: str) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)  # string annotations, not defaults
    return f"{name}{sig}"


def _members(cls: type) -> list[tuple[str, Any]]:
    fields = set(getattr(cls, "__struct_fields__", ()))
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        func = value.fget if isinstance(value, property) else value
        func = getattr(func, "__func__", func)
        if not getattr(func, "__doc__", None):
            continue  # undocumented helpers (the server's route handlers) stay out
        if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
            out.append((name, value))
    return out


def document_class(qualname: str, cls: type, level: int = 2) -> str:
    h = "#" * level
    parts = []
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if issubclass(cls, BaseException):
        parts.append(f"{h} `{qualname}`\n\n*exception*, subclass of {', '.join(bases)}\n")
    else:
        init = cls if hasattr(cls, "__struct_fields__") else cls.__init__  # type: ignore[misc]
        signature = _sig(init, qualname).replace("(self, ", "(").replace("(self)", "()")
        parts.append(f"{h} `{qualname}`\n\n```python\n{signature}\n```\n")
    if cls.__doc__:
        parts.append(render_doc(cls.__doc__))
    for name, member in _members(cls):
        if isinstance(member, property):
            doc = member.fget.__doc__ if member.fget else None
            parts.append(f"{h}# `{qualname}.{name}` (property)\n")
        else:
            func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            doc = func.__doc__
            sig = _sig(func, f"{qualname}.{name}").replace("(self, ", "(")
            sig = sig.replace("(self)", "()").replace("(cls, ", "(")
            prefix = "async " if inspect.iscoroutinefunction(func) else ""
            if inspect.isasyncgenfunction(func):
                prefix = "async generator: "
            parts.append(f"{h}# `{qualname}.{name}`\n\n```python\n{prefix}{sig}\n```\n")
        if doc:
            parts.append(render_doc(doc))
    return "\n".join(parts)


def document_function(qualname: str, func: Any, level: int = 2) -> str:
    h = "#" * level
    text = f"{h} `{qualname}`\n\n```python\n{_sig(func, qualname)}\n```\n"
    return text + "\n" + render_doc(func.__doc__ or "")


def generate() -> str:
    import asyncllm
    import asyncllm.server as server
    from asyncllm.server import metrics

    names = sorted(asyncllm.__all__, key=lambda n: (ORDER.index(n) if n in ORDER else 99, n))
    parts = [HEADER]
    for name in names:
        obj = getattr(asyncllm, name)
        if inspect.isclass(obj):
            parts.append(document_class(name, obj))
        else:
            parts.append(document_function(name, obj))
    parts.append("# The OpenAI-compatible server\n")
    parts.append(render_doc(server.__doc__ or ""))
    parts.append("## Metrics\n")
    parts.append(render_doc(metrics.__doc__ or ""))
    for name in ("create_app", "serve", "main"):
        parts.append(document_function(f"asyncllm.server.{name}", getattr(server, name)))
    parts.append(document_class("asyncllm.server.OpenAIServer", server.OpenAIServer))
    text = "\n".join(p.rstrip() + "\n" for p in parts)
    return re.sub(r"\n{3,}", "\n\n", text)


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
