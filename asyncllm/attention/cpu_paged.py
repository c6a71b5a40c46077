"""A C++ decode attention over the paged cache, for CPUs (the "cpu" attention backend).

The torch path (:mod:`asyncllm.attention.torch_paged`) gathers every decoding sequence's K
and V blocks into new tensors, then runs ``scaled_dot_product_attention`` on them: each
layer writes and reads the whole context twice more than attention needs. At W1's batch of
64 that is most of the attention time; at W2's 570-token contexts it rivals the weights.
This module's kernel reads K and V in place through the block tables instead, once, with an
online softmax over a tile of up to 16 positions of a block at a time, for the ``G`` query
heads that share a KV head together (vLLM's CPU backend does the same in its own C++).
Chunks of more than one token (prefill) still go through the torch path.

Caches and queries are float32 or bfloat16 (the engine's dtype); all the arithmetic is in
float32 either way (a bfloat16 element widens exactly to float32 with a shift), and the
output is rounded to the query's dtype, as the torch path's ``scaled_dot_product_attention``
does. A bfloat16 cache is half the bytes to read. Each K and V row is widened once for the
``G`` query heads that read it; where the compiler targets AVX-512 and the head size is 64,
80 or 128, intrinsics reduce a tile's 16 dot products per head into one vector and keep the
heads' output accumulators in registers over the tile (elsewhere portable, auto-vectorized
C++ computes the same, up to summation order). ``benchmarks/attention_kernel.py`` times it
against an earlier revision.

The kernel is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (g++ and
ninja; 30-60 s, once per machine: :mod:`asyncllm.worker.cpu_extension` keeps the build
in asyncllm's cache directory, keyed by the source, flags, torch and Python, and later
processes import it in milliseconds). Where it cannot be built, or with
``ASYNCLLM_CPU_ATTENTION_KERNEL=0``, the engine keeps the torch path, with one log line.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.attention.backend_registry import AttentionBackend
from asyncllm.attention.torch_paged import PagedAttentionPlan, paged_attention, write_kv_cache
from asyncllm.worker.cpu_extension import CpuExtension

ENV_SWITCH = "ASYNCLLM_CPU_ATTENTION_KERNEL"

#: The cache dtypes the kernel reads (float16 goes through the torch path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// An element of the cache or query as float: bfloat16 is the top half of a float32, so the
// conversion is a shift the compiler vectorizes (vpmovzxwd + vpslld), no rounding involved.
static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// A float to the output type; at::BFloat16 rounds to nearest even, as torch's .to() does.
template <typename T>
static inline T from_f(float x) { return static_cast<T>(x); }

// Positions per tile: a tile's scores are computed (one vector of 16) before its softmax.
constexpr int64_t TILE = 16;

// The online softmax of one query head over its next n scores sg[0..n): sg becomes the
// weights exp(s - max); returns the factor the head's earlier accumulator is scaled by.
static inline float softmax_update(float* __restrict sg, int64_t n, float& m, float& l) {
  float mx = m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float c = std::exp(m - mx);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    sg[t] = std::exp(sg[t] - mx);  // vectorized (libmvec) under -ffast-math
    sum += sg[t];
  }
  l = l * c + sum;
  m = mx;
  return c;
}

// Prefetch n rows of D elements (row stride `stride`) at x, unless x is null: the next
// block's, whose address is data-dependent (the block table), so the hardware prefetcher
// cannot run ahead of a block boundary.
template <typename T>
static inline void prefetch_rows(const T* x, int64_t stride, int64_t n, int64_t D) {
  constexpr int64_t LINE = 64 / sizeof(T);  // elements per 64-byte cache line
  if (x != nullptr)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t e = 0; e < D; e += LINE) __builtin_prefetch(x + t * stride + e);
}

// n <= TILE rows of D elements (row stride `stride`) as float: the rows themselves for a
// float cache, else widened once into buf [n, D] (not once per query head); *rs: row stride.
template <typename T>
static inline const float* rows_f(const T* x, int64_t stride, int64_t n, int64_t D,
                                  float* __restrict buf, int64_t* rs) {
  if constexpr (std::is_same<T, float>::value) {
    *rs = stride;
    return x;
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) buf[t * D + d] = to_f(x[t * stride + d]);
    *rs = D;
    return buf;
  }
}

// One tile of one KV head for its G query heads: n <= TILE positions whose K and V rows
// start at k and v (row stride `stride`); qv [G, D] the scaled queries, acc [G, D], m [G],
// l [G] the heads' running state; buf [TILE, D], s [G, TILE], c [G] scratch. Portable C++
// (auto-vectorized); tile_avx512 below is the same with the G heads' accumulators in
// registers.
template <typename T, int64_t DC>
static void tile_portable(const float* __restrict qv, const T* k, const T* v, const T* kn,
                          const T* vn, int64_t stride,
                          int64_t n, int64_t G, int64_t D_, float* __restrict buf,
                          float* __restrict s, float* __restrict c, float* __restrict acc,
                          float* __restrict m, float* __restrict l) {
  const int64_t D = DC > 0 ? DC : D_;
  int64_t ks, vs;
  prefetch_rows(kn, stride, n, D);
  const float* kr = rows_f(k, stride, n, D, buf, &ks);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t) {
      const float* qg = qv + g * D;
      const float* kt = kr + t * ks;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
      s[g * TILE + t] = dot;
    }
  for (int64_t g = 0; g < G; ++g) {
    c[g] = softmax_update(s + g * TILE, n, m[g], l[g]);
    float* ag = acc + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ag[d] *= c[g];
  }
  prefetch_rows(vn, stride, n, D);
  const float* vr = rows_f(v, stride, n, D, buf, &vs);  // K's rows are no longer needed
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float e = s[g * TILE + t];
      const float* vt = vr + t * vs;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += e * vt[d];
    }
}

#if defined(__AVX512F__)
// 16 elements as float (a bfloat16 widens exactly: zero-extend, shift left 16).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 unpack_add_pd(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 lanes_add(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
// r[t] = the sum of p[t]'s 16 elements, for t < 16: a transposing reduction tree (30
// shuffles, 15 adds) instead of 16 horizontal sums.
static inline __m512 sum16(const __m512* p) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) y[i] = unpack_add_pd(x[2 * i], x[2 * i + 1]);  // lane sums
  return lanes_add(lanes_add(y[0], y[1]), lanes_add(y[2], y[3]));  // across the 4 lanes
}

// acc [GN, D] = acc * c + p . V for GN query heads (p [GN, TILE] their weights), the
// accumulators in registers for the tile, each V row widened once for the GN heads.
template <int GN, int NC, typename T>
static inline void accumulate(const T* v, int64_t stride, int64_t n, const float* p,
                              const float* c, float* acc) {
  constexpr int64_t D = 16 * NC;
  __m512 a[GN][NC];
  for (int g = 0; g < GN; ++g) {
    const __m512 cg = _mm512_set1_ps(c[g]);
    for (int i = 0; i < NC; ++i) a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * i), cg);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 e[GN];
    for (int g = 0; g < GN; ++g) e[g] = _mm512_set1_ps(p[g * TILE + t]);
    for (int i = 0; i < NC; ++i) {
      const __m512 x = load16(v + t * stride + 16 * i);
      for (int g = 0; g < GN; ++g) a[g][i] = _mm512_fmadd_ps(e[g], x, a[g][i]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < NC; ++i) _mm512_storeu_ps(acc + g * D + 16 * i, a[g][i]);
}

// tile_portable with AVX-512 intrinsics, D = 16 * NC: the scores of the tile's 16
// positions reduced into one vector per query head (sum16), the V accumulation of up to GG
// query heads at once in registers.
template <typename T, int NC>
static void tile_avx512(const float* __restrict qv, const T* k, const T* v, const T* kn,
                        const T* vn, int64_t stride,
                        int64_t n, int64_t G, float* __restrict buf, float* __restrict s,
                        float* __restrict c, float* __restrict acc, float* __restrict m,
                        float* __restrict l) {
  constexpr int64_t D = 16 * NC;
  constexpr int GG = NC <= 4 ? 4 : (NC <= 8 ? 16 / NC : 1);  // GG * NC accumulators <= 16
  const float* kr;
  int64_t ks;
  constexpr int64_t LINE = 64 / sizeof(T);
  if constexpr (std::is_same<T, float>::value) {
    prefetch_rows(kn, stride, n, D);
    kr = k;
    ks = stride;
  } else {
    for (int64_t t = 0; t < n; ++t) {
      if (kn != nullptr)
        for (int64_t e = 0; e < D; e += LINE) __builtin_prefetch(kn + t * stride + e);
      for (int i = 0; i < NC; ++i)
        _mm512_storeu_ps(buf + t * D + 16 * i, load16(k + t * stride + 16 * i));
    }
    kr = buf;
    ks = D;
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512 qg[NC], P[TILE];
    for (int i = 0; i < NC; ++i) qg[i] = _mm512_loadu_ps(qv + g * D + 16 * i);
    for (int64_t t = 0; t < TILE; ++t) {
      if (t < n) {
        __m512 x = _mm512_mul_ps(qg[0], _mm512_loadu_ps(kr + t * ks));
        for (int i = 1; i < NC; ++i)
          x = _mm512_fmadd_ps(qg[i], _mm512_loadu_ps(kr + t * ks + 16 * i), x);
        P[t] = x;
      } else {
        P[t] = _mm512_setzero_ps();
      }
    }
    _mm512_storeu_ps(s + g * TILE, sum16(P));
    c[g] = softmax_update(s + g * TILE, n, m[g], l[g]);
  }
  prefetch_rows(vn, stride, n, D);
  for (int64_t g0 = 0; g0 < G; g0 += GG) {
    const float *p = s + g0 * TILE, *cg = c + g0;
    float* ag = acc + g0 * D;
    switch (std::min<int64_t>(GG, G - g0)) {
      case 1: accumulate<1, NC>(v, stride, n, p, cg, ag); break;
      case 2: if constexpr (GG >= 2) accumulate<2, NC>(v, stride, n, p, cg, ag); break;
      case 3: if constexpr (GG >= 3) accumulate<3, NC>(v, stride, n, p, cg, ag); break;
      default: if constexpr (GG >= 4) accumulate<4, NC>(v, stride, n, p, cg, ag); break;
    }
  }
}
#endif

// out[b, hq, :] = softmax(q[b, hq] . K^T * scale) V over positions [0, lens[b]) of sequence b,
// read through its block table; KV head hq / G serves query head hq. q: [B, H, D] (rows may be
// strided), caches [N, bs, Hkv, D] contiguous, tables [B, M] int64, lens [B] int64,
// out [B, H, D] contiguous; q, caches and out all of type T (float or bfloat16), all the
// arithmetic in float32. DC > 0 fixes D at compile time (unrolled loops, and the AVX-512
// tiles where DC is a multiple of 16 and the compiler targets AVX-512); 0 reads it.
template <typename T, int64_t DC>
static void decode(const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& tables,
                   const at::Tensor& lens, float sc, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = DC > 0 ? DC : q.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv, M = tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const T* Q = q.data_ptr<T>();
  const T* K = key_cache.data_ptr<T>();
  const T* V = value_cache.data_ptr<T>();
  const int64_t* BT = tables.data_ptr<int64_t>();
  const int64_t* L = lens.data_ptr<int64_t>();
  T* O = out.data_ptr<T>();
  const int64_t tok = Hkv * D, blk = bs * tok;
  // A work item is a sequence with all its KV heads (each block's rows are read whole and
  // in order) or, with fewer sequences than threads, one KV head of one sequence.
  const int64_t per = B >= at::get_num_threads() ? Hkv : 1;
  at::parallel_for(0, B * (Hkv / per), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qv_(H * D), acc_(H * D), buf_(TILE * D), s_(G * TILE), c_(G), m_(H),
        l_(H);
    float* __restrict qv = qv_.data();
    float* __restrict acc = acc_.data();
    float *m = m_.data(), *l = l_.data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (Hkv / per), h0 = (i % (Hkv / per)) * per, h1 = h0 + per;
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
        const T* src = Q + b * qs0 + hq * qs1;
        for (int64_t d = 0; d < D; ++d) qv[hq * D + d] = to_f(src[d * qs2]) * sc;
        for (int64_t d = 0; d < D; ++d) acc[hq * D + d] = 0.f;
        m[hq] = -1e30f;  // finite: exp(m - max) is 0 on the first block
        l[hq] = 0.f;
      }
      const int64_t len = L[b];
      for (int64_t j = 0; j * bs < len; ++j) {
        const int64_t n = std::min(bs, len - j * bs);
        const T* kb = K + BT[b * M + j] * blk;
        const T* vb = V + BT[b * M + j] * blk;
        const bool more = (j + 1) * bs < len;
        const T* kn = more ? K + BT[b * M + j + 1] * blk : nullptr;
        const T* vn = more ? V + BT[b * M + j + 1] * blk : nullptr;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t t0 = 0; t0 < n; t0 += TILE) {
            const int64_t off = t0 * tok + h * D, nt = std::min(TILE, n - t0);
            // The next block's rows t0.. of this head (as many as this tile has, or none).
            const T* kp = kn != nullptr && t0 < len - (j + 1) * bs ? kn + off : nullptr;
            const T* vp = vn != nullptr && t0 < len - (j + 1) * bs ? vn + off : nullptr;
            float *a = acc + h * G * D, *mh = m + h * G, *lh = l + h * G;
#if defined(__AVX512F__)
            if constexpr (DC > 0 && DC % 16 == 0)
              tile_avx512<T, DC / 16>(qv + h * G * D, kb + off, vb + off, kp, vp, tok, nt, G,
                                      buf_.data(), s_.data(), c_.data(), a, mh, lh);
            else
#endif
              tile_portable<T, DC>(qv + h * G * D, kb + off, vb + off, kp, vp, tok, nt, G, D,
                                   buf_.data(), s_.data(), c_.data(), a, mh, lh);
          }
      }
      for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
        T* dst = O + (b * H + hq) * D;
        const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[hq * D + d] * inv);
      }
    }
  });
}

template <typename T>
static void dispatch(const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& tables,
                     const at::Tensor& lens, float sc, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode<T, 64>(q, key_cache, value_cache, tables, lens, sc, out);
    case 80: return decode<T, 80>(q, key_cache, value_cache, tables, lens, sc, out);
    case 128: return decode<T, 128>(q, key_cache, value_cache, tables, lens, sc, out);
    default: return decode<T, 0>(q, key_cache, value_cache, tables, lens, sc, out);
  }
}

void paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, at::Tensor& out) {
  const float sc = static_cast<float>(scale);
  if (key_cache.scalar_type() == at::kBFloat16)
    return dispatch<at::BFloat16>(q, key_cache, value_cache, tables, lens, sc, out);
  return dispatch<float>(q, key_cache, value_cache, tables, lens, sc, out);
}

// Rows 0..n-1 of x [R, Hkv, D] (any strides) to the flat slots S of cache [N, bs, Hkv, D]
// (contiguous); a negative slot is skipped.
template <typename T>
static void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* S, int64_t n) {
  const int64_t Hkv = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const T* X = x.data_ptr<T>();
  T* C = cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    if (S[i] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) C[(S[i] * Hkv + h) * D + d] = X[i * s0 + h * s1 + d * s2];
  }
}

// One decode step of a layer: the new K/V rows (k, v [R, Hkv, D]) of the n = lens.size(0)
// sequences written at their slots [n], then paged_decode of q rows 0..n-1 into out [R, H, D]
// (contiguous); rows n..R-1 are padding: out rows zero, nothing written.
void paged_write_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n = lens.size(0), R = q.size(0);
  const auto T = key_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == T && k.scalar_type() == T && v.scalar_type() == T &&
                  value_cache.scalar_type() == T && out.scalar_type() == T &&
                  (T == at::kFloat || T == at::kBFloat16),
              "paged_write_decode: q, k, v, caches and out must share float32 or bfloat16");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous() &&
                  k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() &&
                  k.size(0) >= n && R >= n && out.sizes() == q.sizes() &&
                  k.size(1) == key_cache.size(2) && k.size(2) == key_cache.size(3),
              "paged_write_decode: shapes do not match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() >= n,
              "paged_write_decode: slots must be int64 with a slot per sequence");
  const int64_t* S = slots.data_ptr<int64_t>();
  at::Tensor o = out.narrow(0, 0, n);
  if (T == at::kBFloat16) {
    write_rows<at::BFloat16>(k, key_cache, S, n);
    write_rows<at::BFloat16>(v, value_cache, S, n);
  } else {
    write_rows<float>(k, key_cache, S, n);
    write_rows<float>(v, value_cache, S, n);
  }
  paged_decode(q.narrow(0, 0, n), key_cache, value_cache, tables, lens, scale, o);
  if (R > n) out.narrow(0, n, R - n).zero_();
}
"""

