#include "common.h"
#include "python_module.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cstdint>
#include <vector>

constexpr int64_t BLOCK = 32;
constexpr int64_t PREFETCH = 8;
// q8_mm_f32 multiplies a block by oneDNN's float32 brgemm up to this many rows, by at::mm
// above (one core, 640x2048 at 512 rows: brgemm 2.1-2.4x the dense GEMM's time, at::mm on the
// dequantized blocks 1.1-1.2x; at 64 rows brgemm 0.65-0.85x: benchmarks/q8_linears.py).
constexpr int64_t Q8_F32_BRGEMM_ROWS = 128;  // rows ahead (4.5 KiB of SmolLM2's head)

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

// y[r, j] = C[j, r] for r < mt, j < rows: a brgemm tile C [rows, mt] (outputs x rows of x)
// stored into y (row stride N) transposed.
static inline void store_transposed(const float* C, int64_t mt, int64_t rows, float* y,
                                    int64_t N) {
  for (int64_t r = 0; r < mt; ++r) {
    float* o = y + r * N;
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
        store_transposed(C, mt, rows, Y + m0 * N + n0, N);
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return y;
}

// Rows n0 .. n0 + rows - 1 of W = q * s as float32 [rows, K] (row-major), exactly: a float16
// d times a code is exact in float32, so these are gguf's dequantized values bit for bit.
static void dequant_rows_f32(const int8_t* Q, const float* S, int64_t K, int64_t n0,
                             int64_t rows, const int8_t* next, float* out, int64_t ld) {
  const int64_t NB = K / BLOCK;
  for (int64_t j = 0; j < rows; ++j) {
    const int8_t* q = Q + (n0 + j) * K;
    const float* s = S + (n0 + j) * NB;
    float* o = out + j * ld;
#if Q8_FAST
    if (next != nullptr)
      for (int64_t l = 0; l < K; l += 64)
        _mm_prefetch((const char*)(next + j * K + l), _MM_HINT_T1);
    for (int64_t b = 0; b < NB; ++b) {
      const __m512 sb = _mm512_set1_ps(s[b]);
      for (int h = 0; h < 2; ++h) {
        const __m512 c = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + b * BLOCK + 16 * h))));
        _mm512_storeu_ps(o + b * BLOCK + 16 * h, _mm512_mul_ps(c, sb));
      }
    }
#else
    (void)next;
    for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(q[k]) * s[k / BLOCK];
#endif
  }
}

// y [M, N] float32 = x [M, K] float32 W^T, W = q [N, K] int8 * s [N, K / 32], without a dense
// copy of W (a float32 model's many-row path): per block of 64 output features, W's rows are
// dequantized exactly into the thread's scratch [64, K] float32 (160 KiB at K = 640: L2), which
// is brgemm's A; x^T [K, M], made once per call, is B; C = W_blk x^T [64, MT] (float32
// throughout: x W^T of the exact weights up to float32 summation order) is stored transposed
// into y. Above brgemm_rows rows (Q8_F32_BRGEMM_ROWS for q8_mm_f32), or where oneDNN's float32
// brgemm does not run, at::mm multiplies the same scratch (single-threaded: inside the loop).
// Both A's and B's rows are padded by 64 bytes: at K = 2048 (8 KiB rows) or M = 512, rows a
// power of two apart share the L1's sets, and 512 rows of 640x2048 ran 3.5x the dense GEMM.
at::Tensor q8_mm_f32_with(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s,
                          int64_t brgemm_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() &&
                  q.size(1) == x.size(1) && q.size(1) % BLOCK == 0 &&
                  s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
                  s.size(0) == q.size(0) && s.size(1) == q.size(1) / BLOCK,
              "q8_mm_f32: x float32 [M, K], q int8 [N, K], scales float32 [N, K / 32], "
              "all contiguous, K % 32 == 0");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), NBLK = (N + 63) / 64;
  constexpr int64_t MT = 64;  // rows per brgemm call (C is [64, MT] float32: 16 KiB)
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool brgemm = M <= brgemm_rows && brgemm_f32_runs();
  const int64_t lda = K + 16, ldb = M + 16;  // padded rows (see above)
  at::Tensor xt;  // [K, ldb]: x^T, its first M columns
  if (brgemm) {
    xt = at::empty({K, ldb}, x.options());
    xt.narrow(1, 0, M).copy_(x.t());
  }
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = s.data_ptr<float>();
  const float* B = brgemm ? xt.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NBLK, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> abuf, cbuf;  // grow to the largest K seen
    if (static_cast<int64_t>(abuf.size()) < 64 * lda) abuf.resize(64 * lda);
    if (cbuf.size() < static_cast<size_t>(64 * MT)) cbuf.resize(64 * MT);
    float* A = abuf.data();
    float* C = cbuf.data();
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * 64, rows = std::min<int64_t>(64, N - n0);
      dequant_rows_f32(Q, S, K, n0, rows, blk + 1 < end ? Q + (n0 + 64) * K : nullptr, A, lda);
      if (!brgemm) {
        at::Tensor out = at::from_blob(Y + n0, {M, rows}, {N, 1}, y.options());
        at::mm_out(out, x, at::from_blob(A, {rows, K}, {lda, 1}, y.options()).t());
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = std::min(MT, M - m0);
        at::native::cpublas::brgemm(rows, mt, K, lda, ldb, mt, false, A, B + m0, C, false);
        store_transposed(C, mt, rows, Y + m0 * N + n0, N);
      }
    }
    if (brgemm) at::native::cpublas::brgemm_release(false);
  });
  return y;
}

at::Tensor q8_mm_f32(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s) {
  return q8_mm_f32_with(x, q, s, Q8_F32_BRGEMM_ROWS);
}

// No op kernel of its own: asyncllm::q8_0_linear runs in Python over these functions.
void register_ops() {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_ops", &register_ops, "Register this module's CPU kernels of the asyncllm ops (once).");
  m.def("q8_gemv", torch::wrap_pybind_function(q8_gemv), "q8_gemv");
  m.def("q8_fast", torch::wrap_pybind_function(q8_fast), "q8_fast");
  m.def("q8_mm", torch::wrap_pybind_function(q8_mm), "q8_mm");
  m.def("q8_mm_f32", torch::wrap_pybind_function(q8_mm_f32), "q8_mm_f32");
  m.def("q8_mm_f32_with", torch::wrap_pybind_function(q8_mm_f32_with), "q8_mm_f32_with");
  m.def("q8_mm_available", torch::wrap_pybind_function(q8_mm_available), "q8_mm_available");
}
