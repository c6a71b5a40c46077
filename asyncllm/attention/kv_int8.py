"""The int8 KV cache layout (``EngineConfig.kv_cache_dtype="int8"``): quantize on write,
dequantize on read.

Each token's K (and V) row of one KV head, ``head_dim`` values, is stored as ``head_dim``
int8 codes followed by its float16 scale (2 bytes, native byte order): a cache is an int8
tensor ``[num_blocks, block_size, num_kv_heads, head_dim + 2]`` (``head_dim`` even, so each
scale is 2-byte aligned). Symmetric per-token, per-head quantization (the scheme of vLLM's
per-token-head int8 KV cache and of llama.cpp's ``q8_0``, there per 32 values, whose scale is
float16 too). Exactly, in float32 (``a`` the row's absmax)::

    s = float16(min(a * float32(1/127), 65504))     # round to nearest even
    code = clamp(round_half_even(x * (1 / s)), -127, 127)   # 1 / s rounded to float32
    x ~ code * s                                    # exact in float32

and codes 0 where ``s`` is 0 (an all-zero row, or ``a / 127`` at most float16's 2**-25, where
it rounds to 0). The codes come from the stored (rounded) scale, so rounding the scale to
float16 costs no accuracy: wherever ``a / 127`` is in float16's normal range ``[2**-14,
65504]``, ``a / s < 127.07`` (``s`` is within 2**-11 relative of ``a / 127``), no code clamps,
and every element is within ``s * (1/2 + 2**-15)`` of ``x`` (the ``2**-15``: the float32
reciprocal and product). Below that range (``a < 127 * 2**-14``, about 0.0078) a subnormal
scale rounded down may clamp the largest codes: an element is then within ``max(s * (1/2 +
2**-15), 3.8e-6)`` (``127 * 2**-25``, the scale's half step times 127, rounded up). Above it
(``a > 65504 * 127``, about 8.3e6, far beyond K/V activations) the scale saturates and the
codes clamp. Keeping the scale beside its codes keeps every per-block datum in the one K and
one V tensor per slot: a block copy (copy-on-write, swap out and in, a host prefix store) that
copies those tensors copies the scales with it.

The bytes per token and KV head: ``head_dim + 2`` against ``2 * head_dim`` in bfloat16
(66 bytes against 128 at head_dim 64: nearly twice the tokens, and twice as many of the
default model's 2,048-token sequences, in a GiB) and ``4 * head_dim`` in float32. (Before
float16 scales the row was ``head_dim + 4`` with a float32 scale; the disk tier's file key,
which names the layout, keeps such files from being read as this one.)

The torch reference (:func:`quantize`, :func:`dequantize`) is what the C++ write
(``csrc/paged_attention.cpp``) and the Triton write (:mod:`asyncllm.kernels.kv_cache_write`)
compute bit for bit: the formula above, the float16 rounding of the scale included.
"""

from __future__ import annotations

import torch

#: Bytes of the float16 scale after each row's codes.
SCALE_BYTES = 2

#: The scale's storage type.
SCALE_DTYPE = torch.float16

#: The largest scale: float16's largest finite value (a larger ``absmax / 127`` saturates).
SCALE_MAX = 65504.0

#: The layout's version, named in the disk tier's file key (:class:`KVCacheSpec`'s repr):
#: 2 is float16 scales; files of float32 scales (``head_dim + 4`` rows) were written before it.
LAYOUT_VERSION = 2

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
    """Elements of one token-head row of a cache: ``head_dim``, or ``head_dim + 2`` int8
    elements (codes and scale) for a quantized cache."""
    return head_dim + SCALE_BYTES if quantized else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache ``[..., row]`` stores (its last dimension less the scale bytes
    for an int8 cache)."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """K or V rows ``[..., head_dim]`` (any float dtype) -> int8 ``[..., head_dim + 2]``:
    each row's codes, then its float16 scale's 2 bytes (the module's formula)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale16 = (amax * (1.0 / QMAX)).clamp_max(SCALE_MAX).to(SCALE_DTYPE)
    s = scale16.float()
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    codes = torch.round(xf * inv).clamp_(-QMAX, QMAX).to(INT8)
    return torch.cat([codes, scale16.view(INT8)], dim=-1)


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The scales ``[...]`` of packed rows ``[..., head_dim + 2]``, as float32 (exact)."""
    return packed[..., -SCALE_BYTES:].contiguous().view(SCALE_DTYPE)[..., 0].float()


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[..., head_dim + 2]`` -> ``[..., head_dim]`` values ``code * scale``
    (float32 products, exact), in ``dtype``."""
    codes = packed[..., :-SCALE_BYTES].float()
    return (codes * scales(packed)[..., None]).to(dtype)
