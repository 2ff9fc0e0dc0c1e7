// Declarations for the decode step's small CPU ops (rotary_kv_cpu.cpp): rotary embedding in
// place and the paged K/V write. Arguments already validated by the bindings.
#pragma once

#include <ATen/core/Tensor.h>

namespace medha {

// Rotate x [N, H, D] (fp32, last dim contiguous, any other strides) in place, rotate-half
// layout, with cos2 [N, 1, 2, D/2] (cos for both halves) and sin2 [N, 1, 2, D/2] ((-sin, sin)):
// transformers' x * cos + rotate_half(x) * sin, each product and the sum rounded once.
void rotary_cpu(const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2);

// Copy row i of k and v ([N, H, D], last dim contiguous) to slot index[i] of k_cache and
// v_cache ([num_blocks, block_size, H, D], contiguous, k's dtype); index int64 [N].
void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& index);

}  // namespace medha
