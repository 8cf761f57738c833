// Global and per-tensor L2 norms over many tensors on a multi-tensor grid (multi_tensor.h): each thread's fp32 sum of
// squares, summed over its block, then added per tensor in double.
#pragma once
#include "multi_tensor.h"

namespace mixedprec {

template <typename T> struct SquareSumFunctor {
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

template <typename Grid>
std::vector<at::Tensor> l2norm_on(const std::vector<at::Tensor>& ts) {
  const typename Grid::Guard guard(ts[0].device());
  auto sums = at::zeros({(int64_t)ts.size()}, ts[0].options().dtype(at::kDouble));
  auto noop = at::zeros({}, ts[0].options().dtype(at::kInt));
  // one launch sequence per dtype present
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    std::vector<at::Tensor> sel;
    std::vector<int64_t> idx;
    for (size_t i = 0; i < ts.size(); ++i) if (ts[i].scalar_type() == dtype) { sel.push_back(ts[i]); idx.push_back(i); }
    if (sel.empty()) continue;
    auto part = at::zeros({(int64_t)sel.size()}, ts[0].options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mixedprec_l2norm", [&] {
      multi_tensor_sum<Grid, 1>(noop, {sel}, SquareSumFunctor<scalar_t>(), part.data_ptr<double>());
    });
    sums.index_copy_(0, at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(ts[0].device()), part);
  }
  return {sums.sum().sqrt().to(at::kFloat), sums.sqrt().to(at::kFloat)};
}

}  // namespace mixedprec
