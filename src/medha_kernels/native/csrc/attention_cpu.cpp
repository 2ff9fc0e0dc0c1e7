// CPU paged attention with LSE: chunked prefill and decode in one batched call.
//
// The work of a step is split into tasks (sequence, KV head, query-row tile),
// planned once per step by plan_paged_attention_cpu and run by every layer.
// A task holds the query rows of all heads of one GQA group, so each key and
// value row is read once per group, straight from the paged cache (no gather,
// no copy per group for fp32 caches). Softmax is online over tiles of keys, in
// base 2 internally; the LSE is stored in natural log. A row that sees no key
// gets (0, -inf). Tasks of few rows (decode: one token's group heads) take the
// rows of one token 3 at a time, so each key/value row is loaded once for
// them; tasks of many rows take register-blocked tiles (blocked_tile).
//
// Decode sequences (fewer than kDecodeRows rows per KV head) get one task for
// all their KV heads when the plan has enough of them (or one thread): the
// cache's [block, slot, KV head, D] rows are then read once each, whole and in
// address order, and the next key tile's rows are prefetched while one tile is
// computed (run_decode_task, decode_tile). At batch 32 the KV comes from
// memory (the layers' weights evict it between steps), so this is what decode
// attention costs there.
//
// Tasks run on at::parallel_for threads, largest first, taken from a shared
// counter (the causal triangle makes tiles of one chunk unequal).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MEDHA_AVX2 1
#if defined(__AVX512F__)
#define MEDHA_AVX512 1  // the decode kernels' 512-bit variants (small_scores4, small_pv)
#endif
#endif

#include "attention.h"

namespace medha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kLn2 = 0.69314718055994530942f;
constexpr int64_t kKeyTile = 64;     // keys per online-softmax step
constexpr int64_t kRowsPerTask = 64;  // query rows (tokens x group heads) per task, about
// Below this many row-keys (query rows x the keys they see) a plan runs on the calling
// thread. A row-key costs ~15-19 ns on one core with the KV coming from memory (SmolLM2's
// heads), so 1,024 of them are ~17 us, several times a parallel_for hand-off. It was 65,536
// (~1.2 ms): a batch-32 decode at 72 keys (20,736) then ran on one of two threads, 0.40
// against 0.24 ms a layer on two (docs/benchmarks.md, "Batch decode attention on two
// threads").
constexpr int64_t kSerialWork = int64_t{1} << 10;
// A sequence whose chunk has fewer rows than this per KV head (tokens x group
// heads: decode) is a decode task: one task for all its KV heads, so that each
// cache row (all heads) is read once, in address order, in tiles of equal size of at
// most kDecodeTile keys, with the next tile prefetched (see run_decode_task).
constexpr int64_t kDecodeRows = 12;
constexpr int64_t kDecodeTile = 32;
// The next tile's rows are prefetched (decode_tile) as this many interleaved sub-streams
// per cache (the tile's first quarter, second, third, fourth in turn), not in key order:
// the same lines, the same arithmetic. With the KV cold, at batch 32 and 80 keys 0.90-0.91x
// the time of key order, 2 sub-streams 0.92-0.94x, 8 0.96-0.98x; batch 1 at 32K keys
// 0.86-0.91x (docs/benchmarks.md, "Batch 32's cold weight stream: interleaved prefetch
// sub-streams"; why several streams read faster: linear_cpu.cpp, NextTask).
constexpr int64_t kPrefetchSubStreams = 4;

// out[i] = <q, k_i> for 4 key rows of length D (portable path; AVX2 builds use small_scores4).
inline void dot4(const float* q, const float* const* k, int64_t D, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    for (int i = 0; i < 4; ++i) out[i] += q[d] * k[i][d];
  }
}

inline float dot1(const float* q, const float* k, int64_t D) {
  float s = 0.0f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

#ifdef MEDHA_AVX2
// 2^x for x <= 0 (x = -inf gives 0); relative error about 1e-7.
inline __m256 exp2_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  // Taylor series of exp(f ln 2) to degree 7 (truncation below 1e-8).
  __m256 p = _mm256_set1_ps(1.5252733804059841e-5f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381609e-4f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// s[j] = 2^(s[j] - m) for j < n; returns their sum.
inline float exp2_shift_sum(float* s, int64_t n, float m) {
  int64_t j = 0;
  float total = 0.0f;
#ifdef MEDHA_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float x : lanes) total += x;
#endif
  for (; j < n; ++j) {
    s[j] = std::exp2(s[j] - m);
    total += s[j];
  }
  return total;
}

// o[:D] += sum_j p[j] * v_j[:D] over n value rows (portable path; AVX2 builds use small_pv).
inline void accumulate_pv(float* o, const float* p, const float* const* v, int64_t n, int64_t D) {
  for (int64_t d = 0; d < D; ++d) {
    float a = o[d];
    for (int64_t j = 0; j < n; ++j) a += p[j] * v[j][d];
    o[d] = a;
  }
}

#ifdef MEDHA_AVX2
// Register-blocked tiles for many query rows (prefill): R rows x 16 keys (or
// 16 head-dim values) per block, each loaded key/value vector used by R rows.
constexpr int kBlockRows = 6;

// s[r][j0:j0+16] = sum_d q[r][d] * kt[d][j0:j0+16] for R rows; kt is the key
// tile transposed, kKeyTile floats per head-dim index.
template <int R>
inline void block_scores(const float* q, const float* kt, int64_t D, int64_t j0, float* s) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyTile + j0);
    const __m256 k1 = _mm256_loadu_ps(kt + d * kKeyTile + j0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * kKeyTile + j0, acc[r][0]);
    _mm256_storeu_ps(s + r * kKeyTile + j0 + 8, acc[r][1]);
  }
}

