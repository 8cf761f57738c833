// The CUDA build's host side, compiled by g++: the ops' dispatch (kernel_dispatch.h) on CudaGrid, which launches each
// functor through the kernel its key names, and the registry of those kernels: the core kernels (core_kernels.cu) at
// import, each step kernel when a run first asks for it. A missing step kernel is built by a Python callable the
// extension is given (ops.py: it builds step_kernel.cu for that key into the kernel cache, or loads it from there, and
// registers it), under the GIL, while the op waits.
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <mutex>
#include <string>
#include <unordered_map>
#include "kernel_dispatch.h"

namespace mixedprec {

const KernelList& core_kernels();

static std::mutex g_kernels_mu;
static std::unordered_map<uint32_t, void*> g_kernels;
static PyObject* g_builder = nullptr;          // a callable(key) that builds and registers a step kernel

void register_kernels(const KernelList& list) {
  std::lock_guard<std::mutex> lock(g_kernels_mu);
  for (size_t i = 0; i < list.count; ++i) g_kernels[list.entries[i].key] = list.entries[i].launch;
}

std::vector<int64_t> kernel_keys() {
  std::lock_guard<std::mutex> lock(g_kernels_mu);
  std::vector<int64_t> keys;
  for (const auto& kv : g_kernels) keys.push_back(kv.first);
  return keys;
}

void set_kernel_builder(PyObject* builder) {     // called with the GIL held
  Py_XINCREF(builder);
  Py_XDECREF(g_builder);
  g_builder = builder;
}

static void* registered(uint32_t key) {
  std::lock_guard<std::mutex> lock(g_kernels_mu);
  auto it = g_kernels.find(key);
  return it == g_kernels.end() ? nullptr : it->second;
}

// Build (or load from the cache) the step kernel `key` through the Python builder; its error, as text, on failure.
static std::string build_kernel(uint32_t key) {
  const PyGILState_STATE gil = PyGILState_Ensure();
  std::string err;
  if (g_builder == nullptr) err = "no kernel builder was set (import mixedprec.ops first)";
  else if (PyObject* r = PyObject_CallFunction(g_builder, "I", (unsigned int)key)) Py_DECREF(r);
  else {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* utf8 = text ? PyUnicode_AsUTF8(text) : nullptr;
    err = utf8 ? utf8 : "the kernel builder failed";
    Py_XDECREF(text); Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(trace);
    PyErr_Clear();
  }
  PyGILState_Release(gil);
  return err;
}

static void* find_kernel(uint32_t key) {
  if (void* fn = registered(key)) return fn;
  const std::string err = build_kernel(key);
  void* fn = registered(key);
  TORCH_CHECK(fn != nullptr, msg("mixedprec: the CUDA kernel ", (int64_t)key, " could not be built: ", err));
  return fn;
}

struct CudaGrid {
  using Guard = c10::cuda::CUDAGuard;
  static int64_t chunk() { return kCudaChunk; }

  template <typename Table, typename Functor, typename... A>      // not `Args`: gcc takes Functor::Args for the pack
  static void run(const Table& table, int blocks, const int* noop, Functor, A... args) {
    check_contract<Table, Functor, A...>();
    const auto launch = reinterpret_cast<typename LaunchOf<Functor>::type>(find_kernel(Functor::kKey));
    const char* err = launch(table, blocks, noop, c10::cuda::getCurrentCUDAStream().stream(), args...);
    TORCH_CHECK(err == nullptr, msg("mixedprec: a CUDA kernel launch failed: ", err));
  }
  template <typename Table, typename Functor, typename... A>
  static void run_sum(const Table& table, int blocks, const int* noop, Functor f, A... args) {
    static_assert(is_block_sum<Functor>::value, "a block sum's functor says so");
    run(table, blocks, noop, f, args...);
  }
};

at::Tensor scale_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_check_on<CudaGrid, false>(src, dst, scale, scale_ptr);
}
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_check_on<CudaGrid, true>(src, dst, scale, scale_ptr);
}

std::vector<at::Tensor> l2norm_cuda(const std::vector<at::Tensor>& ts) { return l2norm_on<CudaGrid>(ts); }

void sgd_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                   const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled,
                   const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& state_seeds,
                   const std::vector<at::Tensor>& state_scales) {
  sgd_step_on<CudaGrid>(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled,
                        lows, seeds, state_seeds, state_scales);
}

void adam_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                    const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds,
                    const std::optional<at::Tensor>& state_seeds, const std::vector<at::Tensor>& state_scales) {
  adam_step_on<CudaGrid>(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled,
                         lows, seeds, state_seeds, state_scales);
}

}  // namespace mixedprec
