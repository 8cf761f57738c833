// mixedprec's fused multi-tensor ops as torch custom ops: one schema per op (named arguments, mutations annotated), the
// C++ CPU kernels (cpu_kernels.cpp) registered for the CPU dispatch key and, in a CUDA build, the CUDA kernels (*.cu) for
// the CUDA key. The dispatcher picks the device; each implementation checks its tensors. The namespace is the extension's
// name (mixedprec_cpu_avx512, ...), so that two builds can live in one process. Fake kernels are registered in Python.
// The op registry and ATen's Tensor, and Python's C API for the module's functions: not <torch/extension.h> (the
// whole C++ API) nor pybind11, which took two thirds of the compile time.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <vector>
#include "messages.h"
#define MIXEDPREC_STR2(x) #x
#define MIXEDPREC_STR(x) MIXEDPREC_STR2(x)

namespace mixedprec {
at::Tensor scale_check_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double);
at::Tensor scale_add_check_cpu(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double);
std::vector<at::Tensor> l2norm_cpu(const std::vector<at::Tensor>&);
int64_t stream_min_bytes(int64_t set);
using TV = std::vector<at::Tensor>;
using Seeds = std::optional<at::Tensor>;
void sgd_step_cpu(const TV&, const TV&, const TV&, const TV&, const at::Tensor&, double, double, double, double, double, bool, bool, bool,
                  const TV&, const Seeds&, const Seeds&, const TV&);
void adam_step_cpu(const TV&, const TV&, const TV&, const TV&, const TV&, const at::Tensor&, const TV&, double, double, double, double, double,
                   double, bool, const TV&, const Seeds&, const Seeds&, const TV&);
#ifdef WITH_CUDA
at::Tensor scale_check_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double, const float*);
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double, const float*);
std::vector<at::Tensor> l2norm_cuda(const std::vector<at::Tensor>&);
void sgd_step_cuda(const TV&, const TV&, const TV&, const TV&, const at::Tensor&, double, double, double, double, double, bool, bool, bool,
                   const TV&, const Seeds&, const Seeds&, const TV&);
void adam_step_cuda(const TV&, const TV&, const TV&, const TV&, const TV&, const at::Tensor&, const TV&, double, double, double, double, double,
                    double, bool, const TV&, const Seeds&, const Seeds&, const TV&);
#endif

using TL = at::TensorList;

// Paired tensors of two lists: as many on each side, dense, one memory layout per pair, the same numel, floating point
// (with `codes`, b's may be the int8 or uint8 codes of 8-bit optimizer state instead).
static void check_pairs(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* op, bool codes = false) {
  TORCH_CHECK_VALUE(a.size() == b.size(), msg(op, ": tensor lists must have the same length, got ", a.size(), " and ", b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), msg(op, ": paired tensors must have the same number of elements, tensor ", i, " has ",
                      a[i].numel(), " and ", b[i].numel()));
    TORCH_CHECK_VALUE(a[i].is_non_overlapping_and_dense() && b[i].is_non_overlapping_and_dense() &&
                      (a[i].strides() == b[i].strides() || (a[i].is_contiguous() && b[i].is_contiguous()) || a[i].numel() <= 1),
                      msg(op, ": tensor pair ", i, " is not dense or its two memory layouts differ; call .contiguous() on both"));
    TORCH_CHECK_VALUE(at::isFloatingType(a[i].scalar_type()) && (at::isFloatingType(b[i].scalar_type()) || (codes && (b[i].scalar_type() == at::kChar || b[i].scalar_type() == at::kByte))),
                      msg(op, ": tensor ", i, " is not floating point"));
  }
}

