"""The load-time check that a model's attention really runs on the paged KV cache.

:func:`asyncllm.models.architecture.check_architecture` reads the config, and the loader refuses
a class whose source transformers judges to bypass its attention interface; neither proves
that the modeling code goes through the interface, nor that the cache layout fits it:
transformers' Falcon calls torch's attention itself (each chunk of a prompt would attend to
itself only: wrong tokens, no error), DeepSeek-V2/V3's first paged step raises (MLA: K and
V head sizes differ from the cache's). So before an engine serves a model,
:func:`check_paged_forward` runs one short prompt through the paged path in two chunks
(chunked prefill: the second chunk reads the first one's K/V from the cache), counts the
layers that reached the cache, and compares the logits with the model's own eager forward
over the whole prompt. A model that fails is refused with
:class:`~asyncllm.errors.UnsupportedModelError` (the rule: refused at load, never served
wrongly).

In bfloat16 (or float16) "the same logits" cannot mean a fixed bound: both forwards round
at every layer, and a model that amplifies small differences (large weights) moves its
logits by several times any fixed bound that still catches a wrong attention in a tame
model (0.16 of their scale: a tiny Llama with weights fifty times the usual scale), although it runs
exactly in float32. So where the paged logits miss the fixed bound, the check measures how far the
eager forward itself moves when its input embeddings change by one rounding step
(:func:`_rounding_noise`, one more short forward, only then: the default model's 0.02
needs none) and allows twice that, up to a ceiling that the failures it exists for stay
above. A float32 reference would measure the noise directly, but needs a float32 copy of
the weights (twice a bfloat16 model's memory, and quantized layers have none); two eager
runs in other chunkings agree bit for bit on CPU and measure nothing.

A model whose eager forward gives non-finite logits is not checked against: its weights
hold inf/NaN (a corrupt file; :class:`~asyncllm.errors.ModelLoadError` naming the first
module that produced them) or, its weights finite, its activations overflow the dtype
(:class:`~asyncllm.errors.UnsupportedModelError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from asyncllm.attention.backend_registry import (
    ATTN_IMPLEMENTATION,
    METADATA_KWARG,
    AttentionBackend,
    grouped_metadata,
    step_metadata,
)
from asyncllm.errors import ModelLoadError, UnsupportedModelError
from asyncllm.worker.kv_cache import KVCache, expected_windows

__all__ = [
    "NATIVE_PROBE_CHUNKS",
    "PROBE_CHUNKS",
    "check_paged_forward",
    "expected_windows",
    "logits_agree",
    "native_forward_error",
]

#: The probe prompt's two chunks, in tokens: a prefill, then a chunk that reads it from the
#: cache.
PROBE_CHUNKS = (5, 3)
#: The C++ forward's probe (:mod:`asyncllm.worker.native_forward`): a prefill, a chunk that
#: reads it from the cache, and a decode step (the decode kernel armed from C++).
NATIVE_PROBE_CHUNKS = (5, 2, 1)

#: ``forward(ids, positions, keep) -> logits [len(keep), vocab]`` of one step, run inside
#: its ``step_metadata`` (the C++ forward's ``NativeForward.forward``).
StepForward = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]

#: Largest ``max |paged - eager| / max |eager|`` over the probe's logits that counts as the
#: same function, per compute dtype. Measured (docs/models.md, "Two checks at load"):
#: float32 models agree within ~1e-6, bfloat16 ones within ~2e-2 at ordinary weights;
#: attention that skips the cache is off by 0.4-1.7, a sliding window ignored by 0.3-1.3.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
#: Other dtypes (bfloat16, float16): this bound, or :data:`_NOISE_FACTOR` times the eager
#: forward's own rounding noise (:func:`_rounding_noise`) where that is larger, but never
#: above :data:`_LOW_PRECISION_CEILING`. Measured in bfloat16 on 44 tiny random models of
#: 19 families (initial weights up to fifty times the usual scale) and the default model: the paged
#: logits' gap is at most 0.7 of that noise and 0.17 of their scale; the failures above
#: stay over 0.3, above the ceiling whatever the noise.
_LOW_PRECISION_TOLERANCE = 5e-2
_NOISE_FACTOR = 2.0
_LOW_PRECISION_CEILING = 0.25
#: Added to the bound (capped at :data:`_LOW_PRECISION_CEILING`) when the paged path reads
#: an int8 KV cache, whose K/V are rounded to 1/254 of each row's largest value
#: (:mod:`asyncllm.attention.kv_int8`). Measured with an int8 cache: the 19 tiny families of
#: tests/models/test_architectures.py 0.001-0.015 in float32, 0.005-0.021 in bfloat16; the default
#: model 0.0096 (float32), 0.027 (bfloat16; 0.020 with its bfloat16 cache); Gemma 3 270M
#: 0.081 (float32, the torch path and the C++ kernel alike; 2e-6 without int8) and 0.112
#: (bfloat16; 0.045 with its bfloat16 cache). The failures the check exists for stay above
#: the ceiling (0.3 and more).
_INT8_KV_TOLERANCE = 0.1


def logits_agree(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    noise: float = 0.0,
    *,
    kv_int8: bool = False,
) -> tuple[bool, float]:
    """``got`` and ``want`` ([T, vocab], any float dtype) are the same function's logits up
    to the rounding of a model computed in ``dtype``: returns (agree,
    ``max|got - want| / max|want|``). ``noise`` (the same measure, :func:`_rounding_noise`)
    widens a bfloat16 or float16 bound up to a ceiling; float32 ignores it. Non-finite
    logits never agree. ``kv_int8``: ``got`` read an int8 KV cache, whose rounding
    (:mod:`asyncllm.attention.kv_int8`) adds up to :data:`_INT8_KV_TOLERANCE` to the bound."""
    err = (got.float() - want.float()).abs().max().item()
    scale = max(want.float().abs().max().item(), 1e-6)
    tol = _TOLERANCE.get(dtype)
    if tol is None:
        tol = min(max(_LOW_PRECISION_TOLERANCE, _NOISE_FACTOR * noise), _LOW_PRECISION_CEILING)
    if kv_int8:
        tol = min(tol + _INT8_KV_TOLERANCE, _LOW_PRECISION_CEILING)
    return err <= tol * scale, err / scale


def check_paged_forward(model: Any, kv_cache: KVCache, backend: AttentionBackend) -> None:
    """Run a short prompt through ``model`` on the paged path in two chunks
    (:data:`PROBE_CHUNKS`) and check it against the model's eager forward.

    ``model`` is a transformers ``*ForCausalLM`` already switched to the paged attention
    (``ATTN_IMPLEMENTATION``). The probe writes blocks ``0..n`` of ``kv_cache``: call it
    before any request holds a block. Costs two short forwards (a third in bfloat16 or
    float16 where the logits miss the fixed bound, to measure the rounding noise).

    Raises:
        UnsupportedModelError: a layer's attention did not reach the paged cache or was
            not handed the sliding window its config asks for (:func:`expected_windows`),
            the paged (or the model's eager) forward raised, its logits differ from the eager
            forward's beyond rounding (:func:`logits_agree`), or its activations overflow
            the dtype; the message names the model type and what failed.
        ModelLoadError: the eager forward gives non-finite logits from non-finite weights
            (a corrupt weight file; the message names the first module that gave them).
        MemoryError, torch.OutOfMemoryError: as raised by the forward.
    """
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layers = len(kv_cache.key_caches)
    total = sum(PROBE_CHUNKS)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = [(17 * i + 5) % vocab for i in range(total)]  # any tokens: the weights are what differ
    calls = [0]
    windows: dict[int, int] = {}
    try:
        counting = _counting(backend, calls, windows, kv_cache)
        paged = _paged_logits(model, kv_cache, counting, ids)
    except (MemoryError, torch.OutOfMemoryError):
        raise  # the machine's limit, not the model's
    except Exception as exc:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: its first step on the paged KV cache fails "
            f"({type(exc).__name__}: {exc}); asyncllm cannot serve it"
        ) from exc
    if calls[0] != layers * len(PROBE_CHUNKS):
        raise UnsupportedModelError(
            f"model_type {model_type!r}: its attention bypasses the paged KV cache ("
            f"{calls[0]} of {layers * len(PROBE_CHUNKS)} layer calls reached it: its modeling "
            "code calls an attention function of its own); asyncllm cannot serve it"
        )
    _check_windows(model.config, windows, model_type)
    try:
        eager = _eager_logits(model, ids)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: its own eager forward fails ({type(exc).__name__}: "
            f"{exc}); asyncllm cannot check it, so does not serve it"
        ) from exc
    dtype = kv_cache.spec.dtype  # the model's (an int8 cache's rounding: kv_int8 below)
    kv_int8 = kv_cache.spec.quantized
    if not bool(eager.isfinite().all()):
        # Not the paged cache's doing: the reference itself is inf/NaN.
        _refuse_nonfinite(model, ids, model_type, dtype)
    agree, err = logits_agree(paged, eager, dtype, kv_int8=kv_int8)
    noise = None
    if not agree and dtype not in _TOLERANCE:
        noise = _rounding_noise(model, ids, eager)
        agree, err = logits_agree(paged, eager, dtype, noise, kv_int8=kv_int8)
    if not agree:
        rounding = (
            ""
            if noise is None
            else f", more than {_name(dtype)} rounding explains (one rounding step of its "
            f"input moves its eager logits by {noise:.3g})"
        )
        raise UnsupportedModelError(
            f"model_type {model_type!r}: on the paged KV cache its logits differ from its own "
            f"eager forward's by {err:.3g} of their scale (a prompt in chunks of "
            f"{PROBE_CHUNKS}){rounding}; asyncllm cannot serve it exactly"
        )


def _rounding_noise(model: Any, ids: list[int], eager: torch.Tensor) -> float:
    """How far one rounding step moves the model's eager logits: ``max|e' - eager| /
    max|eager|`` where ``e'`` is the eager forward with every element of its input
    embeddings scaled by ``1 +- eps`` of its dtype (signs alternating along the hidden
    size): a stand-in for the rounding each layer adds, amplified by the model as that is.
    On tiny random models in bfloat16 it measured of the order of their gap to a float32
    forward (which needs float32 weights), larger where the nudge flips a mixture of experts'
    routing (docs/tuning.md, "Costs behind smaller code choices"). 0.0 where the model has no
    input embedding module."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:
        return 0.0
    if not isinstance(embeddings, torch.nn.Module):
        return 0.0

    def nudge(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        sign = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
        sign[1::2] = -1
        return out * (1 + torch.finfo(out.dtype).eps * sign)

    handle = embeddings.register_forward_hook(nudge)
    try:
        nudged = _eager_logits(model, ids)
    finally:
        handle.remove()
    scale = max(eager.float().abs().max().item(), 1e-6)
    return (nudged.float() - eager.float()).abs().max().item() / scale


def _refuse_nonfinite(model: Any, ids: list[int], model_type: str, dtype: torch.dtype) -> None:
    """Raise for a model whose eager logits are not finite, naming the first module (in the
    order they finish) whose output is inf/NaN from finite inputs: ModelLoadError where that
    module's own weights are not finite, else UnsupportedModelError (an overflow)."""
    found: list[tuple[str, torch.nn.Module]] = []

    def finite(values: Any) -> bool:
        values = values if isinstance(values, (tuple, list)) else (values,)
        return all(
            bool(v.isfinite().all())
            for v in values
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        )

    def watch(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not found and not finite(out) and finite(args):
                found.append((name, module))

        return hook

    handles = [m.register_forward_hook(watch(n)) for n, m in model.named_modules()]
    try:
        _eager_logits(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    if not found:
        raise ModelLoadError(
            f"model_type {model_type!r}: its own eager forward gives non-finite logits (inf/NaN) "
            f"in {_name(dtype)}: its weights hold non-finite values (a corrupt weight file) "
            "or its activations overflow; asyncllm does not serve it"
        )
    name, module = found[0]
    weight = getattr(module, "weight", None)  # PackedLinear's is a property (its dense copy)
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if isinstance(weight, torch.Tensor):
        own.append(weight)
    if not finite(own):
        raise ModelLoadError(
            f"model_type {model_type!r}: the weights of {name or 'the model'} hold non-finite "
            "values (inf/NaN), so its logits are not finite: the weight file is corrupt; "
            "asyncllm does not serve it"
        )
    wider = "; load it in float32" if dtype in (torch.float16, torch.bfloat16) else ""
    raise UnsupportedModelError(
        f"model_type {model_type!r}: its activations overflow {_name(dtype)} (the output of "
        f"{name or 'the model'} is inf/NaN from finite inputs and weights){wider}; asyncllm "
        "does not serve it"
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_windows(config: Any, seen: dict[int, int], model_type: str) -> None:
    """Refuse a model whose layers did not hand the attention the window their config
    asks for: a window longer than the probe would go unnoticed by the logits (the modeling
    code applies it in a mask of its own, which the paged attention does not read)."""
    want = expected_windows(config)
    wrong = [i for i, w in enumerate(want) if seen.get(i, 0) != w]
    if wrong:
        i = wrong[0]
        raise UnsupportedModelError(
            f"model_type {model_type!r}: its config asks layer {i} for a sliding window of "
            f"{want[i] or 'no'} tokens, but its attention was handed "
            f"{seen.get(i, 0) or 'none'} ({len(wrong)} layer(s) so); asyncllm cannot apply "
            "the window its modeling code keeps elsewhere, so does not serve it"
        )


def _counting(
    backend: AttentionBackend,
    calls: list[int],
    windows: dict[int, int],
    kv_cache: KVCache,
) -> AttentionBackend:
    """``backend`` with each layer call that writes the cache counted in ``calls[0]``, and
    the sliding window each layer's attention was given in ``windows`` (layer -> tokens, 0:
    none); no native step (``arm_step``), so every layer goes through the Python attention
    function. The layer is found by its key cache and its plan: layers of one slot share a
    key cache (:mod:`asyncllm.worker.kv_cache`), each with its group's plan, and a step's
    plans are made group after group (:func:`grouped_metadata`)."""
    write, attend, fast = backend.write, backend.attend, backend.write_and_decode
    num_groups = kv_cache.spec.layer_groups.num_groups
    groups = kv_cache.layer_groups or (0,) * len(kv_cache.key_caches)
    layer_of = {
        (g, id(k)): i for i, (g, k) in enumerate(zip(groups, kv_cache.key_caches, strict=True))
    }
    plan_group: dict[int, int] = {}  # id(plan) -> its group
    made = [0]

    def planned(make: Any) -> Any:
        def make_and_note(*args: Any) -> Any:
            plan = make(*args)
            plan_group[id(plan)] = made[0] % num_groups
            made[0] += 1
            return plan

        return make_and_note

    def note(plan: Any, k_cache: torch.Tensor, window: int) -> None:
        windows[layer_of.get((plan_group.get(id(plan), -1), id(k_cache)), -1)] = window

    def counted_write(*args: Any) -> None:
        calls[0] += 1
        write(*args)

    def seen_attend(
        query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any,
        scale: float, window: int = 0, softcap: float = 0.0,
    ) -> torch.Tensor:  # fmt: skip
        note(plan, k_cache, window)
        return attend(query, k_cache, v_cache, plan, scale, window, softcap)

    def counted_fast(*args: Any) -> torch.Tensor | None:
        assert fast is not None
        out = fast(*args)
        if out is not None:
            calls[0] += 1
            note(args[6], args[3], int(args[8]))
        return out

    return dataclasses.replace(
        backend,
        build_plan=planned(backend.build_plan),
        retable=None if backend.retable is None else planned(backend.retable),
        write=counted_write,
        attend=seen_attend,
        write_and_decode=None if fast is None else counted_fast,
        arm_step=None,
    )


def native_forward_error(
    forward: StepForward, model: Any, kv_cache: KVCache, backend: AttentionBackend
) -> float | None:
    """Run the probe prompt through ``forward`` (the C++ forward) in
    :data:`NATIVE_PROBE_CHUNKS` and compare its logits with the model's eager forward;
    returns ``max|native - eager| / max|eager|`` where it is beyond rounding
    (:func:`logits_agree`: the C++ forward must not serve this model), None where they
    agree. Call it before any request holds a block (it writes blocks ``0..n``).

    Raises:
        Exception: what ``forward`` raises (the caller keeps the modeling code then).
    """
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = [(17 * i + 5) % vocab for i in range(sum(NATIVE_PROBE_CHUNKS))]
    got = _paged_logits(model, kv_cache, backend, ids, NATIVE_PROBE_CHUNKS, forward)
    want = _eager_logits(model, ids)
    dtype, kv_int8 = kv_cache.spec.dtype, kv_cache.spec.quantized
    agree, err = logits_agree(got, want, dtype, kv_int8=kv_int8)
    return None if agree else err


def _paged_logits(
    model: Any,
    kv_cache: KVCache,
    backend: AttentionBackend,
    ids: list[int],
    chunks: tuple[int, ...] = PROBE_CHUNKS,
    forward: StepForward | None = None,
) -> torch.Tensor:
    """Logits [len(ids), vocab] of ``ids`` fed to the paged path in ``chunks`` (each layer
    group in blocks of its own), through the modeling code or ``forward``."""
    bs = kv_cache.spec.block_size
    per_group = -(-len(ids) // bs)
    num_groups = kv_cache.spec.layer_groups.num_groups
    tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(num_groups)]
    dev = kv_cache.key_caches[0].device
    out, start = [], 0
    for n in chunks:
        end = start + n
        meta = grouped_metadata(
            kv_cache.key_caches,
            kv_cache.value_caches,
            kv_cache.layer_groups,
            backend,
            [n],
            [end],
            [tables],
            [[t[p // bs] * bs + p % bs for p in range(start, end)] for t in tables],
            bs,
            dev,
        )
        with torch.inference_mode(), step_metadata(meta, n):
            if forward is not None:
                out.append(forward(ids[start:end], list(range(start, end)), torch.arange(n)))
                start = end
                continue
            logits = model(
                input_ids=torch.tensor([ids[start:end]], device=dev),
                position_ids=torch.arange(start, end, device=dev)[None],
                use_cache=False,
                **{METADATA_KWARG: meta},
            ).logits[0]
        out.append(logits)
        start = end
    return torch.cat(out)


def _eager_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of the model's own forward (transformers' eager attention,
    its own masks), the paged attention switched back on after."""
    dev = next(model.parameters()).device
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            logits: torch.Tensor = model(
                input_ids=torch.tensor([ids], device=dev), use_cache=False
            ).logits[0]
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return logits