// o[r][d0:d0+16] += sum_j p[r][j] * v_j[d0:d0+16] over n value rows, for R rows.
template <int R>
inline void block_pv(float* o, const float* p, const float* const* v, int64_t n, int64_t D,
                     int64_t d0) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(o + r * D + d0);
    acc[r][1] = _mm256_loadu_ps(o + r * D + d0 + 8);
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v[j] + d0);
    const __m256 v1 = _mm256_loadu_ps(v[j] + d0 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * kKeyTile + j);
      acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * D + d0, acc[r][0]);
    _mm256_storeu_ps(o + r * D + d0 + 8, acc[r][1]);
  }
}

// The block kernels for rows [r, r + rows), rows <= kBlockRows.
inline void scores_rows(int rows, const float* q, const float* kt, int64_t D, int64_t j0, float* s) {
  switch (rows) {
    case 6: return block_scores<6>(q, kt, D, j0, s);
    case 5: return block_scores<5>(q, kt, D, j0, s);
    case 4: return block_scores<4>(q, kt, D, j0, s);
    case 3: return block_scores<3>(q, kt, D, j0, s);
    case 2: return block_scores<2>(q, kt, D, j0, s);
    default: return block_scores<1>(q, kt, D, j0, s);
  }
}

inline void pv_rows(int rows, float* o, const float* p, const float* const* v, int64_t n,
                    int64_t D, int64_t d0) {
  switch (rows) {
    case 6: return block_pv<6>(o, p, v, n, D, d0);
    case 5: return block_pv<5>(o, p, v, n, D, d0);
    case 4: return block_pv<4>(o, p, v, n, D, d0);
    case 3: return block_pv<3>(o, p, v, n, D, d0);
    case 2: return block_pv<2>(o, p, v, n, D, d0);
    default: return block_pv<1>(o, p, v, n, D, d0);
  }
}
#endif

// Asks for the cache lines of bytes [p, p + bytes) to be brought into L2.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const auto lo = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto hi = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (uintptr_t a = lo; a < hi; a += 64) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);  // locality 2: prefetcht1
#endif
  }
}

// A sequence's cache slots for its keys in order from ``key``: one division at the start,
// then a step within the block or on to the next block of the table.
struct SlotCursor {
  const int32_t* table;  // the sequence's block-table row
  int64_t block_size, blk, in_blk;
  SlotCursor(const int32_t* row, int64_t bs, int64_t key)
      : table(row), block_size(bs), blk(key / bs), in_blk(key % bs) {}
  // The next key's slot (block id * block_size + its place in the block).
  int64_t next() {
    if (in_blk == block_size) {
      ++blk;
      in_blk = 0;
    }
    return int64_t{table[blk]} * block_size + in_blk++;
  }
};

struct Shape {
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  bool causal;
  float scale_log2;  // sm_scale * log2(e)
};

// Per-thread scratch, reused across tasks.
struct Scratch {
  std::vector<float> q, o, s, m, l, kbuf, vbuf, kt;
  std::vector<const float*> krow, vrow;
  // decode tasks: the cache rows (all KV heads, pf_bytes each) of the next key tile
  std::vector<const char*> pfk, pfv;
  int64_t pf_n = 0, pf_bytes = 0;
};

// max(init, s[0], ..., s[n-1]).
inline float row_max(const float* s, int64_t n, float init) {
  int64_t j = 0;
  float mx = init;
#ifdef MEDHA_AVX2
  if (n >= 8) {
    __m256 a = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    mx = std::max(mx, _mm_cvtss_f32(h));
  }
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// Row r's online-softmax step over its scores s[:visible] (base 2): rescale
// its running output, turn s into probabilities, zero s[visible:n].
inline void online_softmax_row(Scratch& w, int64_t r, float* s, int64_t visible, int64_t n,
                               int64_t D) {
  if (visible <= 0) {
    std::fill(s, s + n, 0.0f);
    return;
  }
  const float mx = row_max(s, visible, w.m[r]);
  const float alpha = std::exp2(w.m[r] - mx);  // 0 when the row was empty
  const float sum = exp2_shift_sum(s, visible, mx);
  std::fill(s + visible, s + n, 0.0f);
  if (alpha != 1.0f) {
    float* o = w.o.data() + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
  }
  w.l[r] = w.l[r] * alpha + sum;
  w.m[r] = mx;
}

#ifndef MEDHA_AVX2
// Portable path: row r of the tile (query w.q[r], scores w.s[r]) over its
// `visible` keys krow[j] and values vrow[j]: scores, online softmax, P.V.
inline void portable_row(Scratch& w, int64_t r, const float* const* krow,
                         const float* const* vrow, int64_t visible, int64_t D) {
  const float* qr = w.q.data() + r * D;
  float* s = w.s.data() + r * kKeyTile;
  int64_t j = 0;
  for (; j + 4 <= visible; j += 4) dot4(qr, krow + j, D, s + j);
  for (; j < visible; ++j) s[j] = dot1(qr, krow[j], D);
  online_softmax_row(w, r, s, visible, visible, D);
  accumulate_pv(w.o.data() + r * D, s, vrow, visible, D);
}
#endif

#ifdef MEDHA_AVX2
// Decode-sized tasks (a few rows per token): R <= 3 rows of one token at a
// time, so each key and value row is loaded once for the R rows and 4R
// independent accumulators keep the FMA units busy.
constexpr int kSmallRows = 3;

#ifdef MEDHA_AVX512
// AVX-512 variants of small_scores4 / small_pv. 32 zmm registers hold a 64-wide output
// row as 4 of them, so 3 rows' outputs, the value vectors and a broadcast fit without
// the spills of AVX2's 16 ymm (12 accumulators + 4 values + 1 > 16); a head dim that is
// not a multiple of 16 takes masked loads for its last 16 (no scalar tail). The loops over
// rows, chunks and keys are unrolled by pragma: without it GCC 12 kept the accumulator
// arrays on the stack and stored all 12 of them every step (slower than AVX2: 217 against
// 153 us a layer at batch 32, 72 keys, KV in cache).

// Lanes [0, rest) of a 16-float vector, rest in [1, 16].
inline __mmask16 lanes16(int64_t rest) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(rest, 16)) - 1u);
}

