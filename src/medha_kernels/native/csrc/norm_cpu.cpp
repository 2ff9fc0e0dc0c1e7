// RMSNorm on the CPU in fp32, transformers' LlamaRMSNorm bit for bit, in one call.
//
// transformers computes, in fp32:
//   variance = x.pow(2).mean(-1, keepdim=True)      (pow 2 is x * x; mean is sum, then / K)
//   y = weight * (x * rsqrt(variance + eps))         (rsqrt is 1 / sqrt)
// Every step but the sum is one IEEE operation rounded once, so the loops below give the
// same bits as torch's kernels (fp-contract is off for this file: a fused multiply-add
// would round once where torch rounds twice). The sum is torch's own (at::sum_out), whose
// order of additions (vector lanes, cascades) is not ours to copy. Six dispatched ops become
// one call plus that reduction; with a residual, its add (h = x + residual) is in the call too.
#pragma GCC optimize("fp-contract=off")

#include "norm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace medha {

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                double eps,
                                                const std::optional<at::Tensor>& residual) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor h = x;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1));
  if (residual.has_value()) {
    h = at::empty_like(x);
    const float* a = x.const_data_ptr<float>();
    const float* b = residual->const_data_ptr<float>();
    float* o = h.data_ptr<float>();
    at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * k; i < end * k; ++i) o[i] = a[i] + b[i];
    });
  }
  const float* hp = h.const_data_ptr<float>();
  at::Tensor squares = at::empty_like(h);
  float* sq = squares.data_ptr<float>();
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * k; i < end * k; ++i) sq[i] = hp[i] * hp[i];
  });
  at::Tensor sums = at::empty({m}, h.options());
  at::sum_out(sums, squares, {-1}, /*keepdim=*/false);
  const float* s = sums.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  at::Tensor out = at::empty_like(h);
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const float count = static_cast<float>(k);
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float variance = s[i] / count;
      const float r = 1.0f / std::sqrt(variance + e);
      const float* row = hp + i * k;
      float* dst = o + i * k;
      for (int64_t j = 0; j < k; ++j) dst[j] = w[j] * (row[j] * r);
    }
  });
  return {h, out};
}

}  // namespace medha
