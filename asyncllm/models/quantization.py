"""Weight-only quantization of a loaded model (``EngineConfig.quantization``), cached on disk.

Settings:

* ``"auto"`` (the default): ``"gguf"`` for a GGUF model with linear weights of a type that
  has a kernel (``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_0``, ``Q5_K``, ``Q6_K``, ``Q8_0``; or only
  plain float), else ``None``;
  one log line says which, and which types run dequantized.
* ``None``: the model's dtype (a GGUF file dequantized to float32, as before).
* ``"int8"``: weight-only int8, one scale per output channel (``Int8Linear``).
* ``"int4"``: weight-only 4-bit, a scale and zero point per ``group_size`` input columns
  (``Int4Linear``; 32 by default, 64 or 128).
* ``"gguf"``: a GGUF file's own blocks kept: ``Q4_0``/``Q4_1``/``Q4_K`` -> ``Int4Linear``
  with group 32 (codes as they are; Q4_K's sub-block scales and minimums folded exactly into
  block scales and offsets); ``Q8_0``/``Q5_0``/``Q6_K``/``Q5_K`` -> ``Q8Linear`` (int8
  codes, a float32 scale per 32 columns: ``Q5_0``'s ``d * (q - 16)`` as codes ``q - 16``,
  or 5-bit codes with its float16 ``d`` (:data:`Q5_0_BITS`);
  ``Q6_K``'s ``(d * sc) * (q - 32)`` as codes ``q - 32`` and scales ``d * sc`` per 16
  columns; ``Q5_K``'s ``(d * sc) * q - dmin * m`` as codes ``q``, scales and offsets per 32;
  all exact; :data:`Q8_0_LINEAR`, :data:`Q8_CODE_TYPES`); an LM head of one of those types
  -> ``Q8Linear`` (float32 logits); the token embedding table -> :class:`QuantEmbedding`;
  other types (``Q2_K``, ``Q3_K``, ``Q5_1``...) run dense.

The int4 layers compute in the model's dtype where it is float32 (float32 activations and
scales: the function the file defines, as closely as float32 computes it) and in bfloat16
otherwise (:func:`asyncllm.layers.quant_linear.int4_dtype`); the int8 layers in bfloat16
(:data:`asyncllm.layers.quant_linear.COMPUTE_DTYPE`), handing float32 back to a float32 model.

What is quantized: every ``nn.Linear`` of the decoder layers. For int4/int8 the LM head
stays in the model's dtype, and so does a tied embedding table (the same tensor): an int4
head costs more perplexity than the quality test allows (docs/tuning.md,
``benchmarks/head_precision.py``). Under "gguf", a ``Q8_0`` head (llama.cpp's usual choice;
``Q6_K`` in many Q4_K_M files) keeps the file's codes where its kernel has an AVX-512 path
(:class:`~asyncllm.layers.q8_linear.Q8Linear`), and a table tied to it reads the same codes
(:class:`~asyncllm.layers.quant_linear.QuantEmbedding`, no second copy).

The converted modules are saved under ``cache_dir()/quant/`` keyed by the content of the
model's weight files (and of the GGUF file for "gguf"; :mod:`asyncllm.models.fingerprint`),
the setting, the dtype and the torch version, so a second start only loads them; the file
records its key, checked at load. A file that does not fit the model (another model's,
weights' or setting's, a layer missing or extra, an unknown module class) is ignored with a
warning and the model converted again (:func:`apply_cached`).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from asyncllm.layers import quant_linear as ql
from asyncllm.layers.q8_linear import Q8Linear
from asyncllm.models.quant_cache import CACHE_VERSION, cache_key, load_cache, save_cache

if TYPE_CHECKING:
    from asyncllm.models.gguf_quant import QuantBlocks

__all__ = [
    "MODES",
    "QuantInfo",
    "QuantSetting",
    "apply_cached",
    "load_cached",
    "quantize_model",
    "resolve_quantization",
]

logger = logging.getLogger("asyncllm")

MODES = ("auto", "int8", "int4", "gguf")
Mode = Literal["auto", "int8", "int4", "gguf"] | None
#: GGUF block size (the group of a Q4_* weight run by Int4Linear).
GGUF_GROUP = 32


class QuantInfo:
    """What :func:`quantize_model` did.

    Attributes:
        precision: a short description, e.g. ``"gguf (Q4_1 as int4 g32, Q8_0 embedding)"``,
            ``"int4 g32"``, ``"int8"`` or ``"float32"``.
        mode: the resolved setting (``"gguf"``, ``"int8"``, ``"int4"`` or None).
        num_quantized: modules replaced.
        from_cache: True when the modules were loaded from the on-disk cache.
    """

    def __init__(
        self, precision: str, mode: str | None, num_quantized: int, from_cache: bool
    ) -> None:
        self.precision = precision
        self.mode = mode
        self.num_quantized = num_quantized
        self.from_cache = from_cache

    def __repr__(self) -> str:
        return f"QuantInfo({self.precision!r}, n={self.num_quantized}, cache={self.from_cache})"


@dataclasses.dataclass(frozen=True)
class QuantSetting:
    """``EngineConfig.quantization`` resolved for one model, before any weight is read.

    Attributes:
        mode: "gguf", "int8", "int4" or None (the model's dtype).
        group_size: int4's group (GGUF's block for "gguf").
        dtype: the model's dtype.
        device: where the model runs.
        cache_path: the converted modules' cache file (None when ``mode`` is None).
        gguf_file: the GGUF file the model came from (None for a model that is not one);
            its tensors are read only when the model is converted.
        cache_key: what the cache file must record to be this model's and setting's
            (a hash of the weight files' content and the setting; None when ``mode`` is).
    """

    mode: str | None
    group_size: int
    dtype: torch.dtype
    device: torch.device
    cache_path: pathlib.Path | None
    gguf_file: pathlib.Path | None
    cache_key: str | None = None


def resolve_quantization(
    mode: Mode,
    *,
    group_size: int,
    model_dir: pathlib.Path,
    gguf_file: pathlib.Path | None,
    cache_root: pathlib.Path,
    dtype: torch.dtype,
    device: torch.device,
) -> QuantSetting:
    """Resolve and check ``mode`` for the model in ``model_dir`` (see the module docstring).

    Args:
        mode: ``EngineConfig.quantization``.
        group_size: int4's group (32, 64 or 128); ignored otherwise.
        model_dir: the Hugging Face directory of the model (its files' content keys the
            cache; so does ``gguf_file``'s for "gguf").
        gguf_file: the GGUF file ``model_dir`` was converted from, or None.
        cache_root: where converted models are cached (``cache_dir()``).
        dtype, device: the model's.

    Raises:
        ValueError: an unknown ``mode``; ``"gguf"`` for a model that is not a GGUF file; a
            group size outside 32/64/128; a kernel missing on the device (naming the
            setting).
    """
    if mode not in (None, *MODES):
        raise ValueError(f"EngineConfig.quantization must be one of {(None, *MODES)}, got {mode!r}")
    if mode == "auto":
        kinds = _gguf_kinds_of(gguf_file, cache_root) if gguf_file is not None else None
        resolved = _auto_mode(kinds, gguf_file, device, dtype)
    else:
        resolved = mode
    if resolved is None:
        return QuantSetting(None, group_size, dtype, device, None, gguf_file)
    if resolved == "gguf" and gguf_file is None:
        raise ValueError(
            f"quantization='gguf' needs a .gguf model; {model_dir} is not one (use 'int4' "
            "or 'int8' to quantize it)"
        )
    if resolved == "int4" and group_size not in ql.GROUP_SIZES:
        raise ValueError(
            f"EngineConfig.quantization_group_size must be one of {ql.GROUP_SIZES}, got "
            f"{group_size!r}"
        )
    gs = GGUF_GROUP if resolved == "gguf" else group_size
    ql.check_kernel("int8" if resolved == "int8" else "int4", device, ql.COMPUTE_DTYPE)
    dtype_name = str(dtype).removeprefix("torch.")
    q8 = "-q8head" if resolved == "gguf" and _q8_head_ok(device) else ""
    if q8 and Q8_0_LINEAR == "dense":
        q8 += "-q8dense"
    elif q8 and Q8_CODE_TYPES is not None:
        q8 += "-codes-" + "-".join(sorted(Q8_CODE_TYPES))
    if q8 and Q5_0_BITS != 5:
        q8 += f"-q5bits{Q5_0_BITS}"
    name = f"{resolved}-g{gs}-{dtype_name}{q8}"
    key = cache_key(model_dir, name, gguf_file if resolved == "gguf" else None)
    # The folder's name only makes the file recognizable; the key tells models apart, the
    # version in the name lets a save remove this setting's files of other versions.
    path = cache_root / "quant" / f"{model_dir.name}-{name}-v{CACHE_VERSION}-{key[:12]}.pt"
    return QuantSetting(resolved, gs, dtype, device, path, gguf_file, key)


def load_cached(setting: QuantSetting) -> dict | None:
    """The converted modules cached for ``setting``, or None (not cached, or unreadable), or
    an empty dict for a file written for other weights (its recorded key is not
    ``setting.cache_key``; one warning): as :func:`apply_cached` leaves a file that does not
    fit, so that the load paths that try it next skip it quietly."""
    if setting.cache_path is None or setting.cache_key is None:
        return None
    return load_cache(setting.cache_path, setting.cache_key)


def quantize_model(lm: nn.Module, setting: QuantSetting, cached: dict | None = None) -> QuantInfo:
    """Replace ``lm``'s linear layers (and a GGUF embedding table) by quantized ones, in place.

    Args:
        lm: a transformers causal LM on ``setting``'s device and dtype; with ``cached``, its
            replaced layers may still be on the meta device (never read).
        setting: from :func:`resolve_quantization`.
        cached: :func:`load_cached`'s result, when the caller already read it.

    Returns:
        A :class:`QuantInfo`.

    Raises:
        ModelLoadError: a GGUF tensor with inf/NaN block scales (naming it; a corrupt file).
        ValueError: an int4 group size that does not divide a layer's input width (naming
            the layer).
    """
    dtype_name = str(setting.dtype).removeprefix("torch.")
    if setting.mode is None:
        return QuantInfo(dtype_name, None, 0, False)
    info = apply_cached(lm, setting, cached if cached is not None else load_cached(setting))
    if info is not None:
        return info

    if setting.mode == "gguf":
        assert setting.gguf_file is not None
        modules, precision = _from_gguf(lm, _gguf_tensors(setting.gguf_file), setting.dtype)
    else:
        modules, precision = _from_float(lm, setting.mode, setting.group_size, setting.dtype)
    precision += ql.unquantized_experts(lm)
    for name, module in modules.items():
        ql.replace_module(lm, name, module.to(setting.device))
    _retie(lm)
    assert setting.cache_path is not None and setting.cache_key is not None
    save_cache(setting.cache_path, setting.cache_key, modules, precision)
    return QuantInfo(precision, setting.mode, len(modules), False)


def apply_cached(lm: nn.Module, setting: QuantSetting, cached: dict | None) -> QuantInfo | None:
    """Put the cached quantized modules into ``lm`` (its layers may be on the meta device),
    if they fit it: one module for each layer a conversion under ``setting`` replaces (every
    linear but the LM head for int4/int8; linears and the embedding for "gguf"), each of that
    layer's shape. A file that does not fit (written for another model or setting, edited,
    or by another version) is ignored with one warning (``cached`` is emptied, so a second
    call with it returns None quietly), ``lm`` left as it was, and None returned: the
    caller converts again (or loads the dense weights first), as for an unreadable file; it
    is never served as the model.

    Returns:
        What was quantized (``from_cache`` True), or None (nothing cached, or a misfit).
    """
    if not cached:  # nothing cached, or a file already found not to fit (emptied below)
        return None
    try:
        modules = {n: ql.module_from_state(st) for n, st in cached["modules"].items()}
        misfit = _cache_misfit(lm, setting, modules)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        misfit = f"unreadable module ({exc})"
    if misfit:
        logger.warning("asyncllm: ignoring quantization cache %s: %s", setting.cache_path, misfit)
        cached.clear()  # one warning per read, whichever load path tries it next
        return None
    for name, module in modules.items():
        ql.replace_module(lm, name, module.to(setting.device))
    _retie(lm)
    return QuantInfo(cached["precision"], setting.mode, len(modules), True)


def _cache_misfit(lm: nn.Module, setting: QuantSetting, modules: dict[str, nn.Module]) -> str:
    """Why cached ``modules`` cannot replace ``lm``'s layers under ``setting`` ("" if they can)."""
    head = _head_name(lm)
    layers = {n: m for n, m in _linears(lm) if n != head}
    emb = _embedding(lm)
    if setting.mode == "gguf":
        if emb is not None:
            layers[emb[0]] = emb[1]
        if head is not None:  # a Q8_0 head (Q8Linear)
            layers[head] = lm.get_submodule(head)
        extra = sorted(modules.keys() - layers.keys())
        if extra or not modules:
            return f"no such layers {extra[:3]}" if extra else "no modules"
    elif modules.keys() != layers.keys():
        return f"layers {sorted(layers.keys() ^ modules.keys())[:3]} differ from the model's"
    for name, module in modules.items():
        layer = layers[name]
        dims = (
            ("num_embeddings", "embedding_dim")
            if isinstance(layer, nn.Embedding)
            else ("in_features", "out_features")
        )
        if any(getattr(module, d, None) != getattr(layer, d) for d in dims):
            return f"{name} has another shape than the model's"
    return ""


