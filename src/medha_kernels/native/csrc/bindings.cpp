// Python bindings: argument checks, then dispatch on the tensors' device.
//
// The kernels need contiguous inputs; medha_kernels.native makes them so
// before calling here (and copies back for a non-contiguous in-place target).
#include <ATen/core/grad_mode.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "attention.h"
#include "linear.h"
#include "merge.h"
#include "argmax.h"
#include "norm.h"
#include "rotary.h"

namespace medha {
namespace {

bool float_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kHalf || d == at::kBFloat16;
}

// v [..., H, D] of rank `rank` and s = v's shape without D, fp32, same device.
void check_state(const std::string& name, const at::Tensor& v, const at::Tensor& s, int64_t rank) {
  TORCH_CHECK(v.dim() == rank, name, "v: expected ", rank, "-D, got ", v.sizes());
  TORCH_CHECK(float_dtype(v), name, "v: expected fp16, bf16 or fp32, got ", v.scalar_type());
  TORCH_CHECK(s.scalar_type() == at::kFloat, name, "s: expected fp32, got ", s.scalar_type());
  TORCH_CHECK(s.sizes() == v.sizes().slice(0, rank - 1), name, "s: expected shape ",
              v.sizes().slice(0, rank - 1), ", got ", s.sizes());
  TORCH_CHECK(s.device() == v.device(), name, "s: expected device ", v.device());
  TORCH_CHECK(v.is_contiguous() && s.is_contiguous(), name, "v and s must be contiguous");
}

void check_like(const std::string& name, const at::Tensor& v, const at::Tensor& like) {
  TORCH_CHECK(v.sizes() == like.sizes() && v.scalar_type() == like.scalar_type() &&
                  v.device() == like.device(),
              name, "v: expected ", like.sizes(), " ", like.scalar_type(), " on ", like.device());
}

[[noreturn]] void no_cuda() {
  TORCH_CHECK(false, "medha native merge: this build has no CUDA kernels");
}

}  // namespace

// linear_add_rms_norm's inputs: x [M, K] (0 < M <= max_rows, K > 0), w [N, K], residual
// [M, N], norm_weight [N], all fp32 on the CPU, w and norm_weight contiguous, no autograd.
// Checked here, not in Python: a decode layer calls this once, and each tensor attribute read
// from Python costs more than the check.
bool fits_linear_add_rms_norm(const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor& residual, const at::Tensor& norm_weight,
                              int64_t max_rows) {
  const auto f = at::kFloat;
  if (!(x.is_cpu() && w.is_cpu() && residual.is_cpu() && norm_weight.is_cpu() &&
        x.scalar_type() == f && w.scalar_type() == f && residual.scalar_type() == f &&
        norm_weight.scalar_type() == f && x.dim() == 2 && w.dim() == 2 && residual.dim() == 2 &&
        norm_weight.dim() == 1 && x.size(0) > 0 && x.size(0) <= max_rows && x.size(1) > 0 &&
        x.size(1) == w.size(1) && residual.size(0) == x.size(0) &&
        residual.size(1) == w.size(0) && norm_weight.size(0) == w.size(0) && w.is_contiguous() &&
        norm_weight.is_contiguous())) {
    return false;
  }
  return !(at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() ||
                                          residual.requires_grad() ||
                                          norm_weight.requires_grad()));
}

std::tuple<at::Tensor, at::Tensor> merge_state(const at::Tensor& v_a, const at::Tensor& s_a,
                                               const at::Tensor& v_b, const at::Tensor& s_b) {
  check_state("", v_a, s_a, 3);
  check_state("b: ", v_b, s_b, 3);
  check_like("b: ", v_b, v_a);
  if (v_a.is_cuda()) {
#ifdef MEDHA_WITH_CUDA
    return merge_state_cuda(v_a, s_a, v_b, s_b);
#else
    no_cuda();
#endif
  }
  TORCH_CHECK(v_a.is_cpu(), "unsupported device ", v_a.device());
  return merge_state_cpu(v_a, s_a, v_b, s_b);
}

