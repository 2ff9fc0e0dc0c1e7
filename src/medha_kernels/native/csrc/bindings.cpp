// Python bindings: argument checks, then dispatch on the tensors' device.
//
// The kernels need contiguous inputs; medha_kernels.native makes them so
// before calling here (and copies back for a non-contiguous in-place target).
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "merge.h"

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
#ifdef MEDHA_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
