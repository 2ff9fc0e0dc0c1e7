// y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) on the CPU, fp32, for few rows (decode batches).
//
// A decode step multiplies a handful of token rows by every weight matrix of
// the model, once. BLAS packs a panel of `w` for every call, which at small M
// costs about as much as the product; here `w` is read in place, row-major as
// nn.Linear stores it, and streamed from memory exactly once. Two kernels:
//
// Row kernel (AVX2; every build with AVX2/FMA, and M < 9 on AVX-512 builds):
// - a task owns NB = 3 consecutive rows of `w` (output features) and runs
//   every row of `x` against them in register blocks of 3 w-rows x 4 x-rows
//   (12 AVX2 accumulators: 8 lanes of K each, reduced horizontally at the end);
// - the first pass over a task's w-rows also prefetches the next task's rows,
//   so the memory stream overlaps the later passes' FMAs;
// - at one or two x rows, w is instead read one row at a time in address order
//   (stream_rows): the same sums, about twice the read rate.
//
// Column kernel (AVX-512 builds, 9 <= M): x is transposed once into
// xt [K, MP] (MP = M rounded up to 16, zero-padded), so a 16-lane vector of
// xt[k] holds one k for 16 token rows. For each k, a w element w[n, k] is
// broadcast and multiplied into those vectors: the lanes are token rows, so
// there are no horizontal sums, each w element is loaded once per 16 to 64
// FMA lanes, and there is one x load per NR FMAs (the row kernel: one per 3;
// x comes from L2 either way: 32 x 1536 fp32 is 196 KB, L1 is 48 KB).
// - register blocks of NR w-rows x MV vectors (16 MV token rows): 12 x 1 up
//   to 16 rows, 12 x 2 up to 32, 8 x 3 up to 48, 6 x 4 up to 64 (at most 24
//   zmm accumulators); a task owns CB = 24 rows of w; from 17 to 32 rows, a
//   variant instead: 14 x 2 blocks, 28-row tasks, K in 128-step slices (xt
//   slice in L1), the next task prefetched at an even pace (see ktask2);
// - each block prefetches the next block's rows into L2 as it goes (without
//   it the kernel is ~1.3x slower: the hardware prefetcher does not keep up
//   with a dozen row streams);
// - accumulation runs in KC = 64-step chunks added into a running sum, so
//   each output is a sum of K / 64 partial sums of 64 products (without it
//   the error at K = 1536 was ~3x torch's).
//
// SwiGLU (linear_silu_mul_cpu): w = [gate; up] (a fused gate/up projection), out =
// silu(x gate^T) * (x up^T), [M, N / 2]. From 17 to 32 rows on AVX-512 builds a task
// runs ktask2's blocks over 14 gate rows and the 14 matching up rows (two prefetch
// streams, one per half) and applies silu * up to its sums in registers, so the
// [M, N] product is never written and read back (at batch 32 it was ~70 us a layer
// from L3 after the weights' stream; ~25 us with it hot). exp: Cody-Waite reduction
// and a degree-7 polynomial (relative error ~2e-7, torch's Sleef silu is ~1 ulp).
// Other row counts: this file's product, then at::silu and at::mul (torch's bits).
//
// Both kernels split tasks over at::parallel_for threads (each thread owns a
// range of output features: no write sharing). Accumulation is fp32 in a
// different order from BLAS: the error bound is the same.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MEDHA_LINEAR_AVX2 1
#endif
#if defined(MEDHA_LINEAR_AVX2) && defined(__AVX512F__)
#define MEDHA_LINEAR_AVX512 1
#endif

#include "linear.h"
#include "norm.h"
#include "rotary.h"

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

