// mixedprec's fused multi-tensor ops as torch custom ops: one schema per op (named arguments, mutations annotated), the
// C++ CPU kernels (cpu_kernels.cpp) registered for the CPU dispatch key and, in a CUDA build, the CUDA kernels
// (cuda_dispatch.cpp, launching kernels that nvcc builds: core_kernels.cu, and step_kernel.cu on demand) for the CUDA
// key. The dispatcher picks the device; each implementation checks its tensors. The namespace is the extension's name
// (mixedprec_cpu_avx512, ...), so that two builds can live in one process. Fake kernels are registered in Python.
// The op registry and ATen's Tensor, and Python's C API for the module's functions: not <torch/extension.h> (the
// whole C++ API) nor pybind11, which took two thirds of the compile time.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>
#include "messages.h"
#include "python_module.h"
#ifdef WITH_CUDA
#include "kernel_keys.h"
#endif

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
const KernelList& core_kernels();
void register_kernels(const KernelList& list);
std::vector<int64_t> kernel_keys();
void set_kernel_builder(PyObject* builder);
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

// The seeds of one launch: `seeds` one per param, `state_seeds` one per param and state list (`lists`), on the params' device.
static void check_seed_tensors(const std::vector<at::Tensor>& params, size_t lists, const Seeds& seeds, const Seeds& state_seeds, const char* op) {
  if (seeds.has_value() && seeds->defined())
    TORCH_CHECK_VALUE(seeds->scalar_type() == at::kLong && seeds->dim() == 1 && seeds->numel() == (int64_t)params.size() && seeds->is_contiguous() &&
                      (params.empty() || seeds->device() == params[0].device()),
                      msg(op, ": `seeds` must be a 1-d int64 tensor with one seed per param, on the params' device"));
  if (state_seeds.has_value() && state_seeds->defined())
    TORCH_CHECK_VALUE(state_seeds->scalar_type() == at::kLong && state_seeds->dim() == 2 && state_seeds->size(0) == (int64_t)params.size() &&
                      state_seeds->size(1) == (int64_t)lists && state_seeds->is_contiguous() &&
                      (params.empty() || state_seeds->device() == params[0].device()),
                      msg(op, ": `state_seeds` must be a contiguous int64 tensor of one seed per param and state list (", params.size(), " x ",
                          lists, "), on the params' device"));
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
  check_seed_tensors(params, states.size(), seeds, state_seeds, op);
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

// One fused step's tensor lists: the state lists are SGD's momentum buffers (`state0`; empty without momentum) or Adam's
// two moments; `steps` Adam's step counts, one per param.
struct StepLists { TV grads, params, state0, state1, out, steps, lows, state_scales; };

static std::vector<const TV*> live_states(const StepLists& l, bool adam) {
  if (adam) return {&l.state0, &l.state1};
  return l.state0.empty() ? std::vector<const TV*>{} : std::vector<const TV*>{&l.state0};
}

// Everything a step's kernels need of its lists and seeds (the seeds may change at every step, the lists do not).
template <bool Cuda>
static void check_step(const StepLists& l, bool adam, const Seeds& seeds, const Seeds& state_seeds) {
  const char* op = adam ? "adam_step_" : "sgd_step_";
  check_step_pairs(l.grads, l.params, live_states(l, adam), l.out, l.lows, seeds, state_seeds, l.state_scales, op);
  if (adam) {
    TORCH_CHECK_VALUE(l.steps.size() == l.params.size(), msg(op, ": one step count per param, got ", l.steps.size(), " for ", l.params.size(), " params"));
    for (size_t i = 0; i < l.steps.size(); ++i)
      TORCH_CHECK_VALUE(l.steps[i].scalar_type() == at::kFloat && l.steps[i].numel() == 1 && l.steps[i].device() == l.params[i].device(),
                        msg(op, ": step count ", i, " must be a 1-element fp32 tensor on its param's device (", l.params[i].device(),
                        "), got ", l.steps[i].scalar_type(), " on ", l.steps[i].device()));
  }
  one_device({&l.grads, &l.params, &l.state0, &l.state1, &l.out, &l.lows, &l.state_scales}, op, Cuda);
}

template <bool Cuda>
static void run_sgd(const StepLists& l, const at::Tensor& found_inf, double inv_scale, double lr, double momentum, double dampening,
                    double weight_decay, bool nesterov, bool first_run, bool decoupled, const Seeds& seeds, const Seeds& state_seeds) {
#ifdef WITH_CUDA
  if constexpr (Cuda) return sgd_step_cuda(l.grads, l.params, l.state0, l.out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov,
                                           first_run, decoupled, l.lows, seeds, state_seeds, l.state_scales);
#endif
  sgd_step_cpu(l.grads, l.params, l.state0, l.out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled, l.lows,
               seeds, state_seeds, l.state_scales);
}

template <bool Cuda>
static void run_adam(const StepLists& l, const at::Tensor& found_inf, double inv_scale, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, const Seeds& seeds, const Seeds& state_seeds) {
#ifdef WITH_CUDA
  if constexpr (Cuda) return adam_step_cuda(l.grads, l.params, l.state0, l.state1, l.out, found_inf, l.steps, inv_scale, lr, beta1, beta2, eps,
                                            weight_decay, decoupled, l.lows, seeds, state_seeds, l.state_scales);
#endif
  adam_step_cpu(l.grads, l.params, l.state0, l.state1, l.out, found_inf, l.steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled, l.lows,
                seeds, state_seeds, l.state_scales);
}

template <bool Cuda>
void sgd_step_op(TL grads, TL params, TL bufs, TL out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                 double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled, TL lows, const Seeds& seeds,
                 const Seeds& state_seeds, TL state_scales) {
  const StepLists l{grads.vec(), params.vec(), bufs.vec(), {}, out.vec(), {}, lows.vec(), state_scales.vec()};
  check_step<Cuda>(l, false, seeds, state_seeds);
  run_sgd<Cuda>(l, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled, seeds, state_seeds);
}

template <bool Cuda>
void adam_step_op(TL grads, TL params, TL exp_avgs, TL exp_avg_sqs, TL out, const at::Tensor& found_inf, TL steps, double inv_scale,
                  double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled, TL lows, const Seeds& seeds,
                  const Seeds& state_seeds, TL state_scales) {
  const StepLists l{grads.vec(), params.vec(), exp_avgs.vec(), exp_avg_sqs.vec(), out.vec(), steps.vec(), lows.vec(), state_scales.vec()};
  check_step<Cuda>(l, true, seeds, state_seeds);
  run_adam<Cuda>(l, found_inf, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled, seeds, state_seeds);
}

// Prepared steps: a step's lists handed over once (`prepare_step`) and kept here under a handle, so that each later step
// passes only its scalars, flag and seeds (handing 6 lists of 160 tensors to an op costs about 100 us of host time). The
// lists are checked in full at the first step, the seeds at each; `release_step` drops them (Python does, when the
// prepared launch it belongs to is gone).
struct PreparedStep {
  StepLists lists;
  std::mutex mu;
  int checked = 0;                         // 1: checked for SGD, 2: for Adam
  bool seeds = false, state_seeds = false; // which seeds the checked step had
};
static std::mutex g_prepared_mu;
static std::unordered_map<int64_t, std::shared_ptr<PreparedStep>> g_prepared;
static int64_t g_prepared_next = 0;

int64_t prepare_step(TL grads, TL params, TL state0, TL state1, TL out, TL steps, TL lows, TL state_scales) {
  auto p = std::make_shared<PreparedStep>();
  p->lists = StepLists{grads.vec(), params.vec(), state0.vec(), state1.vec(), out.vec(), steps.vec(), lows.vec(), state_scales.vec()};
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  g_prepared[++g_prepared_next] = p;
  return g_prepared_next;
}

void release_step(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  g_prepared.erase(handle);
}

int64_t prepared_steps() {
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  return (int64_t)g_prepared.size();
}

// The prepared step `handle` (kept alive for the caller's step even if released meanwhile), checked for this step.
template <bool Cuda>
static std::shared_ptr<PreparedStep> prepared(int64_t handle, bool adam, const Seeds& seeds, const Seeds& state_seeds) {
  const char* op = adam ? "adam_prepared_" : "sgd_prepared_";
  std::shared_ptr<PreparedStep> p;
  {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    auto it = g_prepared.find(handle);
    TORCH_CHECK_VALUE(it != g_prepared.end(), msg(op, ": no prepared step ", handle, " (released, or made by another build)"));
    p = it->second;
  }
  const bool has_seeds = seeds.has_value() && seeds->defined(), has_state_seeds = state_seeds.has_value() && state_seeds->defined();
  std::lock_guard<std::mutex> lock(p->mu);
  if (p->checked != (adam ? 2 : 1)) {
    check_step<Cuda>(p->lists, adam, seeds, state_seeds);
    p->checked = adam ? 2 : 1, p->seeds = has_seeds, p->state_seeds = has_state_seeds;
  } else {
    TORCH_CHECK_VALUE(has_seeds == p->seeds && has_state_seeds == p->state_seeds,
                      msg(op, ": the seeds passed differ in kind from the first step's: prepare the step anew"));
    check_seed_tensors(p->lists.params, live_states(p->lists, adam).size(), seeds, state_seeds, op);
  }
  return p;
}

template <bool Cuda>
void sgd_prepared_op(int64_t handle, const at::Tensor& found_inf, double inv_scale, double lr, double momentum, double dampening,
                     double weight_decay, bool nesterov, bool first_run, bool decoupled, const Seeds& seeds, const Seeds& state_seeds) {
  run_sgd<Cuda>(prepared<Cuda>(handle, false, seeds, state_seeds)->lists, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov,
                first_run, decoupled, seeds, state_seeds);
}

template <bool Cuda>
void adam_prepared_op(int64_t handle, const at::Tensor& found_inf, double inv_scale, double lr, double beta1, double beta2, double eps,
                      double weight_decay, bool decoupled, const Seeds& seeds, const Seeds& state_seeds) {
  run_adam<Cuda>(prepared<Cuda>(handle, true, seeds, state_seeds)->lists, found_inf, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled, seeds,
                 state_seeds);
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
  // prepared steps (eager only: the lists they change are behind a handle, which no schema can annotate)
  m.def("prepare_step(Tensor[] grads, Tensor[] params, Tensor[] state0, Tensor[] state1, Tensor[] out, Tensor[] steps, Tensor[] lows, "
        "Tensor[] state_scales) -> int", &mixedprec::prepare_step);
  m.def("release_step(int handle) -> ()", &mixedprec::release_step);
  m.def("prepared_steps() -> int", &mixedprec::prepared_steps);     // how many are held: a leak shows
  m.def("sgd_prepared_(int handle, Tensor found_inf, float inv_scale, float lr, float momentum, float dampening, float weight_decay, "
        "bool nesterov, bool first_run, bool decoupled, Tensor? seeds, Tensor? state_seeds) -> ()");
  m.def("adam_prepared_(int handle, Tensor found_inf, float inv_scale, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool decoupled, Tensor? seeds, Tensor? state_seeds) -> ()");
}

#define MIXEDPREC_IMPLS(KEY, CUDA)                                                  \
  TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, KEY, m) {                                \
    m.impl("scale_check_", &mixedprec::scale_op<false, CUDA>);                      \
    m.impl("scale_add_check_", &mixedprec::scale_op<true, CUDA>);                   \
    m.impl("l2norm", &mixedprec::l2norm_op<CUDA>);                                  \
    m.impl("sgd_step_", &mixedprec::sgd_step_op<CUDA>);                             \
    m.impl("adam_step_", &mixedprec::adam_step_op<CUDA>);                           \
    m.impl("sgd_prepared_", &mixedprec::sgd_prepared_op<CUDA>);                     \
    m.impl("adam_prepared_", &mixedprec::adam_prepared_op<CUDA>);                   \
  }
