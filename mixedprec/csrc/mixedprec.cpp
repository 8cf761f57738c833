// Python bindings of mixedprec's fused multi-tensor ops: one entry point per op, dispatching on the device
// of the tensors to the C++ CPU kernels (cpu_kernels.cpp) or, in a CUDA build, the CUDA kernels (*.cu).
#include <torch/extension.h>
#include <vector>
#include "messages.h"

namespace mixedprec {
at::Tensor scale_check_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double);
at::Tensor scale_add_check_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double);
std::vector<at::Tensor> l2norm_cpu(const std::vector<at::Tensor>&);
void sgd_step_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                  const at::Tensor&, double, double, double, double, double, bool, bool, bool);
void adam_step_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                   const std::vector<at::Tensor>&, const at::Tensor&, const std::vector<at::Tensor>&, double, double, double, double, double, double, bool);
#ifdef WITH_CUDA
at::Tensor scale_check_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double, const float*);
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double, const float*);
std::vector<at::Tensor> l2norm_cuda(const std::vector<at::Tensor>&);
void sgd_step_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                   const at::Tensor&, double, double, double, double, double, bool, bool, bool);
void adam_step_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                    const std::vector<at::Tensor>&, const at::Tensor&, const std::vector<at::Tensor>&, double, double, double, double, double, double, bool);
#endif

// Paired tensors of two lists: as many on each side, dense, one memory layout per pair, the same numel, floating point.
// Checked here, for both devices, so that the Python side need not loop over the tensors on every step.
static void check_pairs(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* op) {
  TORCH_CHECK_VALUE(a.size() == b.size(), msg(op, ": tensor lists must have the same length, got ", a.size(), " and ", b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), msg(op, ": paired tensors must have the same number of elements, tensor ", i, " has ",
                      a[i].numel(), " and ", b[i].numel()));
    TORCH_CHECK_VALUE(a[i].is_non_overlapping_and_dense() && b[i].is_non_overlapping_and_dense() &&
                      (a[i].strides() == b[i].strides() || (a[i].is_contiguous() && b[i].is_contiguous()) || a[i].numel() <= 1),
                      msg(op, ": tensor pair ", i, " is not dense or its two memory layouts differ; call .contiguous() on both"));
    TORCH_CHECK_VALUE(at::isFloatingType(a[i].scalar_type()) && at::isFloatingType(b[i].scalar_type()), msg(op, ": tensor ", i, " is not floating point"));
  }
}

static void check_step_pairs(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                             const std::vector<const std::vector<at::Tensor>*>& states, const std::vector<at::Tensor>& out, const char* op) {
  check_pairs(grads, params, op);
  for (auto st : states) check_pairs(params, *st, op);          // state lists the step uses: as long as params
  if (!out.empty()) check_pairs(params, out, op);
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK_VALUE(params[i].scalar_type() == at::kFloat, msg(op, ": the fused optimizer steps update fp32 master params, tensor ", i, " is ", params[i].scalar_type()));
  for (auto st : states)
    for (size_t i = 0; i < st->size(); ++i) TORCH_CHECK_VALUE((*st)[i].scalar_type() == at::kFloat, msg(op, ": optimizer state must be fp32 (tensor ", i, ")"));
}

// True when the list's tensors are CUDA tensors; every tensor of every list must be on that one device.
static bool on_cuda(std::initializer_list<const std::vector<at::Tensor>*> lists, const char* op) {
  const at::Tensor* first = nullptr;
  for (auto l : lists) for (auto& t : *l) {
    if (!first) { first = &t; continue; }
    TORCH_CHECK(t.device() == first->device(), msg(op, ": all tensors must be on one device, got ", first->device(), " and ", t.device()));
  }
  if (!first || !first->is_cuda()) return false;
#ifdef WITH_CUDA
  for (auto l : lists) for (auto& t : *l)
    TORCH_CHECK(t.is_contiguous() || t.is_contiguous(at::MemoryFormat::ChannelsLast), msg(op, ": CUDA tensors must be contiguous"));
  return true;
#else
  TORCH_CHECK(false, msg(op, ": this mixedprec build has no CUDA kernels (it was compiled without nvcc)"));
#endif
}

