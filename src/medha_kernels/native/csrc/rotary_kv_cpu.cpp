// A decode step's rotary embedding and paged K/V write on the CPU, one call each.
//
// The rotation is the arithmetic of medha_runtime.model.rope.apply_rotary_ (transformers'
// x * cos + rotate_half(x) * sin): out1 = x1 * cos + x2 * (-sin), out2 = x2 * cos + x1 * sin,
// each product rounded once and then the sum (x2 * (-sin) is -(x2 * sin) exactly, and adding
// it is subtracting x2 * sin). fp-contract is off for this file: a fused multiply-add would
// round once where torch rounds twice.
#pragma GCC optimize("fp-contract=off")

#include "rotary.h"

#include <ATen/ATen.h>

#include <cstring>

namespace medha {

void rotary_rows(float* xp, int64_t n, int64_t heads, int64_t half, int64_t xs0, int64_t xs1,
                 const float* cp, int64_t cs0, int64_t cs3, const float* sp, int64_t ss0,
                 int64_t ss2, int64_t ss3) {
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cp + t * cs0;
    const float* s = sp + t * ss0 + ss2;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = xp + t * xs0 + h * xs1;
      float* b = a + half;
      for (int64_t j = 0; j < half; ++j) {
        const float cj = c[j * cs3], sj = s[j * ss3];
        const float x1 = a[j], x2 = b[j];
        const float p1 = x1 * cj, q1 = x2 * sj;
        const float p2 = x2 * cj, q2 = x1 * sj;
        a[j] = p1 - q1;
        b[j] = p2 + q2;
      }
    }
  }
}

void rotary_cpu(const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2) {
  // cos2[t, 0, 0, j] and sin2[t, 0, 1, j] (= sin); strides in elements
  rotary_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2) / 2, x.stride(0), x.stride(1),
              cos2.const_data_ptr<float>(), cos2.stride(0), cos2.stride(3),
              sin2.const_data_ptr<float>(), sin2.stride(0), sin2.stride(2), sin2.stride(3));
}

void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& index) {
  write_kv_rows(k.const_data_ptr(), k.stride(0), k.stride(1), v.const_data_ptr(), v.stride(0),
                v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                k_cache.size(0) * k_cache.size(1), k.size(0), k.size(1), k.size(2),
                index.const_data_ptr<int64_t>(), k.element_size());
}

std::tuple<at::Tensor, at::Tensor> rotary_tables_cpu(const at::Tensor& positions,
                                                     const at::Tensor& inv_freq, double scale) {
  const at::Tensor freqs = at::mul(positions.to(at::kFloat).unsqueeze(-1), inv_freq);
  at::Tensor cos = at::cos(freqs), sin = at::sin(freqs);
  if (scale != 1.0) {
    cos = at::mul(cos, scale);
    sin = at::mul(sin, scale);
  }
  const int64_t n = cos.size(0), half = cos.size(1);
  at::Tensor sin2 = at::empty({n, 1, 2, half}, cos.options());
  const float* sp = sin.const_data_ptr<float>();
  float* dst = sin2.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      dst[t * 2 * half + j] = -sp[t * half + j];
      dst[t * 2 * half + half + j] = sp[t * half + j];
    }
  }
  return {cos.view({n, 1, 1, half}).expand({n, 1, 2, half}), sin2};
}

void write_kv_rows(const void* k, int64_t ks0, int64_t ks1, const void* v, int64_t vs0,
                   int64_t vs1, void* k_cache, void* v_cache, int64_t slots, int64_t n,
                   int64_t heads, int64_t d, const int64_t* index, int64_t item) {
  const auto* kp = static_cast<const char*>(k);
  const auto* vp = static_cast<const char*>(v);
  auto* kc = static_cast<char*>(k_cache);
  auto* vc = static_cast<char*>(v_cache);
  const int64_t row_bytes = d * item, slot_bytes = heads * row_bytes;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = index[i];
    TORCH_CHECK(slot >= 0 && slot < slots, "write_kv: slot ", slot, " is outside the cache's ",
                slots, " slots");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + slot * slot_bytes + h * row_bytes, kp + (i * ks0 + h * ks1) * item,
                  row_bytes);
      std::memcpy(vc + slot * slot_bytes + h * row_bytes, vp + (i * vs0 + h * vs1) * item,
                  row_bytes);
    }
  }
}

}  // namespace medha
