// Declarations for the CPU RMSNorm (norm_cpu.cpp), transformers' arithmetic bit for bit.
//
// x, residual [M, K] and weight [K] fp32, contiguous, on the CPU (already validated).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace medha {

// weight * (x * rsqrt(mean(x * x, -1) + eps)), [M, K] fp32; with a residual, h = x + residual
// is normalized instead and returned first: (h, norm(h)) (else (x, norm(x))).
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                double eps,
                                                const std::optional<at::Tensor>& residual);

}  // namespace medha