// dst = src*scale (Add: dst += src*scale) on either device; the flag says whether src held inf or nan. The scale is the
// number `scale`, or `scale_tensor` (a 1-element fp32 tensor on the tensors' device) when given: the CUDA kernels read
// it on the device, so a scale the device computed (the loss scale's inverse, a clip coefficient) costs no host sync.
template <bool Add>
at::Tensor scale_op(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                    const c10::optional<at::Tensor>& scale_tensor, const char* op) {
  check_pairs(src, dst, op);
  const bool has_tensor = scale_tensor.has_value() && scale_tensor->defined();
  if (has_tensor) {
    TORCH_CHECK_VALUE(scale_tensor->scalar_type() == at::kFloat && scale_tensor->numel() == 1, msg(op, ": a tensor scale must be a 1-element fp32 tensor"));
    TORCH_CHECK_VALUE(src.empty() || scale_tensor->device() == src[0].device(), msg(op, ": the tensor scale must be on the tensors' device (",
                      src.empty() ? std::string() : src[0].device().str(), "), got ", scale_tensor->device()));
  }
#ifdef WITH_CUDA
  if (on_cuda({&src, &dst}, op)) {
    const float* ptr = has_tensor ? scale_tensor->data_ptr<float>() : nullptr;
    return Add ? scale_add_check_cuda(src, dst, scale, ptr) : scale_check_cuda(src, dst, scale, ptr);
  }
#else
  on_cuda({&src, &dst}, op);
#endif
  if (has_tensor) scale = scale_tensor->item<float>();           // a CPU tensor: reading it costs nothing
  return Add ? scale_add_check_cpu(src, dst, scale) : scale_check_cpu(src, dst, scale);
}

at::Tensor scale_check(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const c10::optional<at::Tensor>& scale_tensor) {
  return scale_op<false>(src, dst, scale, scale_tensor, "scale_check_");
}
at::Tensor scale_add_check(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const c10::optional<at::Tensor>& scale_tensor) {
  return scale_op<true>(src, dst, scale, scale_tensor, "scale_add_check_");
}

std::vector<at::Tensor> l2norm(const std::vector<at::Tensor>& ts) {
#ifdef WITH_CUDA
  if (on_cuda({&ts}, "l2norm")) return l2norm_cuda(ts);
#else
  on_cuda({&ts}, "l2norm");
#endif
  return l2norm_cpu(ts);
}

void sgd_step(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
              const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled) {
  check_step_pairs(grads, params, !bufs.empty() ? std::vector<const std::vector<at::Tensor>*>{&bufs} : std::vector<const std::vector<at::Tensor>*>{},
                   out, "sgd_step");
#ifdef WITH_CUDA
  if (on_cuda({&grads, &params, &bufs, &out}, "sgd_step"))
    return sgd_step_cuda(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled);
#else
  on_cuda({&grads, &params, &bufs, &out}, "sgd_step");
#endif
  sgd_step_cpu(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled);
}

void adam_step(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
               const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool decoupled) {
  check_step_pairs(grads, params, {&exp_avgs, &exp_avg_sqs}, out, "adam_step");
  TORCH_CHECK_VALUE(steps.size() == params.size(), msg("adam_step: one step count per param, got ", steps.size(), " for ", params.size(), " params"));
  for (size_t i = 0; i < steps.size(); ++i)
    TORCH_CHECK_VALUE(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == params[i].device(),
                      msg("adam_step: step count ", i, " must be a 1-element fp32 tensor on its param's device (", params[i].device(),
                      "), got ", steps[i].scalar_type(), " on ", steps[i].device()));
#ifdef WITH_CUDA
  if (on_cuda({&grads, &params, &exp_avgs, &exp_avg_sqs, &out}, "adam_step"))
    return adam_step_cuda(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled);
#else
  on_cuda({&grads, &params, &exp_avgs, &exp_avg_sqs, &out}, "adam_step");
#endif
  adam_step_cpu(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled);
}

}  // namespace mixedprec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("scale_check", &mixedprec::scale_check, "dst[i] = src[i]*scale in dst's dtype; returns a bool flag: any inf/nan in src",
        py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("scale_tensor") = py::none(), nogil);
  m.def("scale_add_check", &mixedprec::scale_add_check, "dst[i] += src[i]*scale (fp32 math, no FMA); returns a bool flag: any inf/nan in src",
        py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("scale_tensor") = py::none(), nogil);
  m.def("l2norm", &mixedprec::l2norm, "Global L2 norm (fp32, 0-dim) and per-tensor norms (fp32, 1-d) of a list of tensors", nogil);
  m.def("has_cuda", []() {
#ifdef WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "True when this build holds the CUDA kernels");
  m.def("sgd_step", &mixedprec::sgd_step, "torch.optim.SGD's step (or with decoupled weight decay) on fp32 masters from grads*inv_scale, writing the half copy; a no-op when found_inf is set", nogil);
  m.def("adam_step", &mixedprec::adam_step, "torch.optim.Adam/AdamW's step on fp32 masters from grads*inv_scale with per-tensor step counts (used plus one; the caller advances them), writing the half copy; a no-op when found_inf is set", nogil);
}
