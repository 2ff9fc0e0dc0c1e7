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

void rotary_cpu(const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2) {
  const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos2.const_data_ptr<float>();
  const float* sp = sin2.const_data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  // cos2[t, 0, 0, j] and sin2[t, 0, 1, j] (= sin); strides in elements
  const int64_t cs0 = cos2.stride(0), cs3 = cos2.stride(3);
  const int64_t ss0 = sin2.stride(0), ss2 = sin2.stride(2), ss3 = sin2.stride(3);
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

void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& index) {
  const int64_t n = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t item = k.element_size();
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* idx = index.const_data_ptr<int64_t>();
  const auto* kp = static_cast<const char*>(k.const_data_ptr());
  const auto* vp = static_cast<const char*>(v.const_data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row_bytes = d * item, slot_bytes = heads * d * item;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = idx[i];
    TORCH_CHECK(slot >= 0 && slot < slots, "write_kv: slot ", slot, " is outside the cache's ",
                slots, " slots");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + slot * slot_bytes + h * row_bytes,
                  kp + (i * k.stride(0) + h * k.stride(1)) * item, row_bytes);
      std::memcpy(vc + slot * slot_bytes + h * row_bytes,
                  vp + (i * v.stride(0) + h * v.stride(1)) * item, row_bytes);
    }
  }
}

}  // namespace medha