#ifdef MEDHA_LINEAR_AVX512
namespace {

// From this many x rows on, the column kernel (measured: docs/benchmarks.md).
constexpr int64_t kColumnMinRows = 9;
constexpr int CB = 24;      // w rows per task of the column kernel
constexpr int64_t KC = 64;  // k steps summed in registers before adding to the running sum

// out[m0 + j, n0 + i] = dot(x[m0 + j], w[n0 + i]) (+ bias), i < NR, j < mcount <= 16 MV,
// from xt = x^T [K, MP] (zero-padded to MP columns): for every k, NR broadcasts of
// w[n0 + i, k] times MV 16-lane vectors of xt[k, m0 ..]; no horizontal sums.
// PF: prefetch the next block's NR w rows (the same k) meanwhile.
template <int NR, int MV, bool PF>
inline void cblock(const float* xt, int64_t MP, const float* w, float* out, const float* bias,
                   int64_t K, int64_t N, int64_t n0, int64_t m0, int64_t mcount) {
  alignas(64) float sum[NR][16 * MV];  // the finished KC-steps
  const float* w0 = w + n0 * K;
  const float* next = w + (n0 + NR) * K;
  const float* xp = xt + m0;
  for (int64_t kc = 0; kc < K; kc += KC) {
    const int64_t kend = std::min<int64_t>(K, kc + KC);
    __m512 acc[NR][MV];
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < MV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = kc; k < kend; ++k) {
      __m512 xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xp + k * MP + 16 * v);
      if (PF && (k & 15) == 0) {  // one line per row every 16 steps, into L2
        for (int i = 0; i < NR; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
      }
      for (int i = 0; i < NR; ++i) {
        const __m512 b = _mm512_set1_ps(w0[i * K + k]);
        for (int v = 0; v < MV; ++v) acc[i][v] = _mm512_fmadd_ps(b, xv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < MV; ++v) {
        float* s = &sum[i][16 * v];
        _mm512_store_ps(s, kc == 0 ? acc[i][v] : _mm512_add_ps(_mm512_load_ps(s), acc[i][v]));
      }
  }
  for (int64_t j = 0; j < mcount; ++j) {
    float* o = out + (m0 + j) * N + n0;
    for (int i = 0; i < NR; ++i) o[i] = bias ? sum[i][j] + bias[n0 + i] : sum[i][j];
  }
}

// Rows n0 .. n0 + rows - 1 of w (rows < NR) against x rows m0 .. m0 + mcount - 1.
template <int NR, int MV>
void cblock_tail(int rows, const float* xt, int64_t MP, const float* w, float* out,
                 const float* bias, int64_t K, int64_t N, int64_t n0, int64_t m0, int64_t mcount) {
  if constexpr (NR > 1) {
    if (rows == NR - 1) {
      cblock<NR - 1, MV, false>(xt, MP, w, out, bias, K, N, n0, m0, mcount);
    } else {
      cblock_tail<NR - 1, MV>(rows, xt, MP, w, out, bias, K, N, n0, m0, mcount);
    }
  }
}

// Register block NR x MV (24 accumulators at most): the task's rows n0 .. n1 - 1.
template <int NR, int MV>
void crange(const float* xt, int64_t MP, const float* w, float* out, const float* bias, int64_t K,
            int64_t N, int64_t n0, int64_t n1, int64_t m0, int64_t mcount) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    if (n + 2 * NR <= N) cblock<NR, MV, true>(xt, MP, w, out, bias, K, N, n, m0, mcount);
    else cblock<NR, MV, false>(xt, MP, w, out, bias, K, N, n, m0, mcount);
  }
  if (n < n1) {
    cblock_tail<NR, MV>(static_cast<int>(n1 - n), xt, MP, w, out, bias, K, N, n, m0, mcount);
  }
}

// Every x row against w rows n0 .. n1 - 1, up to 64 x rows (four vectors) at a time.
void ctask(const float* xt, int64_t MP, const float* w, float* out, const float* bias, int64_t M,
           int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += 64) {
    const int64_t mc = std::min<int64_t>(64, M - m0);
    if (mc > 48) crange<6, 4>(xt, MP, w, out, bias, K, N, n0, n1, m0, mc);
    else if (mc > 32) crange<8, 3>(xt, MP, w, out, bias, K, N, n0, n1, m0, mc);
    else if (mc > 16) crange<12, 2>(xt, MP, w, out, bias, K, N, n0, n1, m0, mc);
    else crange<12, 1>(xt, MP, w, out, bias, K, N, n0, n1, m0, mc);
  }
}

// 17 to 32 rows (two vectors of xt per k): the variant measured fastest there
// (docs/benchmarks.md, "17-32 rows: a column-kernel variant"). Register blocks of
// NR2 = 14 w-rows x 2 vectors (28 accumulators); the w broadcasts address
// rows through five group pointers and one stride register (GCC otherwise
// keeps 14 row offsets in registers and spills them inside the k loop); a task
// owns CB2 = 28 rows and runs K in KB2 = 128-step slices (each slice of xt is
// 128 x 32 floats, 16 KB, and stays in L1 across the task's two blocks); while
// it runs, the next task's rows (contiguous) are prefetched into L2 at an even
// pace that ends with the task (NR floats per k step; one line a step measured
// ~2% slower, two lines a step ~1.15x slower, none ~1.4x slower), as PF_STREAMS
// interleaved sub-streams (NextTask). Each output is still a sum of 64-product
// partial sums.
constexpr int NR2 = 14;
constexpr int CB2 = 28;
constexpr int64_t KB2 = 128;