// The 4 sums of a0..a3's lanes, in that order.
inline __m128 sum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  };
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

template <int R>
inline void small_scores4_512(const float* q, const float* const* k, int64_t D, float* s) {
  __m512 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes16(D - d);
    const __m512 k0 = _mm512_maskz_loadu_ps(m, k[0] + d), k1 = _mm512_maskz_loadu_ps(m, k[1] + d);
    const __m512 k2 = _mm512_maskz_loadu_ps(m, k[2] + d), k3 = _mm512_maskz_loadu_ps(m, k[3] + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_maskz_loadu_ps(m, q + r * D + d);
      acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(x, k3, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(s + r * kKeyTile, sum4_512(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// o[r][d : d + 16C] += sum_j p[r][j] v_j[d : d + 16C] for R rows, the last 16 masked by
// ``tail``. With fewer than 8 accumulators (R x C) the FMA latency would bind, so keys
// are split into U interleaved partial sums (added in a fixed order: deterministic).
template <int R, int C>
inline void pv_chunk512(float* o, const float* p, const float* const* v, int64_t n, int64_t D,
                        int64_t d, __mmask16 tail) {
  constexpr int U = R * C >= 8 ? 1 : (R * C >= 4 ? 2 : 4);
  __mmask16 mk[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) mk[c] = c == C - 1 ? tail : static_cast<__mmask16>(0xFFFF);
  __m512 acc[U][R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      acc[0][r][c] = _mm512_maskz_loadu_ps(mk[c], o + r * D + d + 16 * c);
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) acc[u][r][c] = _mm512_setzero_ps();
    }
  }
  int64_t j = 0;
  for (; j + U <= n; j += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m512 x[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) x[c] = _mm512_maskz_loadu_ps(mk[c], v[j + u] + d + 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(p[r * kKeyTile + j + u]);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[u][r][c] = _mm512_fmadd_ps(w, x[c], acc[u][r][c]);
      }
    }
  }
  for (; j < n; ++j) {
    __m512 x[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) x[c] = _mm512_maskz_loadu_ps(mk[c], v[j] + d + 16 * c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kKeyTile + j]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[0][r][c] = _mm512_fmadd_ps(w, x[c], acc[0][r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) acc[0][r][c] = _mm512_add_ps(acc[0][r][c], acc[u][r][c]);
      _mm512_mask_storeu_ps(o + r * D + d + 16 * c, mk[c], acc[0][r][c]);
    }
  }
}

template <int R>
inline void small_pv512(float* o, const float* p, const float* const* v, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_chunk512<R, 4>(o, p, v, n, D, d, 0xFFFF);
  const int64_t rest = D - d;
  if (rest == 0) return;
  const __mmask16 tail = lanes16(rest - 16 * ((rest - 1) / 16));
  switch ((rest + 15) / 16) {
    case 1: return pv_chunk512<R, 1>(o, p, v, n, D, d, tail);
    case 2: return pv_chunk512<R, 2>(o, p, v, n, D, d, tail);
    case 3: return pv_chunk512<R, 3>(o, p, v, n, D, d, tail);
    default: return pv_chunk512<R, 4>(o, p, v, n, D, d, tail);
  }
}
#endif

// s[r * kKeyTile + i] = <q_r, k_i> for R rows and 4 keys.
template <int R>
inline void small_scores4(const float* q, const float* const* k, int64_t D, float* s) {
#ifdef MEDHA_AVX512
  small_scores4_512<R>(q, k, D, s);
#else
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d);
    const __m256 k2 = _mm256_loadu_ps(k[2] + d), k3 = _mm256_loadu_ps(k[3] + d);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_loadu_ps(q + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(x, k2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(x, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][3]));
    float* out = s + r * kKeyTile;
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    for (int64_t e = d; e < D; ++e) {
      for (int i = 0; i < 4; ++i) out[i] += q[r * D + e] * k[i][e];
    }
  }
#endif
}

