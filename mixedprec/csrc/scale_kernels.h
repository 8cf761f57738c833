// dst = src*scale (or dst += src*scale) over many tensors, raising a flag on any non-finite input, on a multi-tensor grid
// (multi_tensor.h): the GPU's in core_kernels.cu, the tests' CPU emulation otherwise (the host's side:
// kernel_dispatch.h). The scale is a host number, or
// (scale_ptr) a 1-element fp32 tensor beside the tensors, so that a scale the device computed needs no host read.
#pragma once
#include "multi_tensor.h"
#include "kernel_keys.h"

namespace mixedprec {

template <typename S, typename D, bool Add> struct ScaleFunctor {
  static constexpr uint32_t kKey = kernel_key(Add ? kScaleAddKernel : kScaleKernel, DtypeCode<S>::value, DtypeCode<D>::value);
  using Table = TensorTable<2>;
  using Args = ArgList<float, const float*, int*>;
  template <typename Table>
  MIXEDPREC_HD void operator()(const Lane& lane, int64_t chunk, const int* noop, Table& t, float host_scale, const float* scale_ptr, int* flag) const {
    const float scale = scale_ptr ? *scale_ptr : host_scale;
    int64_t begin, end;
    const int slot = block_range(t, lane, chunk, begin, end);
    // restrict: lets nvcc keep the unrolled packs' loads in flight ahead of the stores. In place (src == dst), each
    // element is read by the thread that writes it, before it writes it, and no two elements overlap.
    const S* __restrict__ src = static_cast<const S*>(t.addr[0][slot]);
    D* __restrict__ dst = static_cast<D*>(t.addr[1][slot]);
    bool bad = false;
    walk(lane, begin, end, pack_head(src, dst), [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      S x[W];
      D y[W];
      load<W>(src, i, x);
      if constexpr (Add) load<W>(dst, i, y);
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) {
        const float v = to_float(x[j]);
        bad |= !finite(v);
        const float prod = mul_rn(v, scale);
        y[j] = static_cast<D>(Add ? add_rn(to_float(y[j]), prod) : prod);
      }
      store<W>(dst, i, y);
    });
    if (bad) *flag = 1;
  }
};

}  // namespace mixedprec
