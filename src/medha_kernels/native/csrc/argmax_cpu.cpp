// The arg-max of each row of fp32 [M, V] logits on the CPU: a greedy decode step's token
// choice, in one vectorized pass over each row.
//
// torch's max(dim=-1) reads a 32 x 49,152 logits matrix in ~1.7 ms on one thread (argmax
// ~5.4 ms); the vocabulary is streamed once here at the core's read rate. Per 16-lane
// vector: a running maximum per lane and the index where that lane first reached it
// (a strict greater-than, so ties keep the earlier index); at the row's end the maximum
// over the lanes, and among the lanes holding it the smallest index: the row's first
// maximal index, as torch's. -inf rows give 0 (as torch). A NaN anywhere in a row makes
// the call answer nullopt (torch's NaN rule then decides), found by an unordered compare
// folded into the same pass.
#include "argmax.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MEDHA_ARGMAX_AVX512 1
#endif

namespace medha {
namespace {

// (first maximal index of row[0, n), whether a NaN was seen)
inline int64_t row_argmax(const float* row, int64_t n, bool* nan) {
  float best = row[0];
  int64_t at = 0;
  bool seen_nan = std::isnan(best);
  int64_t j = 1;
#ifdef MEDHA_ARGMAX_AVX512
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(row);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 unordered = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    for (j = 16; j + 16 <= n; j += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(row + j);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    seen_nan = unordered != 0;
    best = _mm512_reduce_max_ps(vmax);
    const __mmask16 holders = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
    // smallest index among the lanes holding the maximum (indices < 2^31: V is a vocabulary)
    const __m512i big = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
    at = _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(big, holders, vidx));
  }
#endif
  for (; j < n; ++j) {  // the tail after the vectors (or the whole row): later indices
    const float v = row[j];
    seen_nan |= std::isnan(v);
    if (v > best) {
      best = v;
      at = j;
    }
  }
  *nan = seen_nan;
  return at;
}

}  // namespace

std::optional<at::Tensor> row_argmax_cpu(const at::Tensor& x) {
  const int64_t m = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  std::atomic<bool> any_nan{false};
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      bool nan = false;
      op[i] = row_argmax(xp + i * n, n, &nan);
      if (nan) any_nan.store(true, std::memory_order_relaxed);
    }
  });
  if (any_nan.load()) return std::nullopt;
  return out;
}

}  // namespace medha