void merge_state_in_place(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_other,
                          const at::Tensor& s_other, const std::optional<at::Tensor>& mask) {
  check_state("", v, s, 3);
  check_state("other: ", v_other, s_other, 3);
  check_like("other: ", v_other, v);
  at::Tensor m;
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 1 && m.size(0) == v.size(0) &&
                    m.is_contiguous() && m.device() == v.device(),
                "mask: expected a contiguous bool [", v.size(0), "] on ", v.device());
  }
  if (v.is_cuda()) {
#ifdef MEDHA_WITH_CUDA
    return merge_state_in_place_cuda(v, s, v_other, s_other, m);
#else
    no_cuda();
#endif
  }
  TORCH_CHECK(v.is_cpu(), "unsupported device ", v.device());
  merge_state_in_place_cpu(v, s, v_other, s_other, m);
}

std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& v, const at::Tensor& s) {
  check_state("", v, s, 4);
  if (v.is_cuda()) {
#ifdef MEDHA_WITH_CUDA
    return merge_states_cuda(v, s);
#else
    no_cuda();
#endif
  }
  TORCH_CHECK(v.is_cpu(), "unsupported device ", v.device());
  return merge_states_cpu(v, s);
}

std::optional<std::tuple<at::Tensor, at::Tensor>> publish_merge_states(
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& v, const at::Tensor& s,
    int64_t index, int64_t flags, int64_t flag_stride, int64_t seq, double spin_s) {
  check_state("publish_merge_states: ", v, s, 4);
  TORCH_CHECK(v.is_cpu() && v.scalar_type() == at::kFloat && v.is_contiguous() &&
                  s.is_contiguous(),
              "publish_merge_states: expected contiguous fp32 CPU states, got ",
              v.scalar_type(), " on ", v.device());
  const int64_t T = v.size(0), N = v.size(1), H = v.size(2), D = v.size(3);
  TORCH_CHECK(out.is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 3 &&
                  out.size(0) == T && out.size(1) == H && out.size(2) == D,
              "publish_merge_states: out: expected fp32 [", T, ", ", H, ", ", D, "] on the CPU, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(lse.is_cpu() && lse.scalar_type() == at::kFloat && lse.dim() == 2 &&
                  lse.size(0) == T && lse.size(1) == H,
              "publish_merge_states: lse: expected fp32 [", T, ", ", H, "] on the CPU, got ",
              lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(index >= 0 && index < N, "publish_merge_states: index ", index, " not in [0, ", N,
              ")");
  TORCH_CHECK(flags != 0 && flag_stride >= 8 && flag_stride % 4 == 0,
              "publish_merge_states: bad flags address or stride ", flag_stride);
  return publish_merge_states_cpu(out, lse, v, s, index, flags, flag_stride, seq, spin_s);
}

void check_cpu_i32(const std::string& name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(),
              name, ": expected a contiguous int32 CPU tensor of rank ", dim);
}

at::Tensor plan_paged_attention(const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                                const at::Tensor& q_start, int64_t num_kv_heads, int64_t group,
                                bool causal) {
  check_cpu_i32("cu_seqlens_q", cu_seqlens_q, 1);
  check_cpu_i32("kv_lens", kv_lens, 1);
  check_cpu_i32("q_start", q_start, 1);
  TORCH_CHECK(cu_seqlens_q.size(0) == kv_lens.size(0) + 1 && q_start.size(0) == kv_lens.size(0),
              "cu_seqlens_q, kv_lens and q_start disagree on the batch size");
  TORCH_CHECK(num_kv_heads >= 1 && group >= 1, "num_kv_heads and group must be >= 1");
  return plan_paged_attention_cpu(cu_seqlens_q, kv_lens, q_start, num_kv_heads, group, causal);
}

