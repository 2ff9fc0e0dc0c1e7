// CUDA merge kernels: one thread block per token covering all its heads.
//
// Each thread owns VEC consecutive elements of one head's row (16-byte loads
// when D and the pointers allow, else VEC = 1), accumulates in float and
// recomputes its head's weights from the N LSEs (cheap next to the v traffic).
// Offsets are 64-bit. Semantics match merge_cpu.cpp: a -inf, +inf or NaN LSE
// is empty and its v is never read; all empty gives (0, -inf).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "merge.h"

namespace medha {
namespace {

constexpr int kMaxThreads = 256;

// False for +-inf and NaN (fabsf(NaN) < inf is false); avoids isfinite overloads.
__device__ __forceinline__ bool finite(float x) { return fabsf(x) < __int_as_float(0x7f800000); }

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T x[VEC];
};

// Writes VEC floats as scalar_t, with one 16-byte store when they fill 16 bytes.
template <typename scalar_t, int VEC>
__device__ __forceinline__ void store_row(scalar_t* dst, const float (&val)[VEC]) {
  if constexpr (sizeof(scalar_t) * VEC == 16) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(scalar_t) == 4) {
        w[k] = __float_as_uint(val[k]);
      } else {  // c10::Half / c10::BFloat16: raw bits in .x, little-endian pairs
        const uint32_t lo = static_cast<scalar_t>(val[2 * k]).x;
        const uint32_t hi = static_cast<scalar_t>(val[2 * k + 1]).x;
        w[k] = lo | (hi << 16);
      }
    }
    // __stwb (= a plain st.global.v4): nvcc split an ordinary uint4 assignment here.
    __stwb(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dst[k] = static_cast<scalar_t>(val[k]);
  }
}

// State n of token t: v row base and s row base. Two separate tensors
// (v1 != nullptr: state 1 lives there) or one stacked [T, N, H, D] tensor.
template <typename scalar_t>
struct States {
  const scalar_t* v0;
  const scalar_t* v1;
  const float* s0;
  const float* s1;
  int64_t n, v_tok, v_state, s_tok, s_state;

  __device__ const scalar_t* v(int64_t i, int64_t t) const {
    return (v1 != nullptr && i == 1 ? v1 : v0 + i * v_state) + t * v_tok;
  }
  __device__ const float* s(int64_t i, int64_t t) const {
    return (s1 != nullptr && i == 1 ? s1 : s0 + i * s_state) + t * s_tok;
  }
};