def _auto_mode(
    tensors: list | None, gguf_file: pathlib.Path | None, device: torch.device, dtype: torch.dtype
) -> str | None:
    if tensors is None or gguf_file is None:
        return None
    types = sorted({t.kind for t in tensors if not _is_embedding_name(t.name)})
    kept = [k for k in types if k in _gguf_kinds()]
    dense = [k for k in types if k not in _gguf_kinds() and k not in _FLOAT]
    dtype_name = str(dtype).removeprefix("torch.")
    if dense and not kept:
        logger.info(
            "asyncllm: %s has no tensor type with a kernel (%s): running it dequantized to %s "
            "(quantization=None)",
            gguf_file.name,
            ", ".join(dense),
            dtype_name,
        )
        return None
    try:
        ql.check_kernel("int4", device, ql.COMPUTE_DTYPE)
    except ValueError as exc:
        logger.info("asyncllm: %s: %s; running it dequantized", gguf_file.name, exc)
        return None
    logger.info(
        "asyncllm: %s runs at its own precision (%s; quantization='gguf')%s",
        gguf_file.name,
        ", ".join(kept or types),
        f"; its {', '.join(dense)} layers dequantized to {dtype_name} (no kernel)" * bool(dense),
    )
    return "gguf"


_FLOAT = frozenset({"F32", "F16", "BF16", "F64"})