std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens, const at::Tensor& q_start,
    const at::Tensor& block_table, const at::Tensor& tasks, bool causal, double sm_scale) {
  TORCH_CHECK(q.is_cpu() && q.dim() == 3 && float_dtype(q) && q.is_contiguous(),
              "q: expected a contiguous CPU [num_q, num_qo_heads, head_dim] float tensor");
  for (const auto* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->is_cpu() && c->dim() == 4 && c->scalar_type() == q.scalar_type() &&
                    c->is_contiguous() && c->size(3) == q.size(2),
                "k_cache/v_cache: expected contiguous [num_blocks, block_size, num_kv_heads, ",
                q.size(2), "] tensors of q's dtype on the CPU");
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache's shape differs from k_cache's");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_qo_heads must be a multiple of num_kv_heads");
  check_cpu_i32("cu_seqlens_q", cu_seqlens_q, 1);
  check_cpu_i32("kv_lens", kv_lens, 1);
  check_cpu_i32("q_start", q_start, 1);
  check_cpu_i32("block_table", block_table, 2);
  check_cpu_i32("tasks", tasks, 2);
  TORCH_CHECK(tasks.size(1) == 5, "tasks: expected [num_tasks, 5] from plan_paged_attention");
  return paged_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, kv_lens, q_start, block_table,
                             tasks, causal, sm_scale);
}

