"""Chat templates shipped with asyncllm, and reading the one a command line names
(``python -m asyncllm serve --chat-template NAME|FILE``, ``create_app(chat_template=...)``).

Built in (``<name>.jinja`` beside this module):

- ``"hermes"``: ChatML turns (``<|im_start|>role`` ... ``<|im_end|>``, the format of SmolLM2,
  Qwen and Hermes models) with Hermes-style tool calling: the tools' JSON schemas in the
  system turn inside ``<tools></tools>``, each call the model makes as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the "hermes" format of
  :mod:`asyncllm.tool_calling.tool_calls`), each result sent back in a user turn as
  ``<tool_response>...</tool_response>``. For a ChatML model whose own template has no tool
  support, such as the default model: ``serve --model default --chat-template hermes``.
  How well a model calls tools depends on its training (the default 135M model rarely does
  on its own); ``tool_choice="required"`` or a named function makes the output calls with
  a grammar whatever the model.

Torch-free (the standard library only): ``serve`` reads the template before it loads the model.
"""

from __future__ import annotations

import importlib.resources
import pathlib

__all__ = ["BUILTIN_TEMPLATES", "builtin_chat_template", "load_chat_template"]

#: The names of the templates shipped with asyncllm.
BUILTIN_TEMPLATES = ("hermes",)


def builtin_chat_template(name: str) -> str:
    """The Jinja text of the built-in template ``name`` (one of :data:`BUILTIN_TEMPLATES`).

    Raises:
        ValueError: no built-in template has that name.
    """
    if name not in BUILTIN_TEMPLATES:
        raise ValueError(f"no built-in chat template {name!r} (built in: {BUILTIN_TEMPLATES})")
    return (importlib.resources.files(__name__) / f"{name}.jinja").read_text(encoding="utf-8")


def load_chat_template(spec: str) -> str:
    """The Jinja text ``spec`` names: a built-in template's name (:data:`BUILTIN_TEMPLATES`),
    the path of a template file, or a template's own text (which contains ``{{`` or
    ``{%``, as vLLM's ``--chat-template`` accepts).

    Raises:
        ValueError: ``spec`` is none of these (a missing file), or the file cannot be read
            as UTF-8 text.
    """
    if spec in BUILTIN_TEMPLATES:
        return builtin_chat_template(spec)
    if "{{" in spec or "{%" in spec:
        return spec
    path = pathlib.Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"chat template {spec!r} is neither a built-in name ({', '.join(BUILTIN_TEMPLATES)})"
            " nor a file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template file {path}: {exc}") from exc