// The next task's rows [start, end), prefetched into L2 one line a k step as PF_STREAMS
// sub-streams in lockstep: sub-stream j covers [start + j part, start + (j + 1) part) and
// the steps take them in turn, each advancing NR floats (so together NR floats a step, as
// the single stream did; the same lines, so the same sums). Why it helps, as far as
// measured (benchmarks/cpu_stream.cpp): one core's reads were capped near 9 GB/s with one
// ascending prefetch stream however far ahead it ran, and several interleaved streams
// raised that cap (13-15 GB/s at twice this kernel's pace), consistent with each software
// prefetch holding one of the core's few L1 fill buffers while the L2 streamer, which
// follows each 4 KB page separately, adds requests per page it is following. In the
// kernel (docs/benchmarks.md, "Batch 32's cold weight stream: interleaved prefetch
// sub-streams"): 2-6 sub-streams 2-4% faster than one at 32 rows, one a row (14 or 28)
// slower.
constexpr int PF_STREAMS = 4;

struct NextTask {
  const float* b;     // sub-stream 0's next address; sub-stream j's is b + j * part
  const float* bend;  // sub-stream 0's end
  const float* end;
  int64_t part;  // floats a sub-stream, whole lines
  int j = 0;     // the sub-stream of the next step

  NextTask(const float* start, const float* stop)
      : b(start),
        end(stop),
        part((((stop - start) + PF_STREAMS - 1) / PF_STREAMS + 15) / 16 * 16) {
    bend = start + part;
  }

  template <int NR>
  inline void step() {
    const float* q = b + j * part;
    if (b < bend && q < end) _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T1);
    if (++j == PF_STREAMS) {
      j = 0;
      b += NR;  // NR floats a step: the task's CB2 / NR blocks spread the lines over it
    }
  }
};

// broadcast of the float at p + S * K4 bytes (S < 3): rows of a group of three
template <int S>
inline __m512 bcast_row(const float* p, int64_t K4) {
#if defined(__GNUC__)
  __m512 r;
  if constexpr (S == 0) asm("vbroadcastss (%1), %0" : "=v"(r) : "r"(p));
  else if constexpr (S == 1) asm("vbroadcastss (%1,%2,1), %0" : "=v"(r) : "r"(p), "r"(K4));
  else asm("vbroadcastss (%1,%2,2), %0" : "=v"(r) : "r"(p), "r"(K4));
  return r;
#else
  return _mm512_set1_ps(*reinterpret_cast<const float*>(reinterpret_cast<const char*>(p) + S * K4));
#endif
}

template <int NR, int MV, int I>
inline void row_fmas(__m512 (&acc)[NR][MV], const __m512 (&xv)[MV], const float* const* g,
                     int64_t K4) {
  if constexpr (I < NR) {
    const __m512 b = bcast_row<I % 3>(g[I / 3], K4);
    for (int v = 0; v < MV; ++v) acc[I][v] = _mm512_fmadd_ps(b, xv[v], acc[I][v]);
    row_fmas<NR, MV, I + 1>(acc, xv, g, K4);
  }
}

// sum[i][j] (+)= sum over k in [k0, k1) of w[i, k] xt[k, j], i < NR, j < 16 MV; wr = row 0 of
// the block, xt already offset to the first x row, sum rows 64 floats apart. first: store.
// Prefetches one line of the next task a k step (pf advances).
template <int NR, int MV>
inline void kblock(const float* xt, int64_t MP, const float* wr, int64_t K, int64_t k0,
                   int64_t k1, float* sum, bool first, NextTask& pf_io) {
  constexpr int NG = (NR + 2) / 3;
  NextTask pf = pf_io;
  const int64_t K4 = 4 * K;
  for (int64_t kc = k0; kc < k1; kc += KC) {
    const int64_t kend = std::min<int64_t>(k1, kc + KC);
    __m512 acc[NR][MV];
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < MV; ++v) acc[i][v] = _mm512_setzero_ps();
    const float* g[NG];
    for (int q = 0; q < NG; ++q) g[q] = wr + 3 * q * K + kc;
    const float* xp = xt + kc * MP;
    for (int64_t k = kc; k < kend; ++k, xp += MP) {
      __m512 xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xp + 16 * v);
      pf.step<NR>();
      row_fmas<NR, MV, 0>(acc, xv, g, K4);
      for (int q = 0; q < NG; ++q) ++g[q];
    }
    const bool store = first && kc == k0;
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < MV; ++v) {
        float* s = sum + i * 64 + 16 * v;
        _mm512_store_ps(s, store ? acc[i][v] : _mm512_add_ps(_mm512_load_ps(s), acc[i][v]));
      }
  }
  pf_io = pf;
}