def _gguf_kinds() -> frozenset[str]:
    from asyncllm.models.gguf_quant import KERNEL_TYPES

    return KERNEL_TYPES


def _is_embedding_name(name: str) -> bool:
    """llama.cpp's embedding table and LM head: kept dense (or as exact embedding codes)
    whatever their type (often Q6_K), so they do not decide "auto"."""
    return name.startswith(("token_embd.", "output."))


def _gguf_kinds_of(path: pathlib.Path, cache_root: pathlib.Path) -> list:
    from asyncllm.models.gguf_quant import tensor_kinds

    return tensor_kinds(path, cache_root / "quant")


def _gguf_tensors(path: pathlib.Path) -> list:
    from asyncllm.models.gguf_quant import read_tensors

    return read_tensors(path)


def _linears(lm: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in lm.named_modules() if type(m) is nn.Linear]


def _head_name(lm: nn.Module) -> str | None:
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    for n, m in lm.named_modules():
        if m is head:
            return n
    return None


def _embedding(lm: nn.Module) -> tuple[str, nn.Embedding] | None:
    emb = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    for n, m in lm.named_modules():
        if m is emb and isinstance(m, nn.Embedding):
            return n, m
    return None


def _progress(items: Any, desc: str) -> Any:
    """``items`` with a progress bar on stderr where that is a terminal (tqdm's
    ``disable=None``): a first start quantizes for seconds to minutes; logs stay quiet."""
    from tqdm.auto import tqdm

    items = list(items)
    return tqdm(items, desc=desc, unit="layer", disable=None, leave=False, mininterval=0.5)


