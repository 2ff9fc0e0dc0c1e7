// Declarations for the small-M CPU linear layer (linear_cpu.cpp).
//
// x [M, K] and w [N, K] fp32, contiguous, on the CPU; bias [N] fp32 contiguous
// or none (already validated). Returns x @ w^T + bias, [M, N] fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace medha {

at::Tensor linear_small_m_cpu(const at::Tensor& x, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias);

// SwiGLU over a fused gate/up weight w [2 I, K] ([gate; up], no bias): silu(x gate^T) *
// (x up^T), [M, I] fp32. Fused into the product's epilogue from 17 to 32 rows on AVX-512
// builds; otherwise linear_small_m_cpu, then at::silu and at::mul.
at::Tensor linear_silu_mul_cpu(const at::Tensor& x, const at::Tensor& w);

// Whether this build has the AVX2/FMA kernel (else linear_small_m_cpu calls at::linear).
bool linear_small_m_vectorized();

// The widest kernel in this build: "avx512" (row kernel below 9 rows, column kernel from
// 9), "avx2" (row kernel only) or "" (at::linear).
const char* linear_small_m_isa();

}  // namespace medha