template <int NR, int MV>
void kblock_tail(int rows, const float* xt, int64_t MP, const float* wr, int64_t K, int64_t k0,
                 int64_t k1, float* sum, bool first, NextTask& pf) {
  if constexpr (NR > 1) {
    if (rows == NR - 1) kblock<NR - 1, MV>(xt, MP, wr, K, k0, k1, sum, first, pf);
    else kblock_tail<NR - 1, MV>(rows, xt, MP, wr, K, k0, k1, sum, first, pf);
  }
}

// 17 to 32 x rows against w rows n0 .. n1 - 1 (n1 - n0 <= CB2).
void ktask2(const float* xt, int64_t MP, const float* w, float* out, const float* bias, int64_t M,
            int64_t K, int64_t N, int64_t n0, int64_t n1) {
  alignas(64) float sum[CB2 * 64];
  NextTask pf(w + n1 * K, w + std::min<int64_t>(N, n1 + CB2) * K);
  for (int64_t kb = 0; kb < K; kb += KB2) {
    const int64_t ke = std::min<int64_t>(K, kb + KB2);
    int64_t n = n0;
    for (; n + NR2 <= n1; n += NR2)
      kblock<NR2, 2>(xt, MP, w + n * K, K, kb, ke, sum + (n - n0) * 64, kb == 0, pf);
    if (n < n1) {
      kblock_tail<NR2, 2>(static_cast<int>(n1 - n), xt, MP, w + n * K, K, kb, ke,
                          sum + (n - n0) * 64, kb == 0, pf);
    }
  }
  for (int64_t j = 0; j < M; ++j) {
    float* o = out + j * N;
    for (int64_t n = n0; n < n1; ++n) {
      const float s = sum[(n - n0) * 64 + j];
      o[n] = bias ? s + bias[n] : s;
    }
  }
}