def _from_float(
    lm: nn.Module, mode: str, gs: int, dtype: torch.dtype
) -> tuple[dict[str, nn.Module], str]:
    head = _head_name(lm)
    out: dict[str, nn.Module] = {}
    for name, lin in _progress(_linears(lm), f"quantizing to {mode} (once; cached)"):
        if name == head:
            continue
        bias = lin.bias
        if mode == "int8":
            q8, scale = ql.int8_codes(lin.weight)
            out[name] = ql.Int8Linear(q8, scale, bias, ql.COMPUTE_DTYPE)
        else:
            if lin.in_features % gs:
                raise ValueError(
                    f"EngineConfig.quantization_group_size={gs} does not divide the input "
                    f"width {lin.in_features} of {name}; use one of "
                    f"{[g for g in ql.GROUP_SIZES if lin.in_features % g == 0] or 'none'}"
                )
            q, scale, offset = ql.int4_codes(lin.weight, gs)
            out[name] = ql.Int4Linear(q, scale, offset, gs, bias, ql.int4_dtype(dtype))
    return out, ("int8" if mode == "int8" else f"int4 g{gs}")


def _from_gguf(
    lm: nn.Module, tensors: list, dtype: torch.dtype
) -> tuple[dict[str, nn.Module], str]:
    from asyncllm.models.gguf_quant import INT4_TYPES, INT8_TYPES, OFFSET_TYPES, tensor_finder

    find = tensor_finder(tensors, next(lm.parameters()).dtype)
    head = _head_name(lm)
    emb = _embedding(lm)
    tied = emb is not None and head is not None and lm.get_submodule(head).weight is emb[1].weight
    out: dict[str, nn.Module] = {}
    kinds: dict[str, set[str]] = {}
    codes8 = INT8_TYPES if Q8_0_LINEAR == "codes" else frozenset()
    codes8 &= Q8_CODE_TYPES or INT8_TYPES
    codes8 = codes8 if _q8_head_ok(next(lm.parameters()).device) else frozenset()
    for name, lin in _progress(_linears(lm), "repacking the GGUF blocks (once; cached)"):
        if name == head:
            continue
        t, blocks, idx = find(name, lin.weight)
        if t.kind in _FLOAT:
            continue
        if t.kind in codes8:
            blocks = _in_order(blocks, idx)
            offset = blocks.offset if t.kind in OFFSET_TYPES else None
            bits = Q5_0_BITS if t.kind == "Q5_0" else 8
            out[name] = Q8Linear(blocks.q, blocks.scale, lin.bias, dtype, False, offset, bits)
            plus = " + offset" if offset is not None else ""
            kinds.setdefault(f"{t.kind} int{bits} g{blocks.group}{plus}", set()).add(name)
            continue
        if t.kind not in INT4_TYPES:
            # Types without a kernel (Q2_K, Q3_K, Q5_1...), and Q8_0/Q5_0/Q6_K/Q5_K where
            # their kernel has no AVX-512 path (or Q8_0_LINEAR is "dense", or they are not
            # in Q8_CODE_TYPES), stay the dense weights the conversion dequantized.
            kinds.setdefault(f"{t.kind} dense", set()).add(name)
            continue
        blocks = _in_order(blocks, idx)
        out[name] = ql.Int4Linear(
            blocks.q, blocks.scale, blocks.offset, GGUF_GROUP, lin.bias, ql.int4_dtype(dtype)
        )
        kinds.setdefault(f"{t.kind} int4", set()).add(name)
    if head is not None and _q8_head_ok(next(lm.parameters()).device):
        t, blocks, idx = find(head, lm.get_submodule(head).weight)
        if t.kind == "Q8_0" or t.kind in codes8:  # llama.cpp's usual head; Q6_K (Q4_K_M's)
            blocks = _in_order(blocks, idx)
            lin = lm.get_submodule(head)
            offset = blocks.offset if t.kind in OFFSET_TYPES else None
            out[head] = Q8Linear(blocks.q, blocks.scale, lin.bias, dtype, offset=offset)
            kinds.setdefault(f"{t.kind} head", set()).add(head)
    if emb is not None and not (tied and head not in out):
        quant, kind = _gguf_embedding(emb[1], out.get(head or "") if tied else None, find, dtype)
        if quant is not None:
            out[emb[0]] = quant
            if kind:
                kinds.setdefault(f"{kind} embedding", set()).add(emb[0])
    parts = ", ".join(f"{k} x{len(v)}" for k, v in sorted(kinds.items()))
    return out, f"gguf ({parts})"


