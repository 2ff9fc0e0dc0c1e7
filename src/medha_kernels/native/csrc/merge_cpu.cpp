// CPU merge kernels: one pass per (token, head) row, float accumulation,
// tokens split across threads with at::parallel_for, 64-bit offsets.
//
// A state whose LSE is -inf, +inf or NaN is empty: its v is never read. The
// weights are exp(s - m) with m the largest finite LSE, so any common offset
// is exact; all states empty gives (0, -inf).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <limits>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "merge.h"

namespace medha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// State n of token t, head h: v at v[n] + t * v_tok + h * D, s at s[n] + t * s_tok + h.
template <typename scalar_t>
struct States {
  std::vector<const scalar_t*> v;
  std::vector<const float*> s;
  int64_t v_tok;
  int64_t s_tok;
};

// Writes out[t, h, :] and lse[t, h] (contiguous [T, H, D] / [T, H]) for every
// token whose mask entry is true (all tokens when mask is null). The output may
// alias state 0: each row is read completely before it is written.
template <typename scalar_t>
void merge_rows(const States<scalar_t>& in, int64_t T, int64_t H, int64_t D, scalar_t* out,
                float* lse, const bool* mask) {
  const auto N = static_cast<int64_t>(in.v.size());
  const int64_t work_per_token = std::max<int64_t>(1, (N + 1) * H * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / work_per_token);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    std::vector<float> s_row(N);
    for (int64_t t = begin; t < end; ++t) {
      if (mask != nullptr && !mask[t]) continue;  // never written
      for (int64_t h = 0; h < H; ++h) {
        float m = kNegInf;
        for (int64_t n = 0; n < N; ++n) {
          const float x = in.s[n][t * in.s_tok + h];
          s_row[n] = x;
          if (std::isfinite(x) && x > m) m = x;
        }
        scalar_t* o = out + (t * H + h) * D;
        float* l = lse + t * H + h;
        if (m == kNegInf) {  // every state empty
          std::fill(o, o + D, static_cast<scalar_t>(0.0f));
          *l = kNegInf;
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float total = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
          const float x = s_row[n];
          const float w = std::isfinite(x) ? std::exp(x - m) : 0.0f;
          if (!(w > 0.0f)) continue;  // select, never multiply: garbage v cannot leak
          total += w;
          const scalar_t* vn = in.v[n] + t * in.v_tok + h * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(vn[d]);
        }
        // total >= 1: the state attaining m has weight exp(0).
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d] / total);
        *l = m + std::log(total);
      }
    }
  });
}

#define MEDHA_DISPATCH(TYPE, NAME, ...)                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_state_cpu(const at::Tensor& v_a, const at::Tensor& s_a,
                                                   const at::Tensor& v_b, const at::Tensor& s_b) {
  const int64_t T = v_a.size(0), H = v_a.size(1), D = v_a.size(2);
  at::Tensor out = at::empty({T, H, D}, v_a.options());
  at::Tensor lse = at::empty({T, H}, s_a.options());
  MEDHA_DISPATCH(v_a.scalar_type(), "merge_state_cpu", [&] {
    States<scalar_t> in{{v_a.const_data_ptr<scalar_t>(), v_b.const_data_ptr<scalar_t>()},
                        {s_a.const_data_ptr<float>(), s_b.const_data_ptr<float>()},
                        H * D,
                        H};
    merge_rows(in, T, H, D, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), nullptr);
  });
  return {out, lse};
}

void merge_state_in_place_cpu(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_other,
                              const at::Tensor& s_other, const at::Tensor& mask) {
  const int64_t T = v.size(0), H = v.size(1), D = v.size(2);
  const bool* mask_ptr = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  MEDHA_DISPATCH(v.scalar_type(), "merge_state_in_place_cpu", [&] {
    scalar_t* out = v.data_ptr<scalar_t>();
    float* lse = s.data_ptr<float>();
    States<scalar_t> in{{out, v_other.const_data_ptr<scalar_t>()},
                        {lse, s_other.const_data_ptr<float>()},
                        H * D,
                        H};
    merge_rows(in, T, H, D, out, lse, mask_ptr);
  });
}

