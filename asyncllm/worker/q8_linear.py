"""GGUF's ``Q8_0`` linear layer: int8 codes with one scale per 32 input columns.

GGUF files of llama.cpp ship the LM head (or the token embedding table it is tied to) as
``Q8_0`` (ggml's ``block_q8_0``: a float16 ``d`` and 32 signed bytes, ``w = d * q``); no torch
kernel takes int8 codes with a scale per 32 columns (``aten._weight_int8pack_mm`` has one per
output channel). :class:`Q8Linear` keeps the codes (SmolLM2-135M's 49152 x 576 head: 31 MB
instead of 57 MB of bfloat16) and computes ``y = x W^T (+ b)`` as one op,
``asyncllm::q8_0_linear``, with float32 output whatever the model's dtype: the logits as the
kernels sum them, not rounded to bfloat16 (8 significant bits make exact ties of distinct
logits: the default model's first answer to "What is the capital of France?" tied "L" with
"The" at -1.9743 and greedy took "L'Étoile..."; the float32 sums put "The" ahead):

* up to :data:`MAX_ROWS` rows (decode of a few sequences, the last prompt token of a
  prefill): this module's C++ matrix-vector kernel over the codes, float32 arithmetic from
  the exact weights (a float16 ``d`` times a code is exact in float32). At one row it reads
  half the bytes of the bfloat16 head;
* more rows, bfloat16 where oneDNN's brgemm runs natively (AMX or AVX-512 BF16:
  :func:`mm_available`): ``q8_mm``, per block of 64 outputs the codes dequantized into a
  per-thread scratch (the values the dense head held: ``d * q`` rounded once to bfloat16)
  and multiplied there by brgemm, with float32 accumulation, no dense copy of the weight
  anywhere. W1 on the default model (batch 64, AMX): the head 6.6 -> 3.8 ms a step, and
  57 MB less resident memory than the packed copy (as fast as it on AVX-512 BF16);
* more rows otherwise (float32 models, CPUs without native bfloat16): oneDNN's GEMM on a
  packed copy of the weight in the model's dtype, made by :meth:`Q8Linear.pack`
  (:func:`asyncllm.worker.cpu_linear.pack_linears` calls it), as fast as the dense head was
  (its output widened to float32, after oneDNN's rounding to the model's dtype); without that
  copy or the kernel, the float32 weight dequantized per call.

The kernel is built once per machine by :mod:`asyncllm.worker.cpu_extension`
(``ASYNCLLM_Q8_KERNEL=0`` turns it off). :mod:`asyncllm.models.quantization` uses this layer
only where the kernel has its AVX-512 path (:func:`fast`); elsewhere the head stays dense.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.worker.cpu_extension import BRGEMM_BF16_SOURCE, CpuExtension
from asyncllm.worker.device import cpu_flags

__all__ = ["EXTENSION", "MAX_ROWS", "Q8Linear", "fast", "kernel"]

#: Q8_0's block: input columns per scale.
BLOCK = 32

#: Rows dequantized at a time for the dense copy (4096 x 576 float32: 9 MiB).
_DEQUANT_ROWS = 4096

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <vector>

constexpr int64_t BLOCK = 32;
constexpr int64_t PREFETCH = 8;  // rows ahead (4.5 KiB of SmolLM2's head)

#if defined(__AVX512F__)
#include <immintrin.h>
#define Q8_FAST 1
#else
#define Q8_FAST 0
#endif

// Y[r, n] for rows r < R of X [R, K] float32 and outputs n0 <= n < n1:
// sum over blocks b of S[n, b] * sum_j Q[n, 32b + j] X[r, 32b + j], in float32.
template <int R>
static void gemv_rows(const float* X, int64_t K, const int8_t* Q, const float* S, int64_t n0,
                      int64_t n1, float* Y, int64_t N) {
  const int64_t NB = K / BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = Q + n * K;
    const float* s = S + n * NB;
#if Q8_FAST
    // One core alone cannot keep enough cache misses in flight to reach the memory
    // bandwidth with the hardware prefetcher only: ask for rows a few ahead.
    if (n + PREFETCH < n1) {
      for (int64_t l = 0; l < K; l += 64)
        _mm_prefetch((const char*)(q + PREFETCH * K + l), _MM_HINT_T0);
      _mm_prefetch((const char*)(s + PREFETCH * NB), _MM_HINT_T0);
    }
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const __m512 w0 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + b * BLOCK))));
      const __m512 w1 = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + b * BLOCK + 16))));
      const __m512 sb = _mm512_set1_ps(s[b]);
      for (int r = 0; r < R; ++r) {
        const float* xb = X + r * K + b * BLOCK;
        __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));
        p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), p);
        tot[r] = _mm512_fmadd_ps(p, sb, tot[r]);
      }
    }
    for (int r = 0; r < R; ++r) Y[r * N + n] = _mm512_reduce_add_ps(tot[r]);
#else
    for (int r = 0; r < R; ++r) {
      const float* x = X + r * K;
      float t = 0.f;
      for (int64_t b = 0; b < NB; ++b) {
        float p = 0.f;
        for (int j = 0; j < BLOCK; ++j)
          p += static_cast<float>(q[b * BLOCK + j]) * x[b * BLOCK + j];
        t += s[b] * p;
      }
      Y[r * N + n] = t;
    }
#endif
  }
}

// y [M, N] float32 = xf [M, K] float32 (contiguous) W^T, W = q [N, K] int8 * s [N, K / 32].
void q8_gemv(const at::Tensor& xf, const at::Tensor& q, const at::Tensor& s, at::Tensor& y) {
  TORCH_CHECK(xf.scalar_type() == at::kFloat && xf.dim() == 2 && xf.is_contiguous() &&
                  q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  q.size(1) == xf.size(1) && q.size(1) % BLOCK == 0 &&
                  s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == q.size(0) && s.size(1) == q.size(1) / BLOCK &&
                  y.scalar_type() == at::kFloat && y.is_contiguous() &&
                  y.size(0) == xf.size(0) && y.size(1) == q.size(0),
              "q8_gemv: x float32 [M, K], q int8 [N, K], scales float32 [N, K / 32], "
              "y float32 [M, N], all contiguous, K % 32 == 0");
  const int64_t M = xf.size(0), K = xf.size(1), N = q.size(0);
  const float* X = xf.data_ptr<float>();
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = s.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 4) {
      const float* x = X + m * K;
      float* o = Y + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: gemv_rows<1>(x, K, Q, S, n0, n1, o, N); break;
        case 2: gemv_rows<2>(x, K, Q, S, n0, n1, o, N); break;
        case 3: gemv_rows<3>(x, K, Q, S, n0, n1, o, N); break;
        default: gemv_rows<4>(x, K, Q, S, n0, n1, o, N); break;
      }
    }
  });
}

// Whether this build has the AVX-512 kernel (the fast path; else portable scalar code).
bool q8_fast() { return Q8_FAST; }

// Rows n0 .. n0 + rows - 1 of W = q * s as bfloat16 [rows, K] (row-major): d * q is exact
// in float32 (11 by 8 significant bits), then rounded once to nearest even, the values of
// the dense bfloat16 copy. The next block's codes (`next`, or null) are prefetched.
static void dequant_rows(const int8_t* Q, const float* S, int64_t K, int64_t n0, int64_t rows,
                         const int8_t* next, at::BFloat16* out) {
  const int64_t NB = K / BLOCK;
  for (int64_t j = 0; j < rows; ++j) {
    const int8_t* q = Q + (n0 + j) * K;
    const float* s = S + (n0 + j) * NB;
    at::BFloat16* o = out + j * K;
#if Q8_FAST && defined(__AVX512BF16__)
    if (next != nullptr)
      for (int64_t l = 0; l < K; l += 64)
        _mm_prefetch((const char*)(next + j * K + l), _MM_HINT_T1);
    auto codes16 = [](const int8_t* c) {  // 16 codes as float32
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c)));
    };
    for (int64_t b = 0; b < NB; ++b) {
      const __m512 sb = _mm512_set1_ps(s[b]);
      const __m512 w0 = _mm512_mul_ps(codes16(q + b * BLOCK), sb);
      const __m512 w1 = _mm512_mul_ps(codes16(q + b * BLOCK + 16), sb);
      _mm512_storeu_si512(o + b * BLOCK, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
#else
    for (int64_t k = 0; k < K; ++k) o[k] = c10::BFloat16(static_cast<float>(q[k]) * s[k / BLOCK]);
#endif
  }
}

// The many-row path is there: oneDNN's bfloat16 brgemm runs (AMX or AVX-512 BF16).
bool q8_mm_available() { return brgemm_bf16_runs(); }

// y [M, N] float32 = x [M, K] bfloat16 W^T, W = q [N, K] int8 * s [N, K / 32], without a dense
// copy of W: per block of 64 output features, W's rows are dequantized into the thread's
// scratch [64, K] (72 KiB at K = 576), which is brgemm's A (row-major, no packing); x^T,
// packed once per call in brgemm's VNNI layout [K / 2][M][2], is B; C = W_blk x^T [64, M
// tile] (float32 accumulation over all of K) is stored transposed into y.
at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
                  q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  q.size(1) == x.size(1) && q.size(1) % BLOCK == 0 &&
                  s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == q.size(0) && s.size(1) == q.size(1) / BLOCK,
              "q8_mm: x bfloat16 [M, K], q int8 [N, K], scales float32 [N, K / 32], "
              "all contiguous, K % 32 == 0");
  TORCH_CHECK(q8_mm_available(), "q8_mm: oneDNN's bfloat16 brgemm does not run here");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NBLK = (N + 63) / 64;
  constexpr int64_t MT = 64;  // rows per brgemm call (C is [64, MT] float32: 16 KiB)
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  // x^T as 32-bit words (column pairs): xt[k / 2][r] = (x[r, k], x[r, k + 1]).
  at::Tensor xt = at::empty({K / 2, M, 2}, x.options());
  {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
    uint32_t* dst = reinterpret_cast<uint32_t*>(xt.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < M; ++r)
      for (int64_t p = 0; p < K / 2; ++p) dst[p * M + r] = src[r * (K / 2) + p];
  }
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = s.data_ptr<float>();
  const at::BFloat16* B = xt.data_ptr<at::BFloat16>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NBLK, 1, [&](int64_t begin, int64_t end) {
    thread_local at::Tensor abuf, cbuf;  // grow to the largest K seen
    if (!abuf.defined() || abuf.numel() < 64 * K) abuf = at::empty({64 * K}, at::kBFloat16);
    if (!cbuf.defined()) cbuf = at::empty({64 * MT}, at::kFloat);
    at::BFloat16* A = abuf.data_ptr<at::BFloat16>();
    float* C = cbuf.data_ptr<float>();
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 64, rows = std::min<int64_t>(64, N - n0);
      dequant_rows(Q, S, K, n0, rows, blk + 1 < end ? Q + (n0 + 64) * K : nullptr, A);
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = std::min(MT, M - m0);
        at::native::cpublas::brgemm(rows, mt, K, K, M, mt, false, A, B + m0 * 2, C, true);
        for (int64_t r = 0; r < mt; ++r) {  // y[m0 + r, n0 + j] = C[j, r]
          float* o = Y + (m0 + r) * N + n0;
          int64_t j = 0;
#if Q8_FAST
          const __m512i idx = _mm512_mullo_epi32(
              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
              _mm512_set1_epi32(static_cast<int>(mt)));
          for (; j + 16 <= rows; j += 16)
            _mm512_storeu_ps(o + j, _mm512_i32gather_ps(idx, C + j * mt + r, 4));
#endif
          for (; j < rows; ++j) o[j] = C[j * mt + r];
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}
"""

