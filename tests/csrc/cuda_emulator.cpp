// The CUDA kernels' code run on the CPU, for the tests: the functors and launch planning of mixedprec/csrc/*_kernel(s).h,
// compiled by the host compiler and run over an emulated grid (every block, every thread, one at a time), with pack
// accesses that check their alignment as the GPU would. What it does not run: the kernel launch, the shared-memory block
// sum (the same tree of additions, in a loop here) and nvcc's arithmetic intrinsics (the same IEEE operations).
#include <torch/extension.h>                          // pybind11 and torch's type casters, for the module below
#include <cstdint>
#include <set>
namespace mixedprec_emulator { inline int64_t accesses[2] = {0, 0}; }   // element accesses, pack accesses
#define MIXEDPREC_COUNT_ACCESS(width) (++mixedprec_emulator::accesses[(width) == 1 ? 0 : 1])
#include "kernel_dispatch.h"

namespace mixedprec {

// The grid of a launch, run on the host. `chunk` and `threads` default to the GPU's; a test may shrink them to reach
// many launches, carried-over tensors and many loop rounds per thread with small tensors.
struct HostGrid {
  struct Guard { explicit Guard(const c10::Device&) {} };
  inline static int64_t chunk_ = kCudaChunk;
  inline static int threads_ = kBlockSize;
  inline static int64_t launches_ = 0;
  inline static std::set<int64_t> keys_;                   // the kernel keys launched (kernel_keys.h)
  static int64_t chunk() { return chunk_; }

  template <typename Table, typename Functor, typename... Args>
  static void run(const Table& table, int blocks, const int* noop, Functor f, Args... args) {
    check_contract<Table, Functor, Args...>();
    keys_.insert(Functor::kKey);
    Table arg = table;                                     // a kernel gets its own copy of the table
    ++launches_;
    const int step = is_warp_wide<Functor>::value ? kWarp : 1;   // warp-wide: one call per warp, for all its lanes
    for (int b = 0; b < blocks; ++b)
      for (int th = 0; th < threads_; th += step) f(Lane{b, th, threads_}, chunk_, noop, arg, args...);
  }

  template <typename Table, typename Functor, typename... Args>
  static void run_sum(const Table& table, int blocks, const int* noop, Functor f, Args... args) {
    check_contract<Table, Functor, Args...>();
    static_assert(is_block_sum<Functor>::value, "a block sum's functor says so");
    keys_.insert(Functor::kKey);
    Table arg = table;
    ++launches_;
    std::vector<float> partial(threads_);
    for (int b = 0; b < blocks; ++b) {
      for (int th = 0; th < threads_; ++th) partial[th] = f.partial(Lane{b, th, threads_}, chunk_, noop, arg);
      for (int s = threads_ / 2; s > 0; s >>= 1)          // the kernel's tree of additions, in its order
        for (int th = 0; th < s; ++th) partial[th] += partial[th + s];
      f.finish(Lane{b, 0, threads_}, arg, partial[0], args...);
    }
  }
};

}  // namespace mixedprec

using TV = std::vector<at::Tensor>;
using mixedprec::HostGrid;

static const float* scale_ptr(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_grid", [](int64_t chunk, int threads) {
    TORCH_CHECK(threads > 0 && (threads & (threads - 1)) == 0 && threads <= mixedprec::kBlockSize, "threads: a power of two up to the GPU's block size");
    HostGrid::chunk_ = chunk; HostGrid::threads_ = threads;
  }, "the chunk (elements per block) and threads per block of the emulated launches");
  m.def("counters", []() {
    return std::make_tuple(mixedprec_emulator::accesses[0], mixedprec_emulator::accesses[1], HostGrid::launches_);
  }, "element accesses, pack accesses and launches so far");
  m.def("reset_counters", []() {
    mixedprec_emulator::accesses[0] = mixedprec_emulator::accesses[1] = 0; HostGrid::launches_ = 0; HostGrid::keys_.clear(); });
  m.def("launched_keys", []() { return std::vector<int64_t>(HostGrid::keys_.begin(), HostGrid::keys_.end()); },
        "the keys of the kernels launched since the counters were reset (the CUDA build's kernel_keys.h)");
  m.def("load_pack", [](const at::Tensor& t, int64_t i) {
    float out[mixedprec::kPack];
    mixedprec::load<mixedprec::kPack>(t.data_ptr<float>(), i, out);
    return out[0];
  }, "read a pack of fp32 `t` at element i, as the kernels do (raises where the GPU would fault)");
  m.def("scale_check", [](const TV& src, const TV& dst, double scale, const std::optional<at::Tensor>& st) {
    return mixedprec::scale_check_on<HostGrid, false>(src, dst, scale, scale_ptr(st)); });
  m.def("scale_add_check", [](const TV& src, const TV& dst, double scale, const std::optional<at::Tensor>& st) {
    return mixedprec::scale_check_on<HostGrid, true>(src, dst, scale, scale_ptr(st)); });
  m.def("l2norm", [](const TV& ts) { auto r = mixedprec::l2norm_on<HostGrid>(ts); return std::make_tuple(r[0], r[1]); });
  m.def("sgd_step", &mixedprec::sgd_step_on<HostGrid>);
  m.def("adam_step", &mixedprec::adam_step_on<HostGrid>);
}
