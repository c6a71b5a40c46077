"""Command-line options generated from :class:`~asyncllm.config.EngineConfig`'s fields, so
every field is settable from ``python -m asyncllm serve`` and ``generate`` and a new field
appears by itself.

Each field ``some_name`` becomes ``--some-name``: its type (from the annotation, read with
``msgspec.inspect``) gives the parser and choices (a ``Literal``'s values; ``none`` where
the field takes None; ``true``/``false`` where it takes a bool), its help is the first
sentence of the field's entry in the class docstring's ``Attributes:`` section, followed by
its default. A bool field alone is a ``--name``/``--no-name`` pair. An option left out is
absent from the parsed namespace (argparse's ``SUPPRESS``), so only what the user gave is
passed on and the engine's own defaults apply otherwise; the parsed values are read with
:func:`engine_config_from_args` (attributes ``engine:<field>``, apart from the command's
own options).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from asyncllm.config import _GROUP_SIZES, EngineConfig

__all__ = ["add_engine_arguments", "engine_config_from_args", "field_help"]

#: The namespace attributes of the generated options are named ``engine:<field>``, so no
#: other option of the same command (``generate --seed``: the sampling seed) can collide.
DEST_PREFIX = "engine:"

#: Choices the annotation cannot tell (validated in ``EngineConfig.__post_init__``).
_EXTRA_CHOICES: dict[str, tuple[Any, ...]] = {"quantization_group_size": _GROUP_SIZES}

#: Older option names kept working: option -> (field, the value it sets).
_ALIASES: dict[str, tuple[str, Any]] = {"--no-prefix-caching": ("enable_prefix_caching", False)}


@functools.cache
def field_help() -> dict[str, str]:
    """Each field's first sentence in ``EngineConfig``'s ``Attributes:`` docstring section
    (reST double backquotes dropped, cross-references such as ``:mod:`x.y``` as ``x.y``)."""
    doc = inspect.cleandoc(EngineConfig.__doc__ or "")
    section = doc.partition("Attributes:\n")[2].partition("\n\nRaises:")[0]
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        m = re.match(r"    (\w+): (.*)", line)
        if m:
            name = m.group(1)
            entries[name] = m.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    out = {}
    for key, text in entries.items():
        first = re.match(r"(.*?\.)(\s|$)", text)
        plain = re.sub(r":\w+:`~?([^`]+)`", r"\1", first.group(1) if first else text)
        out[key] = plain.replace("``", "")
    return out


def as_options(message: str) -> str:
    """``message`` with each ``EngineConfig.<field>`` named as the command-line option that
    sets it (``EngineConfig.block_size`` -> ``--block-size``): what a user of ``generate``
    or ``serve`` typed."""
    return re.sub(
        r"EngineConfig\.(\w+)",
        lambda m: (
            "--" + m.group(1).replace("_", "-")
            if m.group(1) in EngineConfig.__struct_fields__
            else m.group(0)
        ),
        message,
    )


def _parse(value: str, kinds: Collection[Any]) -> Any:
    """``value`` as the first of ``kinds`` (None, bool, int, str, or a literal) it reads as."""
    low = value.lower()
    for kind in kinds:
        if kind is None:
            if low == "none":
                return None
        elif kind is bool:
            if low in ("true", "false"):
                return low == "true"
        elif kind is int:
            with contextlib.suppress(ValueError):
                return int(value)
        elif kind is str:
            return value
        elif kind is dict:  # NAME=NUMBER,NAME=NUMBER
            return _parse_weights(value)
        elif value == str(kind):  # a literal's value
            return kind
    raise argparse.ArgumentTypeError(f"invalid value {value!r}")


def _parse_weights(value: str) -> dict[str, float]:
    """``"a=2,b=0.5"`` as ``{"a": 2.0, "b": 0.5}`` (names may hold ``=``: the last splits)."""
    out = {}
    for item in value.split(","):
        name, sep, number = item.rpartition("=")
        try:
            out[name.strip()] = float(number)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected NAME=NUMBER[,NAME=NUMBER...], got {value!r}"
            )
    return out


def _kinds(t: msgspec.inspect.Type) -> list[Any]:
    """The values and types a field's annotation allows, as :func:`_parse` reads them."""
    if isinstance(t, msgspec.inspect.UnionType):
        return [k for member in t.types for k in _kinds(member)]
    if isinstance(t, msgspec.inspect.LiteralType):
        return list(t.values)
    if isinstance(t, msgspec.inspect.NoneType):
        return [None]
    if isinstance(t, msgspec.inspect.BoolType):
        return [bool]
    if isinstance(t, msgspec.inspect.IntType):
        return [int]
    if isinstance(t, msgspec.inspect.DictType):
        return [dict]
    return [str]


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _option(field: msgspec.inspect.Field) -> tuple[list[str], dict[str, Any]]:
    """The ``add_argument`` arguments of one field."""
    kinds = _kinds(field.type)
    text = field_help().get(field.name, "").replace("%", "%%")
    flag = "--" + field.name.replace("_", "-")
    kwargs: dict[str, Any] = {"dest": DEST_PREFIX + field.name, "default": argparse.SUPPRESS}
    help_default = f" (default: {_shown(field.default)})"
    if kinds == [bool]:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        choices = _EXTRA_CHOICES.get(field.name)
        if choices is None and all(k not in (int, str, dict) for k in kinds):
            literals = tuple(k for k in kinds if k is not bool)
            choices = literals + ((True, False) if bool in kinds else ())
        parse: Callable[[str], Any] = functools.partial(_parse, kinds=kinds)
        kwargs["type"] = parse
        if choices is not None:
            kwargs["choices"] = choices
            kwargs["metavar"] = "{" + ",".join(_shown(c) for c in choices) + "}"
        else:
            names = {int: "N", str: "TEXT", dict: "NAME=NUMBER,..."}
            kwargs["metavar"] = "|".join(names.get(k, _shown(k)) for k in kinds)
        if bool in kinds:  # a bare --flag means True
            kwargs["nargs"] = "?"
            kwargs["const"] = True
    kwargs["help"] = text + help_default
    return [flag], kwargs


def add_engine_arguments(
    parser: argparse.ArgumentParser | Any, exclude: Collection[str] = ("model",)
) -> None:
    """Add one option per :class:`EngineConfig` field but those in ``exclude`` (and the
    older names of :data:`_ALIASES`) to ``parser`` (a parser or an argument group)."""
    info = msgspec.inspect.type_info(EngineConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        if field.name in exclude:
            continue
        flags, kwargs = _option(field)
        parser.add_argument(*flags, **kwargs)
    for flag, (name, value) in _ALIASES.items():
        if name not in exclude:
            new = f"--{'no-' if value is False else ''}{name.replace('_', '-')}"
            parser.add_argument(
                flag,
                dest=DEST_PREFIX + name,
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                help=f"the same as {new}",
            )


def engine_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`EngineConfig` fields the options of :func:`add_engine_arguments` set
    (those given on the command line)."""
    given: Mapping[str, Any] = vars(args)
    return {
        key[len(DEST_PREFIX) :]: value
        for key, value in given.items()
        if key.startswith(DEST_PREFIX)
    }
