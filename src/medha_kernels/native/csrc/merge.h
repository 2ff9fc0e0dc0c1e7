// Declarations shared by bindings.cpp, merge_cpu.cpp and merge_cuda.cu.
//
// Every function takes contiguous tensors (the Python wrapper makes them so):
// v [T, H, D] or [T, N, H, D] in fp16/bf16/fp32, s fp32 [T, H] or [T, N, H]
// holding natural-log LSEs, mask a bool [T] or an undefined tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace medha {

std::tuple<at::Tensor, at::Tensor> merge_state_cpu(
    const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b);
void merge_state_in_place_cpu(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_other,
                              const at::Tensor& s_other, const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> merge_states_cpu(const at::Tensor& v, const at::Tensor& s);

#ifdef MEDHA_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> merge_state_cuda(
    const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b);
void merge_state_in_place_cuda(const at::Tensor& v, const at::Tensor& s,
                               const at::Tensor& v_other, const at::Tensor& s_other,
                               const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> merge_states_cuda(const at::Tensor& v, const at::Tensor& s);
#endif

}  // namespace medha
