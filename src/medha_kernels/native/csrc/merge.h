// Declarations shared by bindings.cpp, merge_cpu.cpp and merge_cuda.cu.
//
// Every function takes contiguous tensors (the Python wrapper makes them so):
// v [T, H, D] or [T, N, H, D] in fp16/bf16/fp32, s fp32 [T, H] or [T, N, H]
// holding natural-log LSEs, mask a bool [T] or an undefined tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace medha {

std::tuple<at::Tensor, at::Tensor> merge_state_cpu(
    const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b);
void merge_state_in_place_cpu(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_other,
                              const at::Tensor& s_other, const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> merge_states_cpu(const at::Tensor& v, const at::Tensor& s);

// One rank's step of a shared-memory all-gather-and-merge (medha_parallel.shm's
// protocol): copies this rank's state out [T, H, D] / lse [T, H] into its slots
// v[:, index] / s[:, index] (fp32 [T, N, H, D] / [T, N, H] over the shared
// buffer), stores seq (mod 2**32) into its int32 flag at flags + index *
// flag_stride (release), makes a futex wake on it if a peer's sleeping word
// (the int32 after its flag) is set, then yields the core until every peer's
// flag reached seq, for at most spin_s seconds: returns merge_states_cpu(v, s),
// or nullopt when a peer is later than that (published; the caller waits).
std::optional<std::tuple<at::Tensor, at::Tensor>> publish_merge_states_cpu(
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& v, const at::Tensor& s,
    int64_t index, int64_t flags, int64_t flag_stride, int64_t seq, double spin_s);

#ifdef MEDHA_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> merge_state_cuda(
    const at::Tensor& v_a, const at::Tensor& s_a, const at::Tensor& v_b, const at::Tensor& s_b);
void merge_state_in_place_cuda(const at::Tensor& v, const at::Tensor& s,
                               const at::Tensor& v_other, const at::Tensor& s_other,
                               const at::Tensor& mask);
std::tuple<at::Tensor, at::Tensor> merge_states_cuda(const at::Tensor& v, const at::Tensor& s);
#endif

}  // namespace medha
