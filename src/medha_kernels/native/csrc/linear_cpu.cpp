// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) on the CPU, fp32, for few rows (decode batches).
//
// A decode step multiplies a handful of token rows by every weight matrix of
// the model, once. BLAS packs a panel of `w` for every call, which at small M
// costs about as much as the product; here `w` is read in place, row-major as
// nn.Linear stores it, and streamed from memory exactly once:
//
// - a task owns NB = 3 consecutive rows of `w` (output features) and runs
//   every row of `x` against them in register blocks of 3 w-rows x 4 x-rows
//   (12 AVX2 accumulators: 8 lanes of K each, reduced horizontally at the end);
// - the first pass over a task's w-rows also prefetches the next task's rows,
//   so the memory stream overlaps the later passes' FMAs;
// - tasks are split over at::parallel_for threads (each thread owns a range
//   of output features: no write sharing).
//
// Accumulation is fp32 in a different order from BLAS: the error bound is
// the same (K products summed in fp32).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MEDHA_LINEAR_AVX2 1
#endif

#include "linear.h"

namespace medha {

#ifdef MEDHA_LINEAR_AVX2
namespace {

constexpr int NB = 3;  // w rows per task (and per register block)
constexpr int MB = 4;  // x rows per register block

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// out[m0 + j, n0 + i] = dot(x[m0 + j], w[n0 + i]) (+ bias), i < NR, j < MR.
// PF: prefetch rows n0 + NB .. n0 + 2 NB - 1 of w (the next task's) meanwhile.
template <int NR, int MR, bool PF>
inline void block(const float* x, const float* w, float* out, const float* bias, int64_t K,
                  int64_t N, int64_t n0, int64_t m0) {
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* wr[NR];
  const float* xr[MR];
  for (int i = 0; i < NR; ++i) wr[i] = w + (n0 + i) * K;
  for (int j = 0; j < MR; ++j) xr[j] = x + (m0 + j) * K;
  const float* next = w + (n0 + NB) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_loadu_ps(wr[i] + k);
    if (PF && (k & 15) == 0) {  // one 64-byte line per row every other step
      for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T0);
    }
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_loadu_ps(xr[j] + k);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += wr[i][t] * xr[j][t];
      out[(m0 + j) * N + n0 + i] = bias ? s + bias[n0 + i] : s;
    }
  }
}

template <int NR, bool PF>
inline void first_pass(const float* x, const float* w, float* out, const float* bias, int64_t M,
                       int64_t K, int64_t N, int64_t n0) {
  if (M >= 4) block<NR, 4, PF>(x, w, out, bias, K, N, n0, 0);
  else if (M == 3) block<NR, 3, PF>(x, w, out, bias, K, N, n0, 0);
  else if (M == 2) block<NR, 2, PF>(x, w, out, bias, K, N, n0, 0);
  else block<NR, 1, PF>(x, w, out, bias, K, N, n0, 0);
}

// Every x row against w rows n0 .. n0 + NR - 1.
template <int NR>
inline void task(const float* x, const float* w, float* out, const float* bias, int64_t M,
                 int64_t K, int64_t N, int64_t n0) {
  if (n0 + 2 * NB <= N) first_pass<NR, true>(x, w, out, bias, M, K, N, n0);
  else first_pass<NR, false>(x, w, out, bias, M, K, N, n0);
  int64_t m = std::min<int64_t>(M, MB);
  for (; m + MB <= M; m += MB) block<NR, MB, false>(x, w, out, bias, K, N, n0, m);
  if (M - m == 3) block<NR, 3, false>(x, w, out, bias, K, N, n0, m);
  else if (M - m == 2) block<NR, 2, false>(x, w, out, bias, K, N, n0, m);
  else if (M - m == 1) block<NR, 1, false>(x, w, out, bias, K, N, n0, m);
}

}  // namespace
#endif

at::Tensor linear_small_m_cpu(const at::Tensor& x, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias) {
#ifdef MEDHA_LINEAR_AVX2
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tasks = (N + NB - 1) / NB;
  at::parallel_for(0, tasks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * NB;
      const int64_t left = std::min<int64_t>(NB, N - n0);
      if (left == 3) task<3>(xp, wp, op, bp, M, K, N, n0);
      else if (left == 2) task<2>(xp, wp, op, bp, M, K, N, n0);
      else task<1>(xp, wp, op, bp, M, K, N, n0);
    }
  });
  return out;
#else
  return at::linear(x, w, bias);  // no AVX2/FMA in this build: BLAS
#endif
}

bool linear_small_m_vectorized() {
#ifdef MEDHA_LINEAR_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace medha