// paged_attention with the step's planned arguments first, so that a plan binds them
// once (functools.partial) and each layer's call is (q, k_cache, v_cache) with no
// Python frame; the three are made contiguous here.
std::tuple<at::Tensor, at::Tensor> paged_attention_planned(
    const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens, const at::Tensor& q_start,
    const at::Tensor& block_table, const at::Tensor& tasks, bool causal, double sm_scale,
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return paged_attention(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), cu_seqlens_q,
                         kv_lens, q_start, block_table, tasks, causal, sm_scale);
}

}  // namespace medha

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "medha native merge kernels (natural-log LSE; empty state = (0, -inf))";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("merge_state", &medha::merge_state, "Merge two states [T, H, D] / [T, H].",
        py::arg("v_a"), py::arg("s_a"), py::arg("v_b"), py::arg("s_b"), nogil);
  m.def("merge_state_in_place", &medha::merge_state_in_place,
        "Merge (v_other, s_other) into (v, s); rows with mask False are never written.",
        py::arg("v"), py::arg("s"), py::arg("v_other"), py::arg("s_other"),
        py::arg("mask") = py::none(), nogil);
  m.def("merge_states", &medha::merge_states, "Merge N states [T, N, H, D] / [T, N, H].",
        py::arg("v"), py::arg("s"), nogil);
  m.def("publish_merge_states", &medha::publish_merge_states,
        "Copy a state into its shared slots, publish seq, wait up to spin_s for the peers, "
        "merge (None if a peer is later).",
        py::arg("out"), py::arg("lse"), py::arg("v"), py::arg("s"), py::arg("index"),
        py::arg("flags"), py::arg("flag_stride"), py::arg("seq"), py::arg("spin_s"), nogil);
  m.def("plan_paged_attention", &medha::plan_paged_attention,
        "CPU paged attention: the step's task list [T, 5] int32 (plan once per step).",
        py::arg("cu_seqlens_q"), py::arg("kv_lens"), py::arg("q_start"), py::arg("num_kv_heads"),
        py::arg("group"), py::arg("causal"), nogil);
  m.def("paged_attention", &medha::paged_attention,
        "CPU paged attention with natural-log LSE over a planned task list.", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("cu_seqlens_q"), py::arg("kv_lens"),
        py::arg("q_start"), py::arg("block_table"), py::arg("tasks"), py::arg("causal"),
        py::arg("sm_scale"), nogil);
  m.def("paged_attention_planned", &medha::paged_attention_planned,
        "paged_attention(q, k_cache, v_cache, ...) with the planned arguments first (q, "
        "k_cache and v_cache made contiguous).",
        py::arg("cu_seqlens_q"), py::arg("kv_lens"), py::arg("q_start"), py::arg("block_table"),
        py::arg("tasks"), py::arg("causal"), py::arg("sm_scale"), py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), nogil);
  m.def(
      "linear_small_m",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
        TORCH_CHECK(x.is_cpu() && w.is_cpu(), "linear_small_m: CPU tensors only");
        TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                    "linear_small_m: fp32 only, got ", x.scalar_type(), " and ", w.scalar_type());
        TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                    "linear_small_m: expected x [M, K] and w [N, K], got ", x.sizes(), " and ",
                    w.sizes());
        TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_small_m: not contiguous");
        if (bias.has_value()) {
          TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                          bias->size(0) == w.size(0) && bias->is_contiguous() && bias->is_cpu(),
                      "linear_small_m: bias must be a contiguous fp32 [", w.size(0), "]");
        }
        return medha::linear_small_m_cpu(x, w, bias);
      },
      "x [M, K] @ w [N, K]^T (+ bias) in fp32 on the CPU, w streamed once (small M).",
      py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), nogil);
  m.def(
      "linear_silu_mul",
      [](const at::Tensor& x, const at::Tensor& w) {
        TORCH_CHECK(x.is_cpu() && w.is_cpu(), "linear_silu_mul: CPU tensors only");
        TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                    "linear_silu_mul: fp32 only, got ", x.scalar_type(), " and ",
                    w.scalar_type());
        TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                        w.size(0) % 2 == 0,
                    "linear_silu_mul: expected x [M, K] and w [2 I, K], got ", x.sizes(),
                    " and ", w.sizes());
        TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_silu_mul: not contiguous");
        return medha::linear_silu_mul_cpu(x, w);
      },
      "SwiGLU: silu(x @ gate^T) * (x @ up^T) for w = [gate; up] [2 I, K], fp32 on the CPU.",
      py::arg("x"), py::arg("w"), nogil);
  m.def(
      "linear_add_rms_norm",
      [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& residual,
         const at::Tensor& norm_weight, double eps,
         int64_t max_rows) -> std::optional<std::tuple<at::Tensor, at::Tensor>> {
        if (!medha::fits_linear_add_rms_norm(x, w, residual, norm_weight, max_rows)) {
          return std::nullopt;
        }
        return medha::linear_add_rms_norm_cpu(x.contiguous(), w, residual.contiguous(),
                                              norm_weight, eps);
      },
      "(h, rms_norm(h)) for h = x @ w^T + residual, fp32 on the CPU, one call; None where\n"
      "the tensors do not fit (dtype, device, shapes, more than max_rows rows, autograd).",
      py::arg("x"), py::arg("w"), py::arg("residual"), py::arg("norm_weight"), py::arg("eps"),
      py::arg("max_rows"), nogil);
  m.def(
      "linear_add_rms_norm_swiglu",
      [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& residual,
         const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
         const at::Tensor& down,
         int64_t max_rows) -> std::optional<std::tuple<at::Tensor, at::Tensor>> {
        const int64_t n = w.size(0);
        if (!(medha::fits_linear_add_rms_norm(x, w, residual, norm_weight, max_rows) &&
              gate_up.is_cpu() && down.is_cpu() && gate_up.scalar_type() == at::kFloat &&
              down.scalar_type() == at::kFloat && gate_up.dim() == 2 && down.dim() == 2 &&
              gate_up.size(0) > 0 && gate_up.size(0) % 2 == 0 && gate_up.size(1) == n &&
              down.size(0) == n && down.size(1) == gate_up.size(0) / 2 &&
              gate_up.is_contiguous() && down.is_contiguous())) {
          return std::nullopt;
        }
        if (at::GradMode::is_enabled() && (gate_up.requires_grad() || down.requires_grad())) {
          return std::nullopt;
        }
        return medha::linear_add_rms_norm_swiglu_cpu(x.contiguous(), w, residual.contiguous(),
                                                     norm_weight, eps, gate_up, down);
      },
      "(h, down(silu(n gate^T) * (n up^T))) for (h, n) = linear_add_rms_norm(...), fp32 on\n"
      "the CPU, one call; None where the tensors do not fit.",
      py::arg("x"), py::arg("w"), py::arg("residual"), py::arg("norm_weight"), py::arg("eps"),
      py::arg("gate_up"), py::arg("down"), py::arg("max_rows"), nogil);
  m.def(
      "rms_norm_qkv_rotary",
      [](const at::Tensor& x, const std::optional<at::Tensor>& residual,
         const at::Tensor& norm_weight, double eps, const at::Tensor& w_qkv,
         int64_t num_q_heads, int64_t num_kv_heads, const at::Tensor& cos2,
         const at::Tensor& sin2, const std::optional<at::Tensor>& k_cache,
         const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& index,
         int64_t max_rows) -> std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> {
        const auto f = at::kFloat;
        const int64_t m = x.dim() == 2 ? x.size(0) : 0, heads = num_q_heads + 2 * num_kv_heads;
        if (!(num_q_heads > 0 && num_kv_heads > 0 && x.is_cpu() && x.scalar_type() == f &&
              x.dim() == 2 && m > 0 && m <= max_rows && x.size(1) > 0 && x.is_contiguous() &&
              norm_weight.is_cpu() && norm_weight.scalar_type() == f && norm_weight.dim() == 1 &&
              norm_weight.size(0) == x.size(1) && norm_weight.is_contiguous() && w_qkv.is_cpu() &&
              w_qkv.scalar_type() == f && w_qkv.dim() == 2 && w_qkv.size(1) == x.size(1) &&
              w_qkv.size(0) % heads == 0 && (w_qkv.size(0) / heads) % 2 == 0 &&
              w_qkv.size(0) > 0 && w_qkv.is_contiguous())) {
          return std::nullopt;
        }
        if (residual.has_value() &&
            !(residual->is_cpu() && residual->scalar_type() == f &&
              residual->sizes() == x.sizes() && residual->is_contiguous())) {
          return std::nullopt;
        }
        const int64_t d = w_qkv.size(0) / heads;
        for (const auto* t : {&cos2, &sin2}) {
          if (!(t->is_cpu() && t->scalar_type() == f && t->dim() == 4 && t->size(0) == m &&
                t->size(1) == 1 && t->size(2) == 2 && t->size(3) == d / 2)) {
            return std::nullopt;
          }
        }
        if (k_cache.has_value() != index.has_value() || v_cache.has_value() != index.has_value()) {
          return std::nullopt;
        }
        if (index.has_value()) {
          for (const auto* c : {&*k_cache, &*v_cache}) {
            if (!(c->is_cpu() && c->scalar_type() == f && c->dim() == 4 && c->is_contiguous() &&
                  c->size(2) == num_kv_heads && c->size(3) == d &&
                  c->sizes() == k_cache->sizes())) {
              return std::nullopt;
            }
          }
          if (!(index->is_cpu() && index->scalar_type() == at::kLong && index->dim() == 1 &&
                index->size(0) == m && index->is_contiguous())) {
            return std::nullopt;
          }
        }
        if (at::GradMode::is_enabled() &&
            (x.requires_grad() || norm_weight.requires_grad() || w_qkv.requires_grad() ||
             (residual.has_value() && residual->requires_grad()))) {
          return std::nullopt;
        }
        return medha::rms_norm_qkv_rotary_cpu(x, residual, norm_weight, eps, w_qkv, num_q_heads,
                                              num_kv_heads, cos2, sin2, k_cache, v_cache, index);
      },
      "A decode layer before its attention (TP 1): (h, n) = rms_norm(x, norm_weight, eps,\n"
      "residual), qkv = n @ w_qkv^T, q and k rotated (rotary_), k and v written at index\n"
      "(write_kv) when given; returns (h, q [M, Hq, D], qkv), fp32 on the CPU, one call;\n"
      "None where the tensors do not fit.",
      py::arg("x"), py::arg("residual"), py::arg("norm_weight"), py::arg("eps"),
      py::arg("w_qkv"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("cos2"),
      py::arg("sin2"), py::arg("k_cache"), py::arg("v_cache"), py::arg("index"),
      py::arg("max_rows"), nogil);
  m.def(
      "row_argmax",
      [](const at::Tensor& x) -> std::optional<at::Tensor> {
        TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat,
                    "row_argmax: fp32 CPU logits only, got ", x.scalar_type(), " on ",
                    x.device());
        TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.is_contiguous(),
                    "row_argmax: expected contiguous logits [M, V] with V > 0, got ", x.sizes());
        return medha::row_argmax_cpu(x);
      },
      "int64 [M]: the first index of each row's maximum of fp32 [M, V] logits (as torch's\n"
      "max(dim=-1).indices); None when a row holds a NaN.",
      py::arg("x"), nogil);
  m.def(
      "rms_norm",
      [](const at::Tensor& x, const at::Tensor& weight, double eps,
         const std::optional<at::Tensor>& residual) {
        TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "rms_norm: CPU tensors only");
        TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
                    "rms_norm: fp32 only, got ", x.scalar_type(), " and ", weight.scalar_type());
        TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0),
                    "rms_norm: expected x [M, K] and weight [K], got ", x.sizes(), " and ",
                    weight.sizes());
        TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: not contiguous");
        if (residual.has_value()) {
          TORCH_CHECK(residual->is_cpu() && residual->scalar_type() == at::kFloat &&
                          residual->sizes() == x.sizes() && residual->is_contiguous(),
                      "rms_norm: residual must be a contiguous fp32 CPU ", x.sizes());
        }
        return medha::rms_norm_cpu(x, weight, eps, residual);
      },
      "transformers' RMSNorm in fp32 on the CPU: (h, weight * h * rsqrt(mean(h * h) + eps)),\n"
      "h = x + residual (or x).",
      py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), nogil);
  m.def(
      "rotary_",
      [](const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2) {
        TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                        x.stride(2) == 1 && x.size(2) % 2 == 0,
                    "rotary_: x must be an fp32 CPU [N, H, D] with an even, contiguous D");
        const int64_t n = x.size(0), half = x.size(2) / 2;
        for (const auto* t : {&cos2, &sin2}) {
          TORCH_CHECK(t->is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 &&
                          t->size(0) == n && t->size(1) == 1 && t->size(2) == 2 &&
                          t->size(3) == half,
                      "rotary_: cos2 and sin2 must be fp32 CPU [", n, ", 1, 2, ", half, "]");
        }
        medha::rotary_cpu(x, cos2, sin2);
      },
      "Rotate x [N, H, D] in place (rotate-half) with rotary_tables' cos2 and sin2, fp32.",
      py::arg("x"), py::arg("cos2"), py::arg("sin2"), nogil);
  m.def(
      "rotary_tables",
      [](const at::Tensor& positions, const at::Tensor& inv_freq,
         double scale) -> std::optional<std::tuple<at::Tensor, at::Tensor>> {
        if (!(positions.is_cpu() && positions.scalar_type() == at::kLong &&
              positions.dim() == 1 && inv_freq.is_cpu() &&
              inv_freq.scalar_type() == at::kFloat && inv_freq.dim() == 1 &&
              inv_freq.is_contiguous())) {
          return std::nullopt;
        }
        return medha::rotary_tables_cpu(positions, inv_freq, scale);
      },
      "(cos2, sin2) [N, 1, 2, D/2] fp32 for rotary_ from int64 CPU positions [N] and fp32\n"
      "inv_freq [D/2] (cos and sin of positions x inv_freq, times scale unless 1); None\n"
      "where the tensors do not fit.",
      py::arg("positions"), py::arg("inv_freq"), py::arg("scale"), nogil);
  m.def(
      "write_kv",
      [](const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& index) {
        TORCH_CHECK(k.is_cpu() && v.is_cpu() && k.dim() == 3 && v.sizes() == k.sizes() &&
                        k.stride(2) == 1 && v.stride(2) == 1 &&
                        v.scalar_type() == k.scalar_type(),
                    "write_kv: k and v must be CPU [N, H, D] of one dtype, last dim contiguous");
        for (const auto* c : {&k_cache, &v_cache}) {
          TORCH_CHECK(c->is_cpu() && c->dim() == 4 && c->is_contiguous() &&
                          c->scalar_type() == k.scalar_type() && c->size(2) == k.size(1) &&
                          c->size(3) == k.size(2) && c->sizes() == k_cache.sizes(),
                      "write_kv: caches must be contiguous [num_blocks, block_size, ", k.size(1),
                      ", ", k.size(2), "] of k's dtype on the CPU");
        }
        TORCH_CHECK(index.is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1 &&
                        index.size(0) == k.size(0) && index.is_contiguous(),
                    "write_kv: index must be a contiguous int64 CPU [", k.size(0), "]");
        medha::write_kv_cpu(k, v, k_cache, v_cache, index);
      },
      "Copy k, v [N, H, D] to slots index [N] of the paged caches (CPU).", py::arg("k"),
      py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("index"), nogil);
  m.attr("linear_small_m_vectorized") = medha::linear_small_m_vectorized();
  m.attr("linear_small_m_isa") = std::string(medha::linear_small_m_isa());
#ifdef MEDHA_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
