// Global and per-tensor L2 norms over many tensors on a multi-tensor grid (multi_tensor.h): each thread's fp32 sum of
// squares, summed over its block, then added per tensor in double.
#pragma once
#include "multi_tensor.h"
#include "kernel_keys.h"

namespace mixedprec {

template <typename T> struct SquareSumFunctor {
  static constexpr uint32_t kKey = kernel_key(kSquareSumKernel, DtypeCode<T>::value);
  static constexpr bool kBlockSum = true;           // launched as a block sum: partial, then finish
  using Table = TensorTable<1>;
  using Args = ArgList<double*>;
  template <typename Table>
  MIXEDPREC_HD float partial(const Lane& lane, int64_t chunk, const int* noop, Table& t) const {
    int64_t begin, end;
    const int slot = block_range(t, lane, chunk, begin, end);
    const T* x = static_cast<const T*>(t.addr[0][slot]);
    float acc = 0.f;
    walk(lane, begin, end, pack_head(x), [&](auto width, int64_t i) {
      constexpr int W = decltype(width)::value;
      T v[W];
      load<W>(x, i, v);
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) { const float f = to_float(v[j]); acc = add_rn(acc, mul_rn(f, f)); }
    });
    return acc;
  }
  template <typename Table>
  MIXEDPREC_HD void finish(const Lane& lane, Table& t, float block_sum, double* per_tensor) const {
    atomic_add(&per_tensor[t.global_index[slot_of(t, lane.block)]], (double)block_sum);
  }
};

}  // namespace mixedprec