// o[r][:D] += sum_j p[r * kKeyTile + j] * v_j[:D] over n value rows, for R rows.
template <int R>
inline void small_pv(float* o, const float* p, const float* const* v, int64_t n, int64_t D) {
#ifdef MEDHA_AVX512
  small_pv512<R>(o, p, v, n, D);
#else
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_loadu_ps(o + r * D + d + 8 * i);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v[j] + d;
      const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
      const __m256 v2 = _mm256_loadu_ps(vj + 16), v3 = _mm256_loadu_ps(vj + 24);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * kKeyTile + j);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(w, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(w, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + r * D + d + 8 * i, acc[r][i]);
    }
  }
  for (; d + 8 <= D; d += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(o + r * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vj = _mm256_loadu_ps(v[j] + d);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * kKeyTile + j), vj, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(o + r * D + d, acc[r]);
  }
  for (; d < D; ++d) {
    for (int r = 0; r < R; ++r) {
      float a = o[r * D + d];
      for (int64_t j = 0; j < n; ++j) a += p[r * kKeyTile + j] * v[j][d];
      o[r * D + d] = a;
    }
  }
#endif
}

// Scores, online softmax and P.V of rows [r0, r0 + rows) of one token over
// its ``visible`` keys of the tile (w.krow/w.vrow), rows <= kSmallRows.
template <int R>
inline void small_rows_tile(Scratch& w, int64_t r0, int64_t visible, int64_t D) {
  const float* const* krow = w.krow.data();
  const float* const* vrow = w.vrow.data();
  const float* q = w.q.data() + r0 * D;
  float* s = w.s.data() + r0 * kKeyTile;
  int64_t j = 0;
  for (; j + 4 <= visible; j += 4) small_scores4<R>(q, krow + j, D, s + j);
  for (; j < visible; ++j) {
    for (int r = 0; r < R; ++r) s[r * kKeyTile + j] = dot1(q + r * D, krow[j], D);
  }
  for (int r = 0; r < R; ++r) online_softmax_row(w, r0 + r, s + r * kKeyTile, visible, visible, D);
  small_pv<R>(w.o.data() + r0 * D, s, vrow, visible, D);
}

// small_rows_tile for rows [r0, r0 + rows), taken kSmallRows at a time.
inline void small_rows(Scratch& w, int64_t r0, int64_t rows, int64_t visible, int64_t D) {
  for (int64_t r = r0; r < r0 + rows; r += kSmallRows) {
    switch (std::min<int64_t>(kSmallRows, r0 + rows - r)) {
      case 3: small_rows_tile<3>(w, r, visible, D); break;
      case 2: small_rows_tile<2>(w, r, visible, D); break;
      default: small_rows_tile<1>(w, r, visible, D); break;
    }
  }
}
#endif

#ifdef MEDHA_AVX2
// Prefetches the next tile's cache rows [i, i + n) (keys or values) held in ``rows``.
inline void prefetch_next(const Scratch& w, const std::vector<const char*>& rows, int64_t i,
                          int64_t n) {
  for (int64_t e = std::min(w.pf_n, i + n); i < e; ++i) prefetch_bytes(rows[i], w.pf_bytes);
}

// One key tile of a decode task: rows [rb, rb + Hkv * G) (one token, all heads)
// over its ``visible`` keys (w.krow/w.vrow, kKeyTile per KV head). Scores go
// 4 keys at a time through every head, so the key rows are read in address
// order, and each 4-key step prefetches the same keys' key and value rows of
// the next tile; then the online softmax and P.V per KV head (small_pv, the
// outputs in registers; P.V in address order with the outputs in memory was
// slower, with the value rows prefetched during the scores as well).
inline void decode_tile(Scratch& w, int64_t rb, int64_t Hkv, int64_t G, int64_t visible,
                        int64_t D) {
  for (int64_t j = 0; j < visible; j += 4) {
    const int64_t n = std::min<int64_t>(4, visible - j);
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* const* krow = w.krow.data() + h * kKeyTile + j;
      for (int64_t r = rb + h * G; r < rb + (h + 1) * G; r += kSmallRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kSmallRows, rb + (h + 1) * G - r));
        const float* q = w.q.data() + r * D;
        float* s = w.s.data() + r * kKeyTile + j;
        if (n == 4) {
          switch (rows) {
            case 3: small_scores4<3>(q, krow, D, s); break;
            case 2: small_scores4<2>(q, krow, D, s); break;
            default: small_scores4<1>(q, krow, D, s); break;
          }
        } else {
          for (int i = 0; i < rows; ++i) {
            for (int64_t e = 0; e < n; ++e) s[i * kKeyTile + e] = dot1(q + i * D, krow[e], D);
          }
        }
      }
    }
    prefetch_next(w, w.pfk, j, n);
    prefetch_next(w, w.pfv, j, n);
  }
  for (int64_t r = rb; r < rb + Hkv * G; ++r) {
    online_softmax_row(w, r, w.s.data() + r * kKeyTile, visible, visible, D);
  }
  for (int64_t h = 0; h < Hkv; ++h) {
    const float* const* vrow = w.vrow.data() + h * kKeyTile;
    for (int64_t r = rb + h * G; r < rb + (h + 1) * G; r += kSmallRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kSmallRows, rb + (h + 1) * G - r));
      float* o = w.o.data() + r * D;
      const float* p = w.s.data() + r * kKeyTile;
      switch (rows) {
        case 3: small_pv<3>(o, p, vrow, visible, D); break;
        case 2: small_pv<2>(o, p, vrow, visible, D); break;
        default: small_pv<1>(o, p, vrow, visible, D); break;
      }
    }
  }
}
#endif