def _gguf_embedding(
    table: nn.Embedding, tied_head: nn.Module | None, find: Any, dtype: torch.dtype
) -> tuple[ql.QuantEmbedding | None, str]:
    """The token embedding ``table`` as its GGUF codes, and their type ("" where they are
    a tied ``Q8Linear`` head's, shared); None where its type has no kernel or the codes'
    lookups would compute something else than the model's own module
    (:meth:`~asyncllm.layers.quant_linear.QuantEmbedding.same_lookups`: Gemma 3's scaled
    embedding keeps its factor; a module doing more stays dense, logged)."""
    from asyncllm.models.gguf_quant import INT8_TYPES, KERNEL_TYPES, OFFSET_TYPES

    scale, kind = getattr(table, "embed_scale", None), ""
    if isinstance(tied_head, Q8Linear):  # the table is the head's weight: share its codes
        q, s, offset = tied_head.q, tied_head.scale, tied_head.offset
    else:
        t, blocks, idx = find("embedding", table.weight)
        if t.kind not in KERNEL_TYPES:
            return None, ""
        blocks, kind = _in_order(blocks, idx), t.kind
        exact = t.kind in INT8_TYPES and t.kind not in OFFSET_TYPES  # d * q: no offset added
        q, s, offset = blocks.q, blocks.scale, None if exact else blocks.offset
    quant = ql.QuantEmbedding(q, s, offset, dtype, table.padding_idx, scale)
    if quant.same_lookups(table):
        return quant, kind
    logger.info("%s stays dense: its codes' lookups differ from it", type(table).__name__)
    return None, ""


