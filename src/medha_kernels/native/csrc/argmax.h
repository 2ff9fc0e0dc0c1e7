// Declarations for the CPU row arg-max (argmax_cpu.cpp).
//
// x [M, V] fp32, contiguous, on the CPU, V > 0 (already validated).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace medha {

// int64 [M]: the first index of each row's maximum (as torch's max(dim=-1).indices and
// argmax on rows without NaN), or nullopt when a row holds a NaN (the caller asks torch,
// whose NaN rule is then the one that counts).
std::optional<at::Tensor> row_argmax_cpu(const at::Tensor& x);

}  // namespace medha