// r[i][j] -> r[j][i] for a 16 x 16 block: unpack pairs of floats, then of float pairs (each
// 128-bit lane then holds 4 rows of one column), then a 4 x 4 transpose of the lanes.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  __m512 s[16];  // s[4 q + c], lane L: column 4 L + c of rows 4 q .. 4 q + 3
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 1]), d = _mm512_castps_pd(t[4 * q + 3]);
    s[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    s[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    s[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    s[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 lo01 = _mm512_shuffle_f32x4(s[c], s[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 hi01 = _mm512_shuffle_f32x4(s[c], s[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 lo23 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 hi23 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    r[c] = _mm512_shuffle_f32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_f32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_f32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_f32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// x [M, K] transposed into a new xt [K, MP], MP = M rounded up to 16, zero-padded: 16 x 16
// blocks in registers (~3x faster than element by element at K = 576), the last K % 16
// columns one at a time.
at::Tensor transpose_padded(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t MP = (M + 15) / 16 * 16;
  at::Tensor xt_t = at::empty({K, MP}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xt = xt_t.data_ptr<float>();
  const int64_t K16 = K / 16 * 16;
  for (int64_t k0 = 0; k0 < K16; k0 += 16) {
    for (int64_t m0 = 0; m0 < MP; m0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = m0 + i < M ? _mm512_loadu_ps(xp + (m0 + i) * K + k0) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(xt + (k0 + i) * MP + m0, r[i]);
    }
  }
  for (int64_t k = K16; k < K; ++k) {
    float* row = xt + k * MP;
    for (int64_t m = 0; m < M; ++m) row[m] = xp[m * K + k];
    for (int64_t m = M; m < MP; ++m) row[m] = 0.0f;
  }
  return xt_t;
}

// e^x, x clamped to [-87, 88]: n = round(x / ln2), r = x - n ln2 in two steps (ln2 = hi +
// lo, hi exact in 16 bits), e^r by its degree-7 Taylor polynomial (|r| <= ln2 / 2: the
// truncation is below 6e-9), times 2^n.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// silu(g) * u = g / (1 + e^-g) * u, 16 lanes. Where g < -88, e^-g is taken as +inf
// (exp512 clamps at e^88), so silu is -0 as in torch (and NaN at g = -inf).
inline __m512 silu_mul512(__m512 g, __m512 u) {
  __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.0f), _CMP_LT_OQ),
                         _mm512_set1_ps(INFINITY));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// SwiGLU, 17 to 32 x rows: out[j, n] = silu(x[j] . w[n]) * (x[j] . w[I + n]) for gate rows
// n0 .. n1 - 1 (n1 - n0 <= NR2): ktask2's blocks over the gate rows and over the matching up
// rows, each prefetching the next task's rows of its own half (NR2 rows, K steps of NR2
// floats: exactly those rows), then silu * up on the sums.
void ktask2_silu_mul(const float* xt, int64_t MP, const float* w, float* out, int64_t M,
                     int64_t K, int64_t I, int64_t n0, int64_t n1) {
  alignas(64) float sum[2 * NR2 * 64];
  float* sg = sum;
  float* su = sum + NR2 * 64;
  const int rows = static_cast<int>(n1 - n0);
  const int64_t next_end = std::min<int64_t>(I, n1 + NR2);
  NextTask pfg(w + n1 * K, w + next_end * K);
  NextTask pfu(w + (I + n1) * K, w + (I + next_end) * K);
  const float* wg = w + n0 * K;
  const float* wu = w + (I + n0) * K;
  for (int64_t kb = 0; kb < K; kb += KB2) {
    const int64_t ke = std::min<int64_t>(K, kb + KB2);
    if (rows == NR2) {
      kblock<NR2, 2>(xt, MP, wg, K, kb, ke, sg, kb == 0, pfg);
      kblock<NR2, 2>(xt, MP, wu, K, kb, ke, su, kb == 0, pfu);
    } else {
      kblock_tail<NR2, 2>(rows, xt, MP, wg, K, kb, ke, sg, kb == 0, pfg);
      kblock_tail<NR2, 2>(rows, xt, MP, wu, K, kb, ke, su, kb == 0, pfu);
    }
  }
  for (int i = 0; i < rows; ++i) {  // lanes past M hold silu(0) * 0 = 0
    for (int v = 0; v < 2; ++v) {
      float* g = sg + i * 64 + 16 * v;
      _mm512_store_ps(g, silu_mul512(_mm512_load_ps(g), _mm512_load_ps(su + i * 64 + 16 * v)));
    }
  }
  for (int64_t j = 0; j < M; ++j) {
    float* o = out + j * I;
    for (int64_t n = n0; n < n1; ++n) o[n] = sg[(n - n0) * 64 + j];
  }
}

at::Tensor silu_mul_columns(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), I = w.size(0) / 2;
  at::Tensor out = at::empty({M, I}, x.options());
  at::Tensor xt_t = transpose_padded(x);
  const float* xt = xt_t.data_ptr<float>();
  const int64_t MP = xt_t.size(1);
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (I + NR2 - 1) / NR2, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * NR2;
      ktask2_silu_mul(xt, MP, wp, op, M, K, I, n0, std::min<int64_t>(I, n0 + NR2));
    }
  });
  return out;
}

// The column kernel: x transposed once into xt [K, MP], then w streamed in tasks of CB rows.
at::Tensor linear_columns(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor xt_t = transpose_padded(x);
  const float* xt = xt_t.data_ptr<float>();
  const int64_t MP = xt_t.size(1);
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (M > 16 && M <= 32) {
    at::parallel_for(0, (N + CB2 - 1) / CB2, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * CB2;
        ktask2(xt, MP, wp, op, bp, M, K, N, n0, std::min<int64_t>(N, n0 + CB2));
      }
    });
    return out;
  }
  const int64_t tasks = (N + CB - 1) / CB;
  at::parallel_for(0, tasks, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * CB;
      ctask(xt, MP, wp, op, bp, M, K, N, n0, std::min<int64_t>(N, n0 + CB));
    }
  });
  return out;
}

}  // namespace
#endif