def _in_order(blocks: QuantBlocks | None, idx: torch.Tensor) -> QuantBlocks:
    """``blocks`` (unpacked by :func:`_from_gguf`) with their rows in the model's order."""
    assert blocks is not None  # a kernel type: unpacked when indexed
    return blocks if torch.equal(idx, torch.arange(len(idx))) else blocks.take_rows(idx)


def _q8_head_ok(device: torch.device) -> bool:
    """GGUF int8 codes (a ``Q8_0`` or ``Q6_K`` LM head, ``Q5_0``/``Q6_K``/``Q5_K``/``Q8_0``
    decoder linears) are kept as such (:class:`~asyncllm.layers.q8_linear.Q8Linear`) on CPUs
    where their kernel has the AVX-512 path; elsewhere they stay dense."""
    from asyncllm.layers import q8_linear

    return device.type == "cpu" and q8_linear.fast()


#: What a decoder layer's Q8_0 or Q5_0 linear weight becomes: "codes" (a
#: :class:`~asyncllm.layers.q8_linear.Q8Linear` of the file's int8 codes and scales, where its
#: kernel has the AVX-512 path: ~1.06 bytes a weight, exact) or "dense" (dequantized to the
#: model's dtype, as before; kept for A/B measurements, with a cache file of its own). See
#: docs/tuning.md.
Q8_0_LINEAR = "codes"
#: Under "codes", the GGUF types of int8 codes made :class:`~asyncllm.layers.q8_linear.Q8Linear`
#: decoder linears: None, all of them (``Q8_0``, ``Q5_0``, ``Q6_K``, ``Q5_K``); a set, those
#: only, the others dense (A/B runs, e.g. ``{"Q5_0", "Q8_0"}`` before the ``Q6_K`` codes; a
#: cache file of their own).
Q8_CODE_TYPES: frozenset[str] | None = None
#: Bits a ``Q5_0`` decoder linear's codes keep: 5 (:func:`~asyncllm.layers.q8_linear.pack5`:
#: 5.5 bits a weight with its float16 scale, the file's size) or 8 (int8 codes and a float32
#: scale, 9 bits; kept for A/B runs, with a cache file of its own). The same outputs bit for
#: bit; 5-bit codes are looked up in a per-block table as fast as int8 codes widen
#: (docs/tuning.md, "Q5_0 as 5-bit codes").
Q5_0_BITS = 5


def _retie(lm: nn.Module) -> None:
    """Keep transformers from re-tying a replaced embedding and head (nothing to re-tie)."""
    cfg = getattr(lm, "config", None)
    if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
        emb = lm.get_input_embeddings()
        head = lm.get_output_embeddings()
        if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
            cfg.tie_word_embeddings = False
