"""The int8 KV cache layout (``EngineConfig.kv_cache_dtype="int8"``): quantize on write,
dequantize on read.

Each token's K (and V) row of one KV head, ``head_dim`` values, is stored as ``head_dim``
int8 codes followed by its float32 scale (4 bytes, native byte order): a cache is an int8
tensor ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``. Symmetric per-token,
per-head quantization (the scheme of vLLM's per-token-head int8 KV cache and of llama.cpp's
``q8_0``, there per 32 values): ``scale = absmax / 127``, ``code = round(x * 127 /
absmax)`` (ties to even; an all-zero row has scale 0 and codes 0), ``x ~ code * scale``,
so an element is off by at most ``scale / 2``. Keeping the scale beside its codes keeps
every per-block datum in the one K and one V tensor per slot: a block copy (copy-on-write,
swap out and in, a host prefix store) that copies those tensors copies the scales with it.

The bytes per token and KV head: ``head_dim + 4`` against ``2 * head_dim`` in bfloat16
(0.53x at head_dim 64) and ``4 * head_dim`` in float32.

The torch reference (:func:`quantize`, :func:`dequantize`) is what the C++ write
(``csrc/paged_attention.cpp``) and the Triton write (:mod:`asyncllm.kernels.kv_cache_write`)
compute, in float32: ``scale = absmax * (1/127)`` as a float32 product and the codes as
``x * (127 / absmax)`` rounded half to even.
"""

from __future__ import annotations

import torch

#: Bytes of the float32 scale after each row's codes.
SCALE_BYTES = 4

#: The largest code: symmetric, so -128 is never used.
QMAX = 127

#: The cache's element type.
INT8 = torch.int8

#: ``EngineConfig.kv_cache_dtype`` values with a quantized layout -> their storage dtype.
QUANTIZED_KV_DTYPES = {"int8": INT8}


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds int8 codes with inline scales (this module's layout)."""
    return cache.dtype == INT8


def row_dim(head_dim: int, quantized: bool) -> int:
    """Elements of one token-head row of a cache: ``head_dim``, or ``head_dim + 4`` int8
    elements (codes and scale) for a quantized cache."""
    return head_dim + SCALE_BYTES if quantized else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache ``[..., row]`` stores (its last dimension less the scale bytes
    for an int8 cache)."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """K or V rows ``[..., head_dim]`` (any float dtype) -> int8 ``[..., head_dim + 4]``:
    each row's codes, then its float32 scale's 4 bytes (the module's text)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax * (1.0 / QMAX)
    inv = torch.where(amax > 0, QMAX / amax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes = torch.round(xf * inv).clamp_(-QMAX, QMAX).to(INT8)
    return torch.cat([codes, scale.view(INT8)], dim=-1)


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[...]`` of packed rows ``[..., head_dim + 4]``."""
    return packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[..., head_dim + 4]`` -> ``[..., head_dim]`` values ``code * scale``
    (float32 products), in ``dtype``."""
    codes = packed[..., :-SCALE_BYTES].float()
    return (codes * scales(packed)[..., None]).to(dtype)