// out and lse may alias state 0 (in place), so no __restrict__ and no __ldg.
// The LSEs are written only after a barrier: every thread of a head reads them.
template <typename scalar_t, int VEC>
__global__ void merge_kernel(States<scalar_t> in, int64_t H, int64_t D, scalar_t* out, float* lse,
                             const bool* mask) {
  extern __shared__ float head_lse[];  // [H]
  const int64_t t = blockIdx.x;
  if (mask != nullptr && !mask[t]) return;  // whole block: rows never written
  const float neg_inf = __int_as_float(0xff800000);
  const int64_t chunks = D / VEC;
  for (int64_t idx = threadIdx.x; idx < H * chunks; idx += blockDim.x) {
    const int64_t h = idx / chunks;
    const int64_t c = idx - h * chunks;
    float m = neg_inf;
    for (int64_t i = 0; i < in.n; ++i) {
      const float x = in.s(i, t)[h];
      if (finite(x)) m = fmaxf(m, x);
    }
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    float total = 0.0f;
    if (m != neg_inf) {
      for (int64_t i = 0; i < in.n; ++i) {
        const float x = in.s(i, t)[h];
        const float w = finite(x) ? expf(x - m) : 0.0f;
        if (!(w > 0.0f)) continue;  // select: an empty state's v is never read
        total += w;
        const auto vv = *reinterpret_cast<const Vec<scalar_t, VEC>*>(in.v(i, t) + h * D + c * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += w * static_cast<float>(vv.x[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = total > 0.0f ? acc[k] / total : 0.0f;
    store_row<scalar_t, VEC>(out + (t * H + h) * D + c * VEC, acc);
    if (c == 0) head_lse[h] = total > 0.0f ? m + logf(total) : neg_inf;
  }
  if (D == 0) {  // no thread owned a chunk: the LSEs are still due
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      float m = neg_inf;
      for (int64_t i = 0; i < in.n; ++i) {
        const float x = in.s(i, t)[h];
        if (finite(x)) m = fmaxf(m, x);
      }
      float total = 0.0f;
      for (int64_t i = 0; i < in.n && m != neg_inf; ++i) {
        const float x = in.s(i, t)[h];
        total += finite(x) ? expf(x - m) : 0.0f;
      }
      head_lse[h] = total > 0.0f ? m + logf(total) : neg_inf;
    }
  }
  __syncthreads();
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) lse[t * H + h] = head_lse[h];
}

template <typename scalar_t>
bool aligned16(const States<scalar_t>& in, const void* out) {
  auto ok = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return ok(in.v0) && (in.v1 == nullptr || ok(in.v1)) && ok(out);
}

template <typename scalar_t>
void launch(const States<scalar_t>& in, int64_t T, int64_t H, int64_t D, scalar_t* out, float* lse,
            const bool* mask, const at::Tensor& like) {
  if (T == 0 || H == 0) return;
  TORCH_CHECK(T <= std::numeric_limits<int32_t>::max(), "too many tokens for one grid: ", T);
  const size_t smem = static_cast<size_t>(H) * sizeof(float);
  TORCH_CHECK(smem <= 48 * 1024, "too many heads for the CUDA merge kernel: ", H);
  const c10::cuda::CUDAGuard guard(like.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kVec = 16 / sizeof(scalar_t);
  const bool vec = D % kVec == 0 && aligned16(in, out);
  const int64_t items = std::max<int64_t>(H * (vec ? D / kVec : D), H);
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (items + 31) / 32 * 32));
  if (vec) {
    merge_kernel<scalar_t, kVec><<<T, threads, smem, stream>>>(in, H, D, out, lse, mask);
  } else {
    merge_kernel<scalar_t, 1><<<T, threads, smem, stream>>>(in, H, D, out, lse, mask);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define MEDHA_DISPATCH(TYPE, NAME, ...)                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_state_cuda(const at::Tensor& v_a, const at::Tensor& s_a,
                                                    const at::Tensor& v_b, const at::Tensor& s_b) {
  const int64_t T = v_a.size(0), H = v_a.size(1), D = v_a.size(2);
  at::Tensor out = at::empty({T, H, D}, v_a.options());
  at::Tensor lse = at::empty({T, H}, s_a.options());
  MEDHA_DISPATCH(v_a.scalar_type(), "merge_state_cuda", [&] {
    const States<scalar_t> in{v_a.const_data_ptr<scalar_t>(), v_b.const_data_ptr<scalar_t>(),
                              s_a.const_data_ptr<float>(), s_b.const_data_ptr<float>(),
                              2, H * D, 0, H, 0};
    launch(in, T, H, D, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), nullptr, v_a);
  });
  return {out, lse};
}

void merge_state_in_place_cuda(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_other,
                               const at::Tensor& s_other, const at::Tensor& mask) {
  const int64_t T = v.size(0), H = v.size(1), D = v.size(2);
  const bool* mask_ptr = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  MEDHA_DISPATCH(v.scalar_type(), "merge_state_in_place_cuda", [&] {
    scalar_t* out = v.data_ptr<scalar_t>();
    float* lse = s.data_ptr<float>();
    const States<scalar_t> in{out, v_other.const_data_ptr<scalar_t>(), lse,
                              s_other.const_data_ptr<float>(), 2, H * D, 0, H, 0};
    launch(in, T, H, D, out, lse, mask_ptr, v);
  });
}

std::tuple<at::Tensor, at::Tensor> merge_states_cuda(const at::Tensor& v, const at::Tensor& s) {
  const int64_t T = v.size(0), N = v.size(1), H = v.size(2), D = v.size(3);
  at::Tensor out = at::empty({T, H, D}, v.options());
  at::Tensor lse = at::empty({T, H}, s.options());
  MEDHA_DISPATCH(v.scalar_type(), "merge_states_cuda", [&] {
    const States<scalar_t> in{v.const_data_ptr<scalar_t>(), nullptr, s.const_data_ptr<float>(),
                              nullptr, N, N * H * D, H * D, N * H, H};
    launch(in, T, H, D, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), nullptr, v);
  });
  return {out, lse};
}

}  // namespace medha
