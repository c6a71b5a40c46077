"""The load-time check that a model's attention really runs on the paged KV cache.

:func:`asyncllm.models.loader.check_architecture` reads the config, but a plain-looking
config does not prove the modeling code goes through transformers' attention interface, nor
that the cache layout fits it: transformers' Falcon calls torch's attention itself (each
chunk of a prompt would attend to itself only: wrong tokens, no error), DeepSeek-V2/V3's
first paged step raises (MLA: K and V head sizes differ from the cache's). So before an
engine serves a model, :func:`check_paged_forward` runs one short prompt through the paged
path in two chunks (chunked prefill: the second chunk reads the first one's K/V from the
cache), counts the layers that reached the cache, and compares the logits with the model's
own eager forward over the whole prompt. A model that fails is refused with
:class:`~asyncllm.errors.UnsupportedModelError` (the rule: refused at load, never served
wrongly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncllm.attention.backend_registry import (
    ATTN_IMPLEMENTATION,
    METADATA_KWARG,
    AttentionBackend,
    AttentionMetadata,
    step_metadata,
)
from asyncllm.errors import UnsupportedModelError
from asyncllm.worker.kv_cache import KVCache

__all__ = ["PROBE_CHUNKS", "check_paged_forward", "logits_agree"]

#: The probe prompt's two chunks, in tokens: a prefill, then a chunk that reads it from the
#: cache.
PROBE_CHUNKS = (5, 3)

#: Largest ``max |paged - eager| / max |eager|`` over the probe's logits that counts as the
#: same function, per compute dtype. Measured (docs/tuning.md, "The load-time paged-path
#: check"): float32 models agree within ~1e-6, bfloat16 ones within ~1e-2 (other row counts
#: take other kernels); attention that skips the cache is off by 0.1-1.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_LOW_PRECISION_TOLERANCE = 5e-2


def logits_agree(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """``got`` and ``want`` ([T, vocab], any float dtype) are the same function's logits up
    to the rounding of a model computed in ``dtype``: returns (agree,
    ``max|got - want| / max|want|``)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = max(want.float().abs().max().item(), 1e-6)
    tol = _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)
    return err <= tol * scale, err / scale


def check_paged_forward(model: Any, kv_cache: KVCache, backend: AttentionBackend) -> None:
    """Run a short prompt through ``model`` on the paged path in two chunks
    (:data:`PROBE_CHUNKS`) and check it against the model's eager forward.

    ``model`` is a transformers ``*ForCausalLM`` already switched to the paged attention
    (``ATTN_IMPLEMENTATION``). The probe writes blocks ``0..n`` of ``kv_cache``: call it
    before any request holds a block. Costs two short forwards.

    Raises:
        UnsupportedModelError: a layer's attention did not reach the paged cache, the paged
            (or the model's eager) forward raised, or its logits differ from the eager
            forward's beyond rounding (:func:`logits_agree`); the message names the model
            type and what failed.
        MemoryError, torch.OutOfMemoryError: as raised by the forward.
    """
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layers = len(kv_cache.key_caches)
    total = sum(PROBE_CHUNKS)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = [(17 * i + 5) % vocab for i in range(total)]  # any tokens: the weights are what differ
    calls = [0]
    try:
        paged = _paged_logits(model, kv_cache, _counting(backend, calls), ids)
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
    try:
        eager = _eager_logits(model, ids)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: its own eager forward fails ({type(exc).__name__}: "
            f"{exc}); asyncllm cannot check it, so does not serve it"
        ) from exc
    agree, err = logits_agree(paged, eager, kv_cache.key_caches[0].dtype)
    if not agree:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: on the paged KV cache its logits differ from its own "
            f"eager forward's by {err:.3g} of their scale (a prompt in chunks of "
            f"{PROBE_CHUNKS}); asyncllm cannot serve it exactly"
        )


def _counting(backend: AttentionBackend, calls: list[int]) -> AttentionBackend:
    """``backend`` with each layer call that writes the cache counted in ``calls[0]``; no
    native step (``arm_step``), so every layer goes through the Python attention function."""
    write, fast = backend.write, backend.write_and_decode

    def counted_write(*args: Any) -> None:
        calls[0] += 1
        write(*args)

    def counted_fast(*args: Any) -> torch.Tensor | None:
        assert fast is not None
        out = fast(*args)
        calls[0] += out is not None
        return out

    return dataclasses.replace(
        backend,
        write=counted_write,
        write_and_decode=None if fast is None else counted_fast,
        arm_step=None,
    )


def _paged_logits(
    model: Any, kv_cache: KVCache, backend: AttentionBackend, ids: list[int]
) -> torch.Tensor:
    """Logits [len(ids), vocab] of ``ids`` fed to the paged path in :data:`PROBE_CHUNKS`."""
    bs = kv_cache.spec.block_size
    table = list(range(-(-len(ids) // bs)))
    dev = kv_cache.key_caches[0].device
    out, start = [], 0
    for n in PROBE_CHUNKS:
        end = start + n
        meta = AttentionMetadata(
            key_caches=kv_cache.key_caches,
            value_caches=kv_cache.value_caches,
            slot_mapping=torch.tensor(
                [table[p // bs] * bs + p % bs for p in range(start, end)], device=dev
            ),
            plan=backend.build_plan([n], [end], [table], bs, dev),
            backend=backend,
        )
        with torch.inference_mode(), step_metadata(meta, n):
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