// The masters are fp32 params (with an optional half copy `out`), or bf16 params that are their own masters: split, with
// their int16 low halves in `lows`, or rounded stochastically with one int64 seed per param in `seeds` (bf16_bits.h).
static void check_step_pairs(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                             const std::vector<const std::vector<at::Tensor>*>& states, const std::vector<at::Tensor>& out,
                             const std::vector<at::Tensor>& lows, const Seeds& seeds, const Seeds& state_seeds,
                             const std::vector<at::Tensor>& state_scales, const char* op) {
  check_pairs(grads, params, op);
  for (auto st : states) check_pairs(params, *st, op, true);    // state lists the step uses: as long as params
  if (!out.empty()) check_pairs(params, out, op);
  const bool has_seeds = seeds.has_value() && seeds->defined();
  const bool bf16 = !lows.empty() || has_seeds;
  TORCH_CHECK_VALUE(lows.empty() || !has_seeds, msg(op, ": pass either the low halves of split masters or stochastic-rounding seeds, not both"));
  TORCH_CHECK_VALUE(!bf16 || out.empty(), msg(op, ": bf16 params are their own masters: pass no half copy `out` with `lows` or `seeds`"));
  for (size_t i = 0; i < params.size(); ++i) {
    if (!bf16) {
      TORCH_CHECK_VALUE(params[i].scalar_type() == at::kFloat, msg(op, ": the fused optimizer steps update fp32 master params, tensor ", i, " is ",
                        params[i].scalar_type(), " (bf16 params need `lows` or `seeds`)"));
    } else {
      TORCH_CHECK_VALUE(params[i].scalar_type() == at::kBFloat16, msg(op, ": with `lows` or `seeds` the params are bf16, tensor ", i, " is ", params[i].scalar_type()));
    }
  }
  if (!lows.empty()) {
    TORCH_CHECK_VALUE(lows.size() == params.size(), msg(op, ": one low half per param, got ", lows.size(), " for ", params.size(), " params"));
    for (size_t i = 0; i < lows.size(); ++i)
      TORCH_CHECK_VALUE(lows[i].scalar_type() == at::kShort && lows[i].numel() == params[i].numel() && lows[i].strides() == params[i].strides(),
                        msg(op, ": low half ", i, " must be an int16 tensor laid out as its param"));
  }
  if (has_seeds)
    TORCH_CHECK_VALUE(seeds->scalar_type() == at::kLong && seeds->dim() == 1 && seeds->numel() == (int64_t)params.size() && seeds->is_contiguous() &&
                      (params.empty() || seeds->device() == params[0].device()),
                      msg(op, ": `seeds` must be a 1-d int64 tensor with one seed per param, on the params' device"));
  // The optimizer state: all fp32, or all bf16, or 8-bit codes (state8_bits.h: the first list signed, int8; the second
  // unsigned, uint8), rounded stochastically with one int64 seed per tensor and state list in `state_seeds` (params x
  // lists), laid out as its param. 8-bit codes come with their scales in `state_scales`: list-major (list j's of param i
  // at j * params + i), 1-d fp32, one per 256 elements.
  const bool has_state_seeds = state_seeds.has_value() && state_seeds->defined();
  const auto state_type = !states.empty() && !states[0]->empty() ? (*states[0])[0].scalar_type() : at::kFloat;
  TORCH_CHECK_VALUE(state_type == at::kFloat || state_type == at::kBFloat16 || state_type == at::kChar,
                    msg(op, ": optimizer state must be fp32, bf16 or 8-bit codes (int8 first moments, uint8 second moments), got ", state_type));
  const bool lean = state_type != at::kFloat, codes = state_type == at::kChar;
  for (size_t j = 0; j < states.size(); ++j)
    for (size_t i = 0; i < states[j]->size(); ++i) {
      const auto want = codes && j == 1 ? at::kByte : state_type;
      TORCH_CHECK_VALUE((*states[j])[i].scalar_type() == want, msg(op, ": optimizer state must be all fp32, all bf16 or all 8-bit codes (int8 first ",
                        "moments, uint8 second moments): state list ", j, " tensor ", i, " is ", (*states[j])[i].scalar_type(), " where ", want, " belongs"));
      TORCH_CHECK_VALUE(!lean || (*states[j])[i].strides() == params[i].strides(), msg(op, ": lean state tensor ", i, " must be laid out as its param"));
    }
  TORCH_CHECK_VALUE(lean == has_state_seeds, msg(op, lean ? ": lean (bf16 or 8-bit) optimizer state is rounded stochastically: pass `state_seeds`"
                                                         : ": `state_seeds` are for lean (bf16 or 8-bit) optimizer state, and this state is fp32"));
  if (has_state_seeds)
    TORCH_CHECK_VALUE(state_seeds->scalar_type() == at::kLong && state_seeds->dim() == 2 && state_seeds->size(0) == (int64_t)params.size() &&
                      state_seeds->size(1) == (int64_t)states.size() && state_seeds->is_contiguous() &&
                      (params.empty() || state_seeds->device() == params[0].device()),
                      msg(op, ": `state_seeds` must be a contiguous int64 tensor of one seed per param and state list (", params.size(), " x ",
                          states.size(), "), on the params' device"));
  TORCH_CHECK_VALUE(codes || state_scales.empty(), msg(op, ": `state_scales` are for 8-bit optimizer state, and this state is ", state_type));
  if (codes) {
    TORCH_CHECK_VALUE(state_scales.size() == states.size() * params.size(), msg(op, ": 8-bit state needs its scales in `state_scales`, one tensor per param and state list (",
                      states.size() * params.size(), "), got ", state_scales.size()));
    for (size_t j = 0; j < states.size(); ++j)
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor& sc = state_scales[j * params.size() + i];
        TORCH_CHECK_VALUE(sc.scalar_type() == at::kFloat && sc.dim() == 1 && sc.is_contiguous() && sc.numel() == (params[i].numel() + 255) / 256 &&
                          sc.device() == params[i].device(),
                          msg(op, ": the scales of 8-bit state list ", j, " of param ", i, " must be a contiguous 1-d fp32 tensor of ",
                              (params[i].numel() + 255) / 256, " (one per 256 elements) on its param's device"));
      }
  }
}