#ifdef MEDHA_AVX2
constexpr int64_t kBlockedRows = kDecodeRows;  // a task with this many rows takes the blocked path

// One key tile of a task with many rows (w.krow/w.vrow hold its nk keys):
// scores and P.V in register blocks over a transposed copy of the key tile.
// ``first_last`` is row 0's last visible key index in the tile (causal).
void blocked_tile(Scratch& w, const Shape& sh, int64_t first_last, int64_t nk, int64_t M) {
  const int64_t D = sh.head_dim, G = sh.group;
  w.kt.resize(D * kKeyTile);
  for (int64_t j = 0; j < nk; ++j) {
    const float* k = w.krow[j];
    for (int64_t d = 0; d < D; ++d) w.kt[d * kKeyTile + j] = k[d];
  }
  for (int64_t j = nk; j < kKeyTile; ++j) {
    for (int64_t d = 0; d < D; ++d) w.kt[d * kKeyTile + j] = 0.0f;
  }
  const int64_t d16 = D / 16 * 16;
  for (int64_t r0 = 0; r0 < M; r0 += kBlockRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, M - r0));
    // rows are token-major: the block's last row sees the most keys
    auto visible = [&](int64_t r) {
      return sh.causal ? std::max<int64_t>(0, std::min(nk, first_last + r / G + 1)) : nk;
    };
    const int64_t n = visible(r0 + rows - 1);
    if (n <= 0) continue;
    float* s = w.s.data() + r0 * kKeyTile;
    const float* q = w.q.data() + r0 * D;
    for (int64_t j0 = 0; j0 < n; j0 += 16) scores_rows(rows, q, w.kt.data(), D, j0, s);
    for (int r = 0; r < rows; ++r) {
      online_softmax_row(w, r0 + r, s + r * kKeyTile, visible(r0 + r), n, D);
    }
    float* o = w.o.data() + r0 * D;
    for (int64_t d0 = 0; d0 < d16; d0 += 16) pv_rows(rows, o, s, w.vrow.data(), n, D, d0);
    if (d16 < D) {  // the head dim's tail, one row at a time
      for (int r = 0; r < rows; ++r) {
        float* orow = o + r * D;
        const float* p = s + r * kKeyTile;
        for (int64_t d = d16; d < D; ++d) {
          float a = orow[d];
          for (int64_t j = 0; j < n; ++j) a += p[j] * w.vrow[j][d];
          orow[d] = a;
        }
      }
    }
  }
}
#endif

// Row r of w (its idx-th row of q's [N * Hq] rows) normalised into out / lse.
template <typename scalar_t>
inline void store_row(const Scratch& w, int64_t r, int64_t idx, int64_t D, scalar_t* out,
                      float* lse) {
  scalar_t* dst = out + idx * D;
  const float total = w.l[r];
  if (!(total > 0.0f)) {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(0.0f);
    lse[idx] = kNegInf;
    return;
  }
  const float inv = 1.0f / total;
  const float* o = w.o.data() + r * D;
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv);
  lse[idx] = (w.m[r] + std::log2(total)) * kLn2;
}

// dst[:D] = float(src[:D]): one cache row of a bf16 / fp16 cache into the tile buffer.
template <typename scalar_t>
inline void row_to_float(const scalar_t* src, float* dst, int64_t D) {
  int64_t d = 0;
#ifdef MEDHA_AVX512
  // 16 at a time (an fp16 decode at tiny's heads, 32K keys: 0.78x the time with c10's
  // scalar conversion; bf16 within the noise). bf16 is the upper half of a float, fp16
  // converts exactly with vcvtph2ps: the same values as the scalar path.
  for (; d < D; d += 16) {
    const __mmask16 m = lanes16(D - d);
    const __m256i h = _mm256_maskz_loadu_epi16(m, src + d);
    __m512 f;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      f = _mm512_cvtph_ps(h);
    }
    _mm512_mask_storeu_ps(dst + d, m, f);
  }
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

