// A kernel module of fused optimizer steps, built apart from the extension and loaded into it (ops.py's step kernel
// builder; kernel_keys.h's contract): with -DMIXEDPREC_STEP_KEY=<key>, the one step kernel that key names, built the
// first time a run asks for it (a second or two of nvcc); without it, all of them (the tests' build, once). A plain
// Python module (Python's C API, no ATen header) whose kernels() gives a capsule of its KernelList.
#include <Python.h>
#include <array>
#include <utility>
#include "cuda_launch.cuh"
#include "optim_kernels.h"
#include "python_module.h"

namespace mixedprec {

#ifdef MIXEDPREC_STEP_KEY
static const KernelEntry kEntries[] = {entry_of<StepFunctorOf<(uint32_t)MIXEDPREC_STEP_KEY>>()};
#else
constexpr size_t count_step_keys() {
  size_t n = 0;
  for_each_step_key([&](uint32_t) { ++n; });
  return n;
}
constexpr std::array<uint32_t, count_step_keys()> all_step_keys() {
  std::array<uint32_t, count_step_keys()> keys{};
  size_t n = 0;
  for_each_step_key([&](uint32_t k) { keys[n++] = k; });
  return keys;
}
constexpr auto kAllStepKeys = all_step_keys();
template <size_t... I> std::array<KernelEntry, sizeof...(I)> entries_of(std::index_sequence<I...>) {
  return {entry_of<StepFunctorOf<kAllStepKeys[I]>>()...};
}
static const auto kEntries = entries_of(std::make_index_sequence<kAllStepKeys.size()>());
#endif

static const KernelList kList{std::data(kEntries), std::size(kEntries)};

}  // namespace mixedprec

static PyObject* step_kernels(PyObject*, PyObject*) {
  return PyCapsule_New(const_cast<mixedprec::KernelList*>(&mixedprec::kList), mixedprec::kKernelListCapsule, nullptr);
}
static PyMethodDef step_kernel_methods[] = {
  {"kernels", step_kernels, METH_NOARGS, "A capsule of this module's step kernels (keys and launch functions)"},
  {nullptr, nullptr, 0, nullptr}};
static PyModuleDef step_kernel_module = {PyModuleDef_HEAD_INIT, MIXEDPREC_MODULE_NAME,
                                         "mixedprec's fused step kernels, for the extension to register", -1, step_kernel_methods};
PyMODINIT_FUNC MIXEDPREC_PYINIT(void) { return PyModule_Create(&step_kernel_module); }