namespace {

#ifdef MEDHA_LINEAR_AVX2
// Up to this many x rows, w is read one row at a time in address order (stream_rows):
// one ascending stream, which the hardware prefetcher follows on its own. Three rows
// side by side with the next task's rows software-prefetched (task<NB>) read 11-12 GB/s
// from memory on one core of the AMD EPYC VM; one stream 20-25 GB/s at one and two x
// rows, but 8-9 GB/s at three and four (each w row then waits on more FMAs a load):
// docs/benchmarks.md, "Decode products at one or two rows: one ascending stream".
constexpr int64_t kStreamRows = 2;

// Every x row (M <= kStreamRows) against w rows lo .. hi - 1, one w row at a time. Each
// output is the same sum as in task<NB> (one 8-lane accumulator over k in order, then
// the tail), so the same bits.
void stream_rows(const float* x, const float* w, float* out, const float* bias, int64_t M,
                 int64_t K, int64_t N, int64_t lo, int64_t hi) {
  static_assert(kStreamRows <= 2, "stream_rows has blocks for one and two x rows");
  for (int64_t n = lo; n < hi; ++n) {
    if (M == 1) block<1, 1, false>(x, w, out, bias, K, N, n, 0);
    else block<1, 2, false>(x, w, out, bias, K, N, n, 0);
  }
}
#endif

// The row kernel (every x row dotted with w rows; AVX2, or BLAS without it).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias) {
#ifdef MEDHA_LINEAR_AVX2
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (M <= kStreamRows) {
    at::parallel_for(0, N, 48, [&](int64_t lo, int64_t hi) {
      stream_rows(xp, wp, op, bp, M, K, N, lo, hi);
    });
    return out;
  }
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

}  // namespace

at::Tensor linear_small_m_cpu(const at::Tensor& x, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias) {
#ifdef MEDHA_LINEAR_AVX512
  if (x.size(0) >= kColumnMinRows) return linear_columns(x, w, bias);
#endif
  return linear_rows(x, w, bias);
}

at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& w) {
#ifdef MEDHA_LINEAR_AVX512
  if (x.size(0) > 16 && x.size(0) <= 32) return silu_mul_columns(x, w);
#endif
  const int64_t I = w.size(0) / 2;
  const at::Tensor y = linear_small_m_cpu(x, w, std::nullopt);
  return at::mul(at::silu(y.narrow(1, 0, I)), y.narrow(1, I, I));
}

std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_cpu(const at::Tensor& x,
                                                           const at::Tensor& w,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& norm_weight,
                                                           double eps) {
  // The same kernels (and bits) as linear_small_m, then rms_norm with the residual: one call
  // from Python instead of two.
  return rms_norm_cpu(linear_small_m_cpu(x, w, std::nullopt), norm_weight, eps, residual);
}

std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_swiglu_cpu(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& residual,
    const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
    const at::Tensor& down) {
  auto [h, normed] = linear_add_rms_norm_cpu(x, w, residual, norm_weight, eps);
  return {h, linear_small_m_cpu(linear_silu_mul_cpu(normed, gate_up), down, std::nullopt)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_qkv_rotary_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& norm_weight, double eps, const at::Tensor& w_qkv, int64_t num_q_heads,
    int64_t num_kv_heads, const at::Tensor& cos2, const at::Tensor& sin2,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& index) {
  auto [h, normed] = rms_norm_cpu(x, norm_weight, eps, residual);
  at::Tensor qkv = linear_small_m_cpu(normed, w_qkv, std::nullopt);
  const int64_t m = qkv.size(0), width = qkv.size(1);
  const int64_t hq = num_q_heads, hkv = num_kv_heads, d = width / (hq + 2 * hkv);
  float* p = qkv.data_ptr<float>();
  // q's and k's heads at once, in the projection's output (rows `width` apart, heads d)
  rotary_rows(p, m, hq + hkv, d / 2, width, d, cos2.const_data_ptr<float>(), cos2.stride(0),
              cos2.stride(3), sin2.const_data_ptr<float>(), sin2.stride(0), sin2.stride(2),
              sin2.stride(3));
  if (index.has_value()) {
    write_kv_rows(p + hq * d, width, d, p + (hq + hkv) * d, width, d, k_cache->data_ptr<float>(),
                  v_cache->data_ptr<float>(), k_cache->size(0) * k_cache->size(1), m, hkv, d,
                  index->const_data_ptr<int64_t>());
  }
  at::Tensor q = at::empty({m, hq, d}, qkv.options());
  float* qp = q.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(qp + i * hq * d, p + i * width, hq * d * sizeof(float));
  }
  return {h, q, qkv};
}

const char* linear_small_m_isa() {
#if defined(MEDHA_LINEAR_AVX512)
  return "avx512";
#elif defined(MEDHA_LINEAR_AVX2)
  return "avx2";
#else
  return "";
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