template <typename scalar_t>
void run_task(const int32_t* task, const scalar_t* q, const scalar_t* k_cache,
              const scalar_t* v_cache, const int32_t* cu, const int32_t* kv_lens,
              const int32_t* q_start, const int32_t* block_table, const Shape& sh, scalar_t* out,
              float* lse, Scratch& w) {
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  const int64_t seq = task[0], kvh = task[1], t_lo = task[2], t_hi = task[3];
  const int64_t G = sh.group, D = sh.head_dim, Hq = sh.num_q_heads, Hkv = sh.num_kv_heads;
  const int64_t M = (t_hi - t_lo) * G;  // rows: token-major, then the group's heads
  const int64_t row0 = cu[seq] + t_lo;  // first token row in q
  const int64_t start = q_start[seq];   // absolute position of the sequence's token 0
  const int64_t kv_len = kv_lens[seq];
  const int64_t num_keys =
      sh.causal ? std::min<int64_t>(kv_len, std::max<int64_t>(0, start + t_hi)) : kv_len;
  w.q.resize(M * D);
  w.o.assign(M * D, 0.0f);
  w.s.resize(M * kKeyTile);
  w.m.assign(M, kNegInf);
  w.l.assign(M, 0.0f);
  w.krow.resize(kKeyTile);
  w.vrow.resize(kKeyTile);
  if (!kFloat) {
    w.kbuf.resize(kKeyTile * D);
    w.vbuf.resize(kKeyTile * D);
  }
  for (int64_t r = 0; r < M; ++r) {
    const scalar_t* src = q + ((row0 + r / G) * Hq + kvh * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = static_cast<float>(src[d]) * sh.scale_log2;
  }
  const int32_t* blocks = block_table + seq * sh.max_blocks;
  for (int64_t j0 = 0; j0 < num_keys; j0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, num_keys - j0);
    // the tile's keys block by block: one division per tile, not two per key
    SlotCursor slots(blocks, sh.block_size, j0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = slots.next();
      const int64_t off = (slot * Hkv + kvh) * D;
      if constexpr (kFloat) {
        w.krow[j] = k_cache + off;
        w.vrow[j] = v_cache + off;
      } else {
        float* kb = w.kbuf.data() + j * D;
        float* vb = w.vbuf.data() + j * D;
        row_to_float(k_cache + off, kb, D);
        row_to_float(v_cache + off, vb, D);
        w.krow[j] = kb;
        w.vrow[j] = vb;
      }
    }
#ifdef MEDHA_AVX2
    if (M >= kBlockedRows) {
      blocked_tile(w, sh, start + t_lo - j0, nk, M);
      continue;
    }
    for (int64_t tok = 0; tok < t_hi - t_lo; ++tok) {
      // keys this token's rows see in the tile: all, or up to its own position (causal)
      const int64_t visible = sh.causal ? std::min(nk, start + t_lo + tok - j0 + 1) : nk;
      if (visible <= 0) continue;  // and in every later tile too
      small_rows(w, tok * G, G, visible, D);
    }
#else
    for (int64_t r = 0; r < M; ++r) {
      // keys this row sees in the tile: all, or up to its own position (causal)
      const int64_t visible =
          sh.causal ? std::min(nk, start + t_lo + r / G - j0 + 1) : nk;
      if (visible <= 0) continue;  // and in every later tile too
      portable_row(w, r, w.krow.data(), w.vrow.data(), visible, D);
    }
#endif
  }
  for (int64_t r = 0; r < M; ++r) {
    store_row(w, r, (row0 + r / G) * Hq + kvh * G + r % G, D, out, lse);
  }
}