std::tuple<at::Tensor, at::Tensor> merge_states_cpu(const at::Tensor& v, const at::Tensor& s) {
  const int64_t T = v.size(0), N = v.size(1), H = v.size(2), D = v.size(3);
  at::Tensor out = at::empty({T, H, D}, v.options());
  at::Tensor lse = at::empty({T, H}, s.options());
  if (T == 0) return {out, lse};
  MEDHA_DISPATCH(v.scalar_type(), "merge_states_cpu", [&] {
    States<scalar_t> in{{}, {}, N * H * D, N * H};
    for (int64_t n = 0; n < N; ++n) {
      in.v.push_back(v.const_data_ptr<scalar_t>() + n * H * D);
      in.s.push_back(s.const_data_ptr<float>() + n * H);
    }
    merge_rows(in, T, H, D, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), nullptr);
  });
  return {out, lse};
}

namespace {

double monotonic_s() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> publish_merge_states_cpu(
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& v, const at::Tensor& s,
    int64_t index, int64_t flags, int64_t flag_stride, int64_t seq, double spin_s) {
  const int64_t N = v.size(1);
  // this rank's state into its slots: a decode's (one token) are contiguous
  at::Tensor v_mine = v.select(1, index), s_mine = s.select(1, index);
  if (out.is_contiguous() && lse.is_contiguous() && v_mine.is_contiguous() &&
      s_mine.is_contiguous()) {
    std::memcpy(v_mine.data_ptr(), out.const_data_ptr(), out.nbytes());
    std::memcpy(s_mine.data_ptr(), lse.const_data_ptr(), lse.nbytes());
  } else {
    v_mine.copy_(out.detach());  // detached: a state that requires grad records nothing
    s_mine.copy_(lse.detach());
  }
#ifdef __linux__
  char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(flags));
  auto flag = [&](int64_t r) { return reinterpret_cast<int32_t*>(base + r * flag_stride); };
  const auto value = static_cast<uint32_t>(seq);  // the flags wrap modulo 2**32
  // publish (the slot's stores come before the flag's); wake sleepers. Sequentially
  // consistent, so the sleeping-word loads below cannot pass the flag's store (x86 lets
  // a later load pass an earlier plain or release store): a peer that starts to sleep
  // meanwhile either sees the flag or is seen asleep and woken
  __atomic_store_n(flag(index), static_cast<int32_t>(value), __ATOMIC_SEQ_CST);
  for (int64_t r = 0; r < N; ++r) {
    if (r != index && __atomic_load_n(flag(r) + 1, __ATOMIC_RELAXED) != 0) {
      syscall(SYS_futex, flag(index), FUTEX_WAKE, static_cast<int>(N), nullptr, nullptr, 0);
      break;
    }
  }
  auto reached = [&](int64_t r) {
    const auto seen = static_cast<uint32_t>(__atomic_load_n(flag(r), __ATOMIC_ACQUIRE));
    return static_cast<int32_t>(seen - value) >= 0;
  };
  double end = -1.0;
  for (int64_t r = 0; r < N; ++r) {
    while (r != index && !reached(r)) {
      const double now = monotonic_s();
      if (end < 0.0) {
        end = now + spin_s;
      } else if (now > end) {
        return std::nullopt;  // published; the caller waits for the rest
      }
      sched_yield();
    }
  }
  return merge_states_cpu(v, s);
#else
  (void)flags;
  (void)flag_stride;
  (void)seq;
  (void)spin_s;
  (void)N;
  TORCH_CHECK(false, "publish_merge_states: shared-memory flags need Linux");
#endif
}

}  // namespace medha