// Every tensor of every list on one device; on CUDA, each dense in a layout the kernels index (contiguous or channels-last).
static void one_device(std::initializer_list<const std::vector<at::Tensor>*> lists, const char* op, bool cuda) {
  const at::Tensor* first = nullptr;
  for (auto l : lists) for (auto& t : *l) {
    if (!first) first = &t;
    TORCH_CHECK(t.device() == first->device(), msg(op, ": all tensors must be on one device, got ", first->device(), " and ", t.device()));
    if (cuda) TORCH_CHECK(t.is_contiguous() || t.is_contiguous(at::MemoryFormat::ChannelsLast), msg(op, ": CUDA tensors must be contiguous"));
  }
}

static void check_scale_tensor(const std::optional<at::Tensor>& st, const std::vector<at::Tensor>& src, const char* op) {
  if (!st.has_value() || !st->defined()) return;
  TORCH_CHECK_VALUE(st->scalar_type() == at::kFloat && st->numel() == 1, msg(op, ": a tensor scale must be a 1-element fp32 tensor"));
  TORCH_CHECK_VALUE(src.empty() || st->device() == src[0].device(), msg(op, ": the tensor scale must be on the tensors' device (",
                    src.empty() ? std::string() : src[0].device().str(), "), got ", st->device()));
}

// dst = src*scale (Add: dst += src*scale); the flag says whether src held inf or nan. The scale is `scale`, or
// `scale_tensor` when given: the CUDA kernels read it on the device, so a scale the device computed costs no host sync.
template <bool Add, bool Cuda>
at::Tensor scale_op(TL src_, TL dst_, double scale, const std::optional<at::Tensor>& scale_tensor) {
  const char* op = Add ? "scale_add_check_" : "scale_check_";
  auto src = src_.vec(), dst = dst_.vec();
  check_pairs(src, dst, op);
  check_scale_tensor(scale_tensor, src, op);
  one_device({&src, &dst}, op, Cuda);
  const bool has_tensor = scale_tensor.has_value() && scale_tensor->defined();
#ifdef WITH_CUDA
  if constexpr (Cuda) {
    const float* ptr = has_tensor ? scale_tensor->data_ptr<float>() : nullptr;
    return Add ? scale_add_check_cuda(src, dst, scale, ptr) : scale_check_cuda(src, dst, scale, ptr);
  }
#endif
  if (has_tensor) scale = scale_tensor->item<float>();           // a CPU tensor: reading it costs nothing
  return Add ? scale_add_check_cpu(src, dst, scale) : scale_check_cpu(src, dst, scale);
}