// A decode task (task[1] == -1): the query rows of all heads of tokens
// [t_lo, t_hi) of one sequence (token-major, then heads in q's order), over
// its keys in equal tiles of at most kDecodeTile. Each key's cache row (all KV heads) is read
// once per tile, in address order; the next tile's rows (at the last tile,
// ``next``'s first tile, when given) are prefetched a few at a time between
// the 4-key steps of this one (decode_tile), so they stream from memory while
// this tile is computed.
template <typename scalar_t>
void run_decode_task(const int32_t* task, const int32_t* next, const scalar_t* q,
                     const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* cu,
                     const int32_t* kv_lens, const int32_t* q_start, const int32_t* block_table,
                     const Shape& sh, scalar_t* out, float* lse, Scratch& w) {
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  const int64_t seq = task[0], t_lo = task[2], t_hi = task[3];
  const int64_t G = sh.group, D = sh.head_dim, Hq = sh.num_q_heads, Hkv = sh.num_kv_heads;
  const int64_t M = (t_hi - t_lo) * Hq;
  const int64_t row0 = cu[seq] + t_lo;
  const int64_t start = q_start[seq];
  const int64_t kv_len = kv_lens[seq];
  const int64_t num_keys =
      sh.causal ? std::min<int64_t>(kv_len, std::max<int64_t>(0, start + t_hi)) : kv_len;
  w.q.resize(M * D);
  w.o.assign(M * D, 0.0f);
  w.s.resize(M * kKeyTile);
  w.m.assign(M, kNegInf);
  w.l.assign(M, 0.0f);
  w.krow.resize(Hkv * kKeyTile);
  w.vrow.resize(Hkv * kKeyTile);
  if (!kFloat) {
    w.kbuf.resize(Hkv * kKeyTile * D);
    w.vbuf.resize(Hkv * kKeyTile * D);
  }
  const scalar_t* qsrc = q + row0 * Hq * D;
  for (int64_t i = 0; i < M * D; ++i) w.q[i] = static_cast<float>(qsrc[i]) * sh.scale_log2;
  const int32_t* blocks = block_table + seq * sh.max_blocks;
  const int64_t row = Hkv * D;
  w.pfk.resize(kDecodeTile);
  w.pfv.resize(kDecodeTile);
  w.pf_bytes = row * static_cast<int64_t>(sizeof(scalar_t));
  // the cache rows of keys [a, b) of the sequence with block-table row ``tb`` into w.pfk/pfv
  auto next_rows = [&](const int32_t* tb, int64_t a, int64_t b) {
    w.pf_n = std::max<int64_t>(0, b - a);
    // in kPrefetchSubStreams interleaved sub-streams: position i holds row (i % S) part + i / S
    // (where S divides the count; else in key order)
    const int64_t S = w.pf_n % kPrefetchSubStreams == 0 ? kPrefetchSubStreams : 1;
    const int64_t part = w.pf_n / S;
    for (int64_t sub = 0; sub < S; ++sub) {
      // keys a + sub * part + t, block by block: one division per sub-stream, not two per key
      const int64_t first = a + sub * part;
      SlotCursor slots(tb, sh.block_size, first);
      for (int64_t t = 0; t < part; ++t) {
        const int64_t off = slots.next() * row;
        w.pfk[sub + t * S] = reinterpret_cast<const char*>(k_cache + off);
        w.pfv[sub + t * S] = reinterpret_cast<const char*>(v_cache + off);
      }
    }
  };
  // tiles of equal size (at most kDecodeTile): 72 keys as 24 + 24 + 24, not 32 + 32 + 8,
  // so that every tile's compute has a full next tile's prefetch to hide
  const int64_t tiles = std::max<int64_t>(1, (num_keys + kDecodeTile - 1) / kDecodeTile);
  const int64_t tile = (num_keys + tiles - 1) / tiles;
  for (int64_t j0 = 0; j0 < num_keys; j0 += tile) {
    const int64_t nk = std::min(tile, num_keys - j0);
    if (j0 + tile < num_keys) {
      next_rows(blocks, j0 + tile, std::min(num_keys, j0 + 2 * tile));
    } else if (next != nullptr && next[1] < 0) {
      next_rows(block_table + next[0] * sh.max_blocks, 0,
                std::min<int64_t>(kv_lens[next[0]], kDecodeTile));
    } else {
      w.pf_n = 0;
    }
    SlotCursor slots(blocks, sh.block_size, j0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t off = slots.next() * row;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t i = h * kKeyTile + j;
        if constexpr (kFloat) {
          w.krow[i] = k_cache + off + h * D;
          w.vrow[i] = v_cache + off + h * D;
        } else {
          float* kb = w.kbuf.data() + i * D;
          float* vb = w.vbuf.data() + i * D;
          row_to_float(k_cache + off + h * D, kb, D);
          row_to_float(v_cache + off + h * D, vb, D);
          w.krow[i] = kb;
          w.vrow[i] = vb;
        }
      }
    }
    int64_t fetched = 0;  // next-tile rows prefetched so far
    for (int64_t tok = 0; tok < t_hi - t_lo; ++tok) {
      const int64_t visible = sh.causal ? std::min(nk, start + t_lo + tok - j0 + 1) : nk;
      if (visible <= 0) continue;
#ifdef MEDHA_AVX2
      decode_tile(w, tok * Hq, Hkv, G, visible, D);  // prefetches rows [0, visible)
      fetched = std::max(fetched, std::min(visible, w.pf_n));
#else
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* const* krow = w.krow.data() + h * kKeyTile;
        const float* const* vrow = w.vrow.data() + h * kKeyTile;
        for (int64_t r = tok * Hq + h * G; r < tok * Hq + (h + 1) * G; ++r) {
          portable_row(w, r, krow, vrow, visible, D);
        }
      }
#endif
    }
    for (int64_t i = fetched; i < w.pf_n; ++i) {  // rows past what the tokens saw, if any
      prefetch_bytes(w.pfk[i], w.pf_bytes);
      prefetch_bytes(w.pfv[i], w.pf_bytes);
    }
  }
  for (int64_t r = 0; r < M; ++r) store_row(w, r, row0 * Hq + r, D, out, lse);
}

// One task of the plan: a decode task (all KV heads) or a (KV head, query tile) one.
template <typename scalar_t>
inline void run_any_task(const int32_t* task, const int32_t* next, const scalar_t* q,
                         const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* cu,
                         const int32_t* kv_lens, const int32_t* q_start,
                         const int32_t* block_table, const Shape& sh, scalar_t* out, float* lse,
                         Scratch& w) {
  if (task[1] < 0) {
    run_decode_task(task, next, q, k_cache, v_cache, cu, kv_lens, q_start, block_table, sh, out,
                    lse, w);
  } else {
    run_task(task, q, k_cache, v_cache, cu, kv_lens, q_start, block_table, sh, out, lse, w);
  }
}

// Runs every task; threads take the next task (largest first) from a shared counter.
template <typename scalar_t>
void run_tasks(const int32_t* tasks, int64_t T, bool serial, const scalar_t* q,
               const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* cu,
               const int32_t* kv_lens, const int32_t* q_start, const int32_t* block_table,
               const Shape& sh, scalar_t* out, float* lse) {
  if (serial || T == 1 || at::get_num_threads() == 1) {
    Scratch w;
    for (int64_t i = 0; i < T; ++i) {
      const int32_t* next = i + 1 < T ? tasks + 5 * (i + 1) : nullptr;
      run_any_task(tasks + 5 * i, next, q, k_cache, v_cache, cu, kv_lens, q_start, block_table,
                   sh, out, lse, w);
    }
    return;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(T, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < T; i = next.fetch_add(1)) {
        run_any_task(tasks + 5 * i, nullptr, q, k_cache, v_cache, cu, kv_lens, q_start,
                     block_table, sh, out, lse, w);
      }
    }
  });
}

