// The kernels every run uses, built with the extension: the unscale/scale with its overflow check for each pair of
// element types, and the per-tensor sums of squares of the L2 norms. No ATen header: the host's side is
// kernel_dispatch.h, compiled into cuda_dispatch.cpp.
#include "cuda_launch.cuh"
#include "scale_kernels.h"
#include "l2norm_kernel.h"

namespace mixedprec {

template <uint32_t S, uint32_t D> void add_scale_entries(KernelEntry*& e) {
  *e++ = entry_of<ScaleFunctor<DtypeOf<S>, DtypeOf<D>, false>>();
  *e++ = entry_of<ScaleFunctor<DtypeOf<S>, DtypeOf<D>, true>>();
}
template <uint32_t S, uint32_t... D> void add_scale_row(KernelEntry*& e, std::integer_sequence<uint32_t, D...>) {
  (add_scale_entries<S, D>(e), ...);
}
template <uint32_t... S> void add_all(KernelEntry*& e, std::integer_sequence<uint32_t, S...> codes) {
  (add_scale_row<S>(e, codes), ...);
  ((*e++ = entry_of<SquareSumFunctor<DtypeOf<S>>>()), ...);
}

constexpr size_t kCoreKernels = 2 * kDtypeCodes * kDtypeCodes + kDtypeCodes;

const KernelList& core_kernels() {
  static KernelEntry entries[kCoreKernels];
  static const KernelList list = [] {
    KernelEntry* e = entries;
    add_all(e, std::make_integer_sequence<uint32_t, kDtypeCodes>());
    return KernelList{entries, (size_t)(e - entries)};
  }();
  return list;
}

}  // namespace mixedprec