NAME = "asyncllm_cpu_paged"
# -ffast-math: lets GCC vectorize expf through glibc's libmvec and reassociate the sums
# (the kernel keeps every value finite: the running max starts at -1e30, not -inf).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")

EXTENSION = CpuExtension(
    NAME,
    _SOURCE,
    ["paged_decode", "paged_write_decode"],
    CFLAGS,
    "CPU attention kernel",
    ENV_SWITCH,
)
"""The kernel's build-once extension (:mod:`asyncllm.worker.cpu_extension`)."""


def enabled() -> bool:
    """Not switched off with ``ASYNCLLM_CPU_ATTENTION_KERNEL=0``."""
    return EXTENSION.enabled()


def build_dir() -> pathlib.Path:
    """Where the kernel is built (see :meth:`CpuExtension.build_dir`)."""
    return EXTENSION.build_dir()


def load() -> Any:
    """The compiled extension, building it on first use; None where it cannot be built
    (the reason is logged once and kept in :func:`failure`)."""
    return EXTENSION.load()


def failure() -> str | None:
    """Why the kernel could not be built, or None."""
    return EXTENSION.failure()


def available() -> bool:
    """The kernel is enabled and builds (building it now if needed)."""
    return EXTENSION.available()


@dataclass(frozen=True)
class CpuPagedPlan:
    """The torch plan (prefill chunks) plus the decodes' block tables and lengths."""

    base: PagedAttentionPlan
    prefill_only: PagedAttentionPlan
    dec_lens: torch.Tensor | None  # [Bd] int64 context lengths of the decodes

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> CpuPagedPlan:
        base = PagedAttentionPlan.build(query_lens, seq_lens, block_tables, block_size, device)
        lens = [s for q, s in zip(query_lens, seq_lens, strict=True) if q == 1]
        dec_lens = torch.tensor(lens, dtype=torch.long, device=device) if lens else None
        return CpuPagedPlan(
            base, PagedAttentionPlan(base.num_tokens, None, base.prefills), dec_lens
        )


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[Bd, H, D]`` attention of one query token per sequence over its paged context, in
    the query's dtype.

    Raises:
        RuntimeError: the kernel is not available.
        ValueError: the query and caches differ in dtype, or it is not one of
            :data:`KERNEL_DTYPES`.
    """
    if not (query.dtype == key_cache.dtype == value_cache.dtype in KERNEL_DTYPES):
        raise ValueError(
            f"query {query.dtype} and caches {key_cache.dtype}/{value_cache.dtype} must share "
            f"one of {KERNEL_DTYPES}"
        )
    mod = load()
    if mod is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {failure()}")
    out = torch.empty(query.shape, dtype=query.dtype)
    mod.paged_decode(query, key_cache, value_cache, block_tables, lens, float(scale), out)
    return out


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: CpuPagedPlan,
    scale: float,
) -> torch.Tensor:
    """Like :func:`~asyncllm.attention.torch_paged.paged_attention`; decodes of float32 or
    bfloat16 caches on CPU (the query of the same dtype) go through the kernel, everything
    else through the torch path."""
    d = plan.base.decodes
    if (
        d is None
        or plan.dec_lens is None
        or key_cache.dtype not in KERNEL_DTYPES
        or query.dtype != key_cache.dtype
        or value_cache.dtype != key_cache.dtype
        or key_cache.device.type != "cpu"
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
    ):
        return paged_attention(query, key_cache, value_cache, plan.base, scale)
    q = query if d.identity else query[d.rows]
    o = decode_attention(q, key_cache, value_cache, d.block_tables, plan.dec_lens, scale)
    if d.identity:
        return o
    out = paged_attention(query, key_cache, value_cache, plan.prefill_only, scale)
    out[d.rows] = o
    return out


def write_and_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: CpuPagedPlan,
    scale: float,
) -> torch.Tensor | None:
    """A decode-only step's whole attention layer in one kernel call: the new K/V written at
    ``slot_mapping`` and every sequence's one query attended, ``query [R, H, D]``,
    ``key/value [R, Hkv, D]`` -> ``[R, H, D]``, rows past the plan's sequences (padding of
    a compiled step) zero and not written. None where the step has prefills or the kernel
    cannot run it (the caller writes and attends separately then)."""
    d = plan.base.decodes
    if (
        plan.base.prefills
        or d is None
        or not d.identity
        or plan.dec_lens is None
        or not (query.dtype == key.dtype == key_cache.dtype == value_cache.dtype)
        or key_cache.dtype not in KERNEL_DTYPES
        or key_cache.device.type != "cpu"
    ):
        return None
    mod = load()
    if mod is None:
        return None
    out = torch.empty(query.shape, dtype=query.dtype)
    mod.paged_write_decode(
        query, key, value, key_cache, value_cache, slot_mapping, d.block_tables,
        plan.dec_lens, float(scale), out,
    )  # fmt: skip
    return out


CPU_BACKEND = AttentionBackend(
    "cpu", CpuPagedPlan.build, write_kv_cache, paged_attention_cpu, write_and_decode
)
"""The torch path with decodes through the C++ kernel ("auto" on CPU when it builds)."""

__all__ = [
    "CPU_BACKEND",
    "CpuPagedPlan",
    "available",
    "decode_attention",
    "enabled",
    "failure",
    "load",
    "paged_attention_cpu",
    "write_and_decode",
    "write_kv_cache",
]