template <bool Cuda>
std::tuple<at::Tensor, at::Tensor> l2norm_op(TL ts_) {
  auto ts = ts_.vec();
  one_device({&ts}, "l2norm", Cuda);
  std::vector<at::Tensor> res;
#ifdef WITH_CUDA
  if constexpr (Cuda) res = l2norm_cuda(ts); else
#endif
  res = l2norm_cpu(ts);
  return {res[0], res[1]};
}

template <bool Cuda>
void sgd_step_op(TL grads_, TL params_, TL bufs_, TL out_, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                 double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled, TL lows_, const Seeds& seeds,
                 const Seeds& state_seeds, TL state_scales_) {
  auto grads = grads_.vec(), params = params_.vec(), bufs = bufs_.vec(), out = out_.vec(), lows = lows_.vec(), state_scales = state_scales_.vec();
  check_step_pairs(grads, params, !bufs.empty() ? std::vector<const std::vector<at::Tensor>*>{&bufs} : std::vector<const std::vector<at::Tensor>*>{},
                   out, lows, seeds, state_seeds, state_scales, "sgd_step_");
  one_device({&grads, &params, &bufs, &out, &lows, &state_scales}, "sgd_step_", Cuda);
#ifdef WITH_CUDA
  if constexpr (Cuda) return sgd_step_cuda(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run,
                                           decoupled, lows, seeds, state_seeds, state_scales);
#endif
  sgd_step_cpu(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled, lows, seeds,
               state_seeds, state_scales);
}

template <bool Cuda>
void adam_step_op(TL grads_, TL params_, TL exp_avgs_, TL exp_avg_sqs_, TL out_, const at::Tensor& found_inf, TL steps_, double inv_scale,
                  double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled, TL lows_, const Seeds& seeds,
                  const Seeds& state_seeds, TL state_scales_) {
  auto grads = grads_.vec(), params = params_.vec(), exp_avgs = exp_avgs_.vec(), exp_avg_sqs = exp_avg_sqs_.vec(), out = out_.vec(), steps = steps_.vec();
  auto lows = lows_.vec(), state_scales = state_scales_.vec();
  check_step_pairs(grads, params, {&exp_avgs, &exp_avg_sqs}, out, lows, seeds, state_seeds, state_scales, "adam_step_");
  TORCH_CHECK_VALUE(steps.size() == params.size(), msg("adam_step_: one step count per param, got ", steps.size(), " for ", params.size(), " params"));
  for (size_t i = 0; i < steps.size(); ++i)
    TORCH_CHECK_VALUE(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == params[i].device(),
                      msg("adam_step_: step count ", i, " must be a 1-element fp32 tensor on its param's device (", params[i].device(),
                      "), got ", steps[i].scalar_type(), " on ", steps[i].device()));
  one_device({&grads, &params, &exp_avgs, &exp_avg_sqs, &out, &lows, &state_scales}, "adam_step_", Cuda);
#ifdef WITH_CUDA
  if constexpr (Cuda) return adam_step_cuda(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay,
                                            decoupled, lows, seeds, state_seeds, state_scales);
#endif
  adam_step_cpu(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled, lows, seeds,
                state_seeds, state_scales);
}

}  // namespace mixedprec