CFLAGS = ("-O3", "-march=native", "-fopenmp")
ENV_SWITCH = "ASYNCLLM_Q8_KERNEL"

EXTENSION = CpuExtension(
    "asyncllm_q8_linear",
    BRGEMM_BF16_SOURCE + _SOURCE,
    ["q8_gemv", "q8_fast", "q8_mm", "q8_mm_available"],
    CFLAGS,
    "CPU Q8_0 kernel",
    ENV_SWITCH,
)
"""The kernel's build-once extension."""

#: Calls with more rows than this take the many-row path (``q8_mm`` or the packed dense
#: copy); up to this many, the matrix-vector kernel, whose time grows with the rows.
MAX_ROWS = 8


def kernel(wait: bool = True) -> Any:
    """The built extension, or None where it is switched off or cannot be built (with
    ``wait=False`` also while it is being built: :meth:`CpuExtension.ready`)."""
    if not EXTENSION.enabled():
        return None
    return EXTENSION.load() if wait else EXTENSION.ready()


def fast() -> bool:
    """The kernel has its AVX-512 path here (the one worth using), or will have once its
    background build is done (``-march=native`` and the CPU's ``avx512f``): never waits."""
    mod = kernel(wait=False)
    if mod is not None:
        return bool(mod.q8_fast())
    return EXTENSION.expected() and "avx512f" in cpu_flags()