MIXEDPREC_IMPLS(CPU, false)
#ifdef WITH_CUDA
MIXEDPREC_IMPLS(CUDA, true)
#endif

// The ops update masters, optimizer state and grads in place, and are never differentiated through: autograd passes them by.
TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, Autograd, m) {
  for (auto name : {"scale_check_", "scale_add_check_", "l2norm", "sgd_step_", "adam_step_", "sgd_prepared_", "adam_prepared_"})
    m.impl(name, torch::CppFunction::makeFallthrough());
}

// The Python module the extension is imported as: which build this is, and the CPU kernels' one setting. Python's C API, without pybind11.
static PyObject* mixedprec_has_cuda(PyObject*, PyObject*) {
#ifdef WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}
static PyObject* mixedprec_namespace(PyObject*, PyObject*) { return PyUnicode_FromString(MIXEDPREC_MODULE_NAME); }
static PyObject* mixedprec_stream_min_bytes(PyObject*, PyObject* args) {
  long long set = -1;
  if (!PyArg_ParseTuple(args, "|L", &set)) return nullptr;
  return PyLong_FromLongLong(mixedprec::stream_min_bytes(set));
}
#ifdef WITH_CUDA
// The CUDA kernels' registry (cuda_dispatch.cpp): a kernel module's capsule registered, the builder of missing step
// kernels set, the keys registered listed.
static PyObject* mixedprec_register_kernels(PyObject*, PyObject* capsule) {
  auto list = static_cast<const mixedprec::KernelList*>(PyCapsule_GetPointer(capsule, mixedprec::kKernelListCapsule));
  if (list == nullptr) return nullptr;
  mixedprec::register_kernels(*list);
  Py_RETURN_NONE;
}
static PyObject* mixedprec_set_kernel_builder(PyObject*, PyObject* builder) {
  if (builder != Py_None && !PyCallable_Check(builder)) { PyErr_SetString(PyExc_TypeError, "the builder must be callable or None"); return nullptr; }
  mixedprec::set_kernel_builder(builder == Py_None ? nullptr : builder);
  Py_RETURN_NONE;
}
static PyObject* mixedprec_kernel_keys(PyObject*, PyObject*) {
  const auto keys = mixedprec::kernel_keys();
  PyObject* res = PyList_New((Py_ssize_t)keys.size());
  if (res == nullptr) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i) PyList_SET_ITEM(res, (Py_ssize_t)i, PyLong_FromLongLong(keys[i]));
  return res;
}
#endif
static PyMethodDef mixedprec_methods[] = {
  {"has_cuda", mixedprec_has_cuda, METH_NOARGS, "True when this build holds the CUDA kernels"},
  {"namespace", mixedprec_namespace, METH_NOARGS, "The torch.ops namespace of this build's ops"},
  {"stream_min_bytes", mixedprec_stream_min_bytes, METH_VARARGS,
   "stream_min_bytes(n=-1): the output size in bytes from which the CPU kernels write with streaming stores; sets it first when n >= 0"},
#ifdef WITH_CUDA
  {"register_kernels", mixedprec_register_kernels, METH_O, "register_kernels(capsule): a kernel module's CUDA kernels, for the ops to launch"},
  {"set_kernel_builder", mixedprec_set_kernel_builder, METH_O,
   "set_kernel_builder(f): f(key) builds and registers the step kernel `key` the first time an op needs it (None: none)"},
  {"kernel_keys", mixedprec_kernel_keys, METH_NOARGS, "The keys of the CUDA kernels registered so far"},
#endif
  {nullptr, nullptr, 0, nullptr}};
static PyModuleDef mixedprec_module = {PyModuleDef_HEAD_INIT, MIXEDPREC_MODULE_NAME,
                                       "mixedprec's fused kernels: the ops are in torch.ops.<namespace()>", -1, mixedprec_methods};
PyMODINIT_FUNC MIXEDPREC_PYINIT(void) {
#ifdef WITH_CUDA
  mixedprec::register_kernels(mixedprec::core_kernels());      // the unscale and the norms: every run's
#endif
  return PyModule_Create(&mixedprec_module);
}