// TORCH_LIBRARY stringizes its namespace argument as written, before torch 2.14 (or so) without expanding it: called
// directly, it defined the ops as TORCH_EXTENSION_NAME::op, while TORCH_LIBRARY_IMPL expands the name, so the ops had
// kernels and no schema and torch.ops found none. One macro between them expands the build's name first.
#define MIXEDPREC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
MIXEDPREC_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("scale_check_(Tensor[] src, Tensor(a!)[] dst, float scale, Tensor? scale_tensor=None) -> Tensor");
  m.def("scale_add_check_(Tensor[] src, Tensor(a!)[] dst, float scale, Tensor? scale_tensor=None) -> Tensor");
  m.def("l2norm(Tensor[] tensors) -> (Tensor, Tensor)");
  m.def("sgd_step_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor(c!)[] out, Tensor found_inf, float inv_scale, float lr, "
        "float momentum, float dampening, float weight_decay, bool nesterov, bool first_run, bool decoupled, Tensor(d!)[] lows, Tensor? seeds, "
        "Tensor? state_seeds, Tensor(e!)[] state_scales) -> ()");
  m.def("adam_step_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] out, Tensor found_inf, "
        "Tensor[] steps, float inv_scale, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, Tensor(e!)[] lows, "
        "Tensor? seeds, Tensor? state_seeds, Tensor(f!)[] state_scales) -> ()");
}

#define MIXEDPREC_IMPLS(KEY, CUDA)                                                  \
  TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, KEY, m) {                                \
    m.impl("scale_check_", &mixedprec::scale_op<false, CUDA>);                      \
    m.impl("scale_add_check_", &mixedprec::scale_op<true, CUDA>);                   \
    m.impl("l2norm", &mixedprec::l2norm_op<CUDA>);                                  \
    m.impl("sgd_step_", &mixedprec::sgd_step_op<CUDA>);                             \
    m.impl("adam_step_", &mixedprec::adam_step_op<CUDA>);                           \
  }
MIXEDPREC_IMPLS(CPU, false)
#ifdef WITH_CUDA
MIXEDPREC_IMPLS(CUDA, true)
#endif

// The ops update masters, optimizer state and grads in place, and are never differentiated through: autograd passes them by.
TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, Autograd, m) {
  for (auto name : {"scale_check_", "scale_add_check_", "l2norm", "sgd_step_", "adam_step_"}) m.impl(name, torch::CppFunction::makeFallthrough());
}

// The Python module the extension is imported as: which build this is, and the CPU kernels' one setting. Python's C API, without pybind11.
static PyObject* mixedprec_has_cuda(PyObject*, PyObject*) {
#ifdef WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}
static PyObject* mixedprec_namespace(PyObject*, PyObject*) { return PyUnicode_FromString(MIXEDPREC_STR(TORCH_EXTENSION_NAME)); }
static PyObject* mixedprec_stream_min_bytes(PyObject*, PyObject* args) {
  long long set = -1;
  if (!PyArg_ParseTuple(args, "|L", &set)) return nullptr;
  return PyLong_FromLongLong(mixedprec::stream_min_bytes(set));
}
static PyMethodDef mixedprec_methods[] = {
  {"has_cuda", mixedprec_has_cuda, METH_NOARGS, "True when this build holds the CUDA kernels"},
  {"namespace", mixedprec_namespace, METH_NOARGS, "The torch.ops namespace of this build's ops"},
  {"stream_min_bytes", mixedprec_stream_min_bytes, METH_VARARGS,
   "stream_min_bytes(n=-1): the output size in bytes from which the CPU kernels write with streaming stores; sets it first when n >= 0"},
  {nullptr, nullptr, 0, nullptr}};
static PyModuleDef mixedprec_module = {PyModuleDef_HEAD_INIT, MIXEDPREC_STR(TORCH_EXTENSION_NAME),
                                       "mixedprec's fused kernels: the ops are in torch.ops.<namespace()>", -1, mixedprec_methods};
#define MIXEDPREC_CAT2(a, b) a##b
#define MIXEDPREC_CAT(a, b) MIXEDPREC_CAT2(a, b)
PyMODINIT_FUNC MIXEDPREC_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&mixedprec_module); }