#define MEDHA_ATTN_DISPATCH(TYPE, NAME, ...)                                    \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Row-keys of a task: its rows (tokens x heads) times the keys they see.
int64_t task_cost(const int32_t* t, const int32_t* kv_lens, const int32_t* q_start, int64_t heads,
                  bool causal) {
  const int64_t keys = causal ? std::min<int64_t>(kv_lens[t[0]], std::max(0, q_start[t[0]] + t[3]))
                              : kv_lens[t[0]];
  return (t[3] - t[2]) * heads * std::max<int64_t>(keys, 1);
}

}  // namespace

at::Tensor plan_paged_attention_cpu(const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                                    const at::Tensor& q_start, int64_t num_kv_heads,
                                    int64_t group, bool causal) {
  const int64_t B = kv_lens.size(0);
  const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* starts = q_start.const_data_ptr<int32_t>();
  const int64_t tokens_per_task = std::max<int64_t>(1, kRowsPerTask / group);
  // Decode tasks (all KV heads of a sequence) when one thread runs the plan, or
  // when there are enough of them to share out and the sequence's work is at
  // most a thread's fair share; else a task per KV head, which lets threads
  // split a few long sequences (one long decode among short ones included).
  auto is_decode = [&](int64_t b) {
    const int64_t nq = cu[b + 1] - cu[b];
    return nq > 0 && nq * group < kDecodeRows;
  };
  auto seq_cost = [&](int64_t b) {
    const int32_t t[4] = {static_cast<int32_t>(b), -1, 0, cu[b + 1] - cu[b]};
    return task_cost(t, lens, starts, group * num_kv_heads, causal);
  };
  int64_t decodes = 0, work = 0;
  std::vector<int64_t> costs(B);
  std::vector<char> decode(B);
  for (int64_t b = 0; b < B; ++b) {
    decode[b] = is_decode(b);
    decodes += decode[b] ? 1 : 0;
    costs[b] = seq_cost(b);
    work += costs[b];
  }
  const int64_t threads = at::get_num_threads();
  auto whole_task = [&](int64_t b) {
    if (!decode[b]) return false;
    return threads == 1 || (decodes >= 2 * threads && costs[b] * threads <= work);
  };
  std::vector<int32_t> flat;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = cu[b + 1] - cu[b];
    if (whole_task(b)) {
      flat.insert(flat.end(), {static_cast<int32_t>(b), -1, 0, static_cast<int32_t>(nq)});
      continue;
    }
    for (int64_t lo = 0; lo < nq; lo += tokens_per_task) {
      const int64_t hi = std::min(nq, lo + tokens_per_task);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        flat.insert(flat.end(), {static_cast<int32_t>(b), static_cast<int32_t>(h),
                                 static_cast<int32_t>(lo), static_cast<int32_t>(hi)});
      }
    }
  }
  const int64_t T = static_cast<int64_t>(flat.size()) / 4;
  std::vector<int64_t> order(T), cost(T);
  for (int64_t i = 0; i < T; ++i) {
    const int32_t* t = &flat[4 * i];
    // a whole-sequence task is {b, -1, 0, nq}: seq_cost(b), computed above
    cost[i] = t[1] < 0 ? costs[t[0]] : task_cost(t, lens, starts, group, causal);
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  at::Tensor tasks = at::empty({T, 5}, cu_seqlens_q.options().dtype(at::kInt));
  int32_t* dst = tasks.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < T; ++i) {
    std::copy_n(&flat[4 * order[i]], 4, dst + 5 * i);
    total += cost[order[i]];
    // column 4: 1 when the tasks from here on are too small to share out
    dst[5 * i + 4] = 0;
  }
  if (T > 0) dst[4] = total < kSerialWork ? 1 : 0;  // whole plan runs on one thread
  return tasks;
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens, const at::Tensor& q_start,
    const at::Tensor& block_table, const at::Tensor& tasks, bool causal, double sm_scale) {
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2);
  at::Tensor out = at::empty({N, Hq, D}, q.options());
  at::Tensor lse = at::empty({N, Hq}, q.options().dtype(at::kFloat));
  const int64_t T = tasks.size(0);
  if (T == 0) return {out, lse};
  const Shape sh{Hq, Hkv, Hq / Hkv, D, k_cache.size(1), block_table.size(1), causal,
                 static_cast<float>(sm_scale) * kLog2e};
  const int32_t* task = tasks.const_data_ptr<int32_t>();
  const bool serial = task[4] != 0;
  MEDHA_ATTN_DISPATCH(q.scalar_type(), "paged_attention_cpu", [&] {
    run_tasks<scalar_t>(task, T, serial, q.const_data_ptr<scalar_t>(),
                        k_cache.const_data_ptr<scalar_t>(), v_cache.const_data_ptr<scalar_t>(),
                        cu_seqlens_q.const_data_ptr<int32_t>(), kv_lens.const_data_ptr<int32_t>(),
                        q_start.const_data_ptr<int32_t>(), block_table.const_data_ptr<int32_t>(),
                        sh, out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
  return {out, lse};
}

}  // namespace medha
