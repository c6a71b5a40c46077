// Shared by asyncllm's CPU kernels (paged_attention.cpp, int4_linear.cpp, int4_gemv.cpp,
// q8_linear.cpp): bfloat16 <-> float32 and whether oneDNN's bfloat16 brgemm runs natively.
//
// Each kernel family is compiled once per instruction-set variant when the package is
// installed (setup.py: "avx2" and "avx512_bf16" on x86-64); asyncllm/kernels/native.py
// imports the best variant the CPU runs. Code paths are chosen with the compiler's feature
// macros (__AVX512F__, __AVX512BF16__, ...), so each variant holds its own.
#pragma once

// ATen and the op library only: torch/extension.h (the whole C++ frontend) took 3x as long
// to parse; the Python binding's headers are in python_module.h, for the TU that binds.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// An element as float: bfloat16 is the top half of a float32, so the conversion is exact and
// a shift the compiler vectorizes (vpmovzxwd + vpslld).
static inline float to_f(float x) { return x; }
static inline float to_f(at::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Whether oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm) computes a product of
// T exactly here, checked once on small exact values: A[m][k] = m + 1, B[k][n] = n, so
// C[m][n] = K (m + 1) n. bfloat16 B is in the VNNI layout [K / 2][N][2] (rows 2i and 2i + 1
// interleaved), float32 B row-major [K][N]. Any exception (no ukernel on this CPU): false.
template <typename T>
static inline bool brgemm_computes() {
  constexpr bool vnni = std::is_same_v<T, at::BFloat16>;
  constexpr int64_t M = 2, N = 16, K = 32;
  try {
    std::vector<T> a(M * K), b(K * N);
    for (int64_t i = 0; i < M * K; ++i) a[i] = T(static_cast<float>(i / K + 1));
    for (int64_t i = 0; i < K * N; ++i) b[i] = T(static_cast<float>(vnni ? i / 2 % N : i % N));
    std::vector<float> c(M * N);
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), vnni);
    at::native::cpublas::brgemm_release(vnni);
    for (int64_t i = 0; i < M * N; ++i)
      if (c[i] != K * static_cast<float>(i / N + 1) * static_cast<float>(i % N)) return false;
    return true;
  } catch (...) {
    return false;
  }
}

// Whether oneDNN's bfloat16 brgemm runs here at native speed. torch's could_pack says AMX
// only, yet brgemm also runs on AVX-512 BF16 (vdpbf16ps): on a 2-core AMD EPYC (Zen 5, no
// AMX) 64 x 64 x 576 ran at ~250 GFLOP/s per thread, 1.3x torch.mm's bfloat16. Native
// bfloat16 is a compile-time fact of the variant; one small product tells that the call works.
static inline bool brgemm_bf16_runs() {
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
  static const bool ok = brgemm_computes<at::BFloat16>();
  return ok;
#else
  return false;
#endif
}

// Whether oneDNN's float32 brgemm runs here; where it does not, callers use at::mm.
static inline bool brgemm_f32_runs() {
  static const bool ok = brgemm_computes<float>();
  return ok;
}

// f(rows) [M, N] for rows [M, K], computed on its distinct rows only: a row equal (bit for bit)
// to the row before it is copied from that row's output (the compiled forward pads a
// one-token step with a copy of its token). For the few-row kernels, whose rows are each
// computed alone: the outputs are the bits f gives every row.
template <typename F>
static inline at::Tensor on_distinct_rows(const at::Tensor& rows_in, F&& f) {
  const at::Tensor rows = rows_in.contiguous();
  const int64_t M = rows.size(0), bytes = rows.size(1) * rows.element_size();
  const char* p = static_cast<const char*>(rows.data_ptr());
  std::vector<int64_t> keep, source(M);  // rows computed; each row's index among them
  for (int64_t r = 0; r < M; ++r) {
    if (r > 0 && std::memcmp(p + r * bytes, p + (r - 1) * bytes, bytes) == 0) {
      source[r] = source[r - 1];
      continue;
    }
    source[r] = static_cast<int64_t>(keep.size());
    keep.push_back(r);
  }
  if (static_cast<int64_t>(keep.size()) == M) return f(rows);
  if (keep.size() == 1) return f(rows.narrow(0, 0, 1)).expand({M, -1}).contiguous();
  const at::Tensor y = f(rows.index_select(0, at::tensor(keep)));
  return y.index_select(0, at::tensor(source));
}

// A library of CPU kernel registrations for the namespace "asyncllm", made when the loader
// calls a module's register_ops() (not at import: tests import other variants' modules for
// their functions without replacing the engine's kernels). The ops' schemas are declared in
// asyncllm/kernels/ops.py.
static inline torch::Library& cpu_impls(const char* file, uint32_t line) {
  static torch::Library* lib =
      new torch::Library(torch::Library::IMPL, "asyncllm", c10::DispatchKey::CPU, file, line);
  return *lib;
}

// Row tiles for the many-row paths: NB column blocks times MT row tiles of mt rows, so that
// the threads get about the same work.
static inline std::pair<int64_t, int64_t> row_tiles(int64_t M, int64_t NB, int64_t m_tile) {
  int64_t MT = (M + m_tile - 1) / m_tile;
  // Few blocks (N = 192: 3) for the threads: split the rows further so that each thread
  // gets about the same work (a block then is dequantized by up to two threads).
  const int64_t threads = at::get_num_threads(), want = 2 * threads;
  if (NB * MT < want) MT = std::min((want + NB - 1) / NB, (M + 15) / 16);
  // An item count the threads do not divide leaves one thread idle at the end (N = 576: 9
  // blocks, 5 + 4 on 2 threads): split the rows further where a split of >= 16 rows evens it.
  // ``python benchmarks/int4_many_rows.py``, Zen 5, 2 threads: 32 rows 1.07x, 64 rows 1.01-1.03x.
  for (int64_t more = MT + 1; NB * MT % threads != 0 && more <= 2 * MT; ++more)
    if (NB * more % threads == 0 && M / more >= 16) MT = more;
  const int64_t mt = (M + MT - 1) / MT;
  return {(M + mt - 1) / mt, mt};
}
