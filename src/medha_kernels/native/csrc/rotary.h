// Declarations for the decode step's small CPU ops (rotary_kv_cpu.cpp): rotary embedding in
// place and the paged K/V write. Arguments already validated by the bindings.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace medha {

// Rotate x [N, H, D] (fp32, last dim contiguous, any other strides) in place, rotate-half
// layout, with cos2 [N, 1, 2, D/2] (cos for both halves) and sin2 [N, 1, 2, D/2] ((-sin, sin)):
// transformers' x * cos + rotate_half(x) * sin, each product and the sum rounded once.
void rotary_cpu(const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2);

// Copy row i of k and v ([N, H, D], last dim contiguous) to slot index[i] of k_cache and
// v_cache ([num_blocks, block_size, H, D], contiguous, k's dtype); index int64 [N].
void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& index);

// The step's tables for rotary_cpu from int64 positions [N] and fp32 inv_freq [D/2] (CPU), as
// medha_runtime.model.rope computes them: freqs = positions.float()[:, None] * inv_freq, cos and
// sin (each times scale unless it is 1), then cos2 [N, 1, 2, D/2] (cos for both halves, a
// broadcast view) and sin2 [N, 1, 2, D/2] ((-sin, sin)), fp32. The same torch ops (hence bits)
// from C++, the last two as a view and a copy.
std::tuple<at::Tensor, at::Tensor> rotary_tables_cpu(const at::Tensor& positions,
                                                     const at::Tensor& inv_freq, double scale);

// rotary_cpu on raw fp32 memory: x row t, head h at x + t * xs0 + h * xs1 (head_dim 2 * half,
// contiguous); cos2 as cos + t * cs0 + j * cs3, sin2[t, 0, 1, j] as sin + t * ss0 + ss2 +
// j * ss3 (strides in elements). The same loop, hence the same bits.
void rotary_rows(float* x, int64_t n, int64_t heads, int64_t half, int64_t xs0, int64_t xs1,
                 const float* cos, int64_t cs0, int64_t cs3, const float* sin, int64_t ss0,
                 int64_t ss2, int64_t ss3);

// write_kv_cpu on raw memory: row i's head h of k at k + (i * ks0 + h * ks1) * item bytes
// (d contiguous elements of `item` bytes; v likewise) to slot index[i] of contiguous caches
// of `slots` slots x heads x d. The one loop write_kv_cpu and the fused layer front share.
void write_kv_rows(const void* k, int64_t ks0, int64_t ks1, const void* v, int64_t vs0,
                   int64_t vs1, void* k_cache, void* v_cache, int64_t slots, int64_t n,
                   int64_t heads, int64_t d, const int64_t* index, int64_t item = sizeof(float));

}  // namespace medha
