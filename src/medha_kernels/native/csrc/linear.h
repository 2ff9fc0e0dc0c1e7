// Declarations for the small-M CPU linear layer (linear_cpu.cpp).
//
// x [M, K] and w [N, K] fp32, contiguous, on the CPU; bias [N] fp32 contiguous
// or none (already validated). Returns x @ w^T + bias, [M, N] fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace medha {

at::Tensor linear_small_m_cpu(const at::Tensor& x, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias);

// SwiGLU over a fused gate/up weight w [2 I, K] ([gate; up], no bias): silu(x gate^T) *
// (x up^T), [M, I] fp32. Fused into the product's epilogue from 17 to 32 rows on AVX-512
// builds; otherwise linear_small_m_cpu, then at::silu and at::mul.
at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& w);

// A row-parallel projection and the RMSNorm after it (a decode layer's o-projection and its
// post-attention norm, TP 1): y = x @ w^T, h = y + residual, returns (h, norm(h)), each
// [M, N] fp32: linear_small_m_cpu (no bias), then rms_norm_cpu, the same bits as the two calls.
// residual [M, N] and norm_weight [N] fp32 contiguous (already validated).
std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_cpu(const at::Tensor& x,
                                                           const at::Tensor& w,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& norm_weight,
                                                           double eps);

// linear_add_rms_norm_cpu, then a SwiGLU MLP on the normalized rows (a decode layer from its
// o-projection to its MLP's output, TP 1): returns (h, down(silu(n gate^T) * (n up^T))) for
// (h, n) = linear_add_rms_norm_cpu(...), gate_up [2 I, N] ([gate; up]) and down [N, I] fp32
// contiguous, no biases: linear_silu_mul_cpu and linear_small_m_cpu, the same bits as the calls.
std::tuple<at::Tensor, at::Tensor> linear_add_rms_norm_swiglu_cpu(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& residual,
    const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
    const at::Tensor& down);

// A decode layer's attention up to the attention call (TP 1, no q/k/v bias), one call:
// (h, n) = rms_norm_cpu(x, norm_weight, eps, residual), qkv = n @ w_qkv^T (linear_small_m_cpu),
// the q and k heads of qkv rotated in place (rotary_rows: rotary_cpu's loop), and with an
// index the k and v heads written to slots index [M] of k_cache and v_cache (write_kv_rows).
// Returns (h, q [M, Hq, D] contiguous, qkv [M, (Hq + 2 Hkv) D]): the same bits as those calls.
// Arguments already validated by the bindings (cos2, sin2 as rotary_cpu's).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_qkv_rotary_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& norm_weight, double eps, const at::Tensor& w_qkv, int64_t num_q_heads,
    int64_t num_kv_heads, const at::Tensor& cos2, const at::Tensor& sin2,
    const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
    const std::optional<at::Tensor>& index);

// Whether this build has the AVX2/FMA kernel (else linear_small_m_cpu calls at::linear).
bool linear_small_m_vectorized();

// The widest kernel in this build: "avx512" (row kernel below 9 rows, column kernel from
// 9), "avx2" (row kernel only) or "" (at::linear).
const char* linear_small_m_isa();

}  // namespace medha