def mm_available() -> bool:
    """The many-row kernel (``q8_mm``: dequantize per block of 64 outputs + oneDNN's
    brgemm, bfloat16) runs here, or will once built (native bfloat16 in the CPU's flags);
    else more than :data:`MAX_ROWS` rows take a packed dense copy (:meth:`Q8Linear.pack`).
    Never waits."""
    mod = kernel(wait=False)
    if mod is not None:
        return bool(mod.q8_mm_available())
    return EXTENSION.expected() and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _mm_runs(mod: Any) -> bool:
    return mod is not None and bool(mod.q8_mm_available())


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * q`` per block of 32 columns: float32 [out, in] (exact)."""
    out, cols = q.shape
    return (q.view(out, -1, BLOCK).float() * scale[..., None]).view(out, cols)


@torch.library.custom_op("asyncllm::q8_0_linear", mutates_args=())
def q8_0_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    max_rows: int,
) -> torch.Tensor:
    """``x [..., in]`` (float32 or bfloat16) -> float32 ``[..., out]``: :class:`Q8Linear`'s
    forward (one op for eager steps and compiled graphs alike; see the module docstring for
    the paths)."""
    from asyncllm.worker.cpu_linear import packed_linear_op

    out, cols = q.shape
    rows = x.reshape(-1, cols)
    mod = kernel(wait=False)
    if rows.shape[0] > max_rows and x.dtype == torch.bfloat16 and _mm_runs(mod):
        y: torch.Tensor = mod.q8_mm(rows.contiguous(), q, scale).view(*x.shape[:-1], out)
    elif packed is not None and (rows.shape[0] > max_rows or mod is None):
        dense: torch.Tensor = packed_linear_op(x, packed, bias, cols, out)
        return dense.float()
    elif mod is None:
        y = nn.functional.linear(x.float(), dequantize(q, scale))
    else:
        y = torch.empty((rows.shape[0], out), dtype=torch.float32)
        mod.q8_gemv(rows.float().contiguous(), q, scale, y)
        y = y.view(*x.shape[:-1], out)
    return y if bias is None else y + bias.float()


@q8_0_linear.register_fake
def _(x: torch.Tensor, q: torch.Tensor, *rest: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], q.shape[0]), dtype=torch.float32)


class Q8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` as GGUF ``Q8_0``: int8 codes and a float scale per 32 input
    columns (``w = scale * q``), run by ``asyncllm::q8_0_linear``; ``y`` is float32 (the LM
    head's logits as summed, see the module docstring).

    Args:
        q: int8-range codes [out, in], ``in`` a multiple of 32.
        scale: float [out, in / 32] (GGUF's float16 ``d``, kept exact in float32).
        bias: [out] or None (added in float32).
        dtype: the model's dtype: the packed copy's (:meth:`pack`) and :attr:`weight`'s.

    Raises:
        ValueError: ``in`` not a multiple of 32, or ``scale`` not [out, in / 32].
    """

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    #: The oneDNN-packed dense copy (:meth:`pack`), or None.
    packed: torch.Tensor | None = None
    #: The dense weight eager calls use while the kernel is not there (built in the
    #: background on a fresh machine: the per-call dequantization of the default model's
    #: head cost ~100 ms a token there), dropped once it is.
    _interim: torch.Tensor | None = None

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % BLOCK or tuple(scale.shape) != (q.shape[0], q.shape[1] // BLOCK):
            raise ValueError(
                f"Q8_0 weight [{self.out_features}, {self.in_features}] needs an input width "
                f"that is a multiple of {BLOCK} and scales [out, in / {BLOCK}], got "
                f"{list(scale.shape)}"
            )
        self.out_dtype = dtype
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight in the model's dtype (a dense copy: not the hot path),
        made a few thousand rows at a time (no float32 copy of the whole weight)."""
        out = torch.empty(self.out_features, self.in_features, dtype=self.out_dtype)
        for i in range(0, self.out_features, _DEQUANT_ROWS):
            rows = slice(i, i + _DEQUANT_ROWS)
            out[rows] = dequantize(self.q[rows], self.scale[rows])
        return out

    def pack(self) -> None:
        """Make the oneDNN-packed dense copy that calls of more than :data:`MAX_ROWS` rows
        use (in the model's dtype; idempotent); none for bfloat16 where ``q8_mm`` runs.

        Raises:
            RuntimeError: oneDNN refuses the reorder.
        """
        from asyncllm.worker.cpu_linear import PACK_HINT_ROWS

        if self.packed is None and not (self.out_dtype == torch.bfloat16 and mm_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_HINT_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None and not torch.compiler.is_compiling():
            if kernel(wait=False) is None:  # being built (or unbuildable): a dense copy
                if self._interim is None:
                    self._interim = self.weight
                d = nn.functional.linear(x, self._interim).float()
                return d if self.bias is None else d + self.bias.float()
            self._interim = None
        y: torch.Tensor = q8_0_linear(x, self.q, self.scale, self.packed, self.bias, MAX_ROWS)
        return y

    def extra_repr(self) -> str:
        packed = ", packed copy" if self.packed is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0{packed}"
