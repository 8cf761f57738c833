// The host's side of the multi-tensor machinery (multi_tensor.h): the launches planned over lists of ATen tensors, each
// handed to a grid (cuda_dispatch.cpp's CudaGrid, which calls a kernel built by nvcc; the tests' CPU emulation). Compiled
// by the host compiler only: the .cu units include no ATen header.
#pragma once
#include <ATen/core/Tensor.h>           // ATen's own headers, not <torch/extension.h>: a shorter compile
#include <ATen/Dispatch.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <vector>
#include "multi_tensor.h"
#include "messages.h"

namespace mixedprec {

// A launch callback without its type: plan_launches is compiled once per table type, not once per functor and element
// types (180 of them, which took most of the host side's compile time).
template <typename Table> struct LaunchRef {
  void* ctx;
  void (*call)(void*, const Table&, int);
  template <typename F>
  explicit LaunchRef(F& f) : ctx(&f), call([](void* c, const Table& t, int blocks) { (*static_cast<F*>(c))(t, blocks); }) {}
  void operator()(const Table& t, int blocks) const { call(ctx, t, blocks); }
};

// Plan the launches over `lists` (lists[d][i] is the i-th tensor of list d; every list has the same length and paired
// tensors the same numel) in chunks of `chunk` elements: fill tables and call launch(table, blocks) each time one is
// full and at the end. With WithScalar, scalars[i] is a 1-element fp32 tensor, seen by the functor as t.scalar[slot].
template <int Depth, bool WithScalar>
void plan_launches(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<at::Tensor>* scalars, int64_t chunk,
                   LaunchRef<TensorTable<Depth, WithScalar>> launch) {
  using Table = TensorTable<Depth, WithScalar>;
  static_assert(sizeof(Table) <= 4000, "the tensor table must fit the 4 KB kernel-argument limit");
  TORCH_CHECK((int)lists.size() == Depth, msg("multi_tensor_apply: expected ", Depth, " tensor lists, got ", lists.size()));
  TORCH_CHECK(chunk > 0 && chunk % kPack == 0, msg("multi_tensor_apply: the chunk must be a positive multiple of ", kPack, ", got ", chunk));
  constexpr int64_t kMaxLaunchBlocks = (int64_t)1 << 30;       // under CUDA's 2^31 - 1 blocks in x, with room to spare
  Table table;
  int slots = 0;
  int64_t blocks = 0;
  auto flush = [&]() {
    if (slots == 0) return;
    table.slots = slots;
    launch(table, (int)blocks);
    slots = 0; blocks = 0;
  };
  for (size_t t = 0; t < lists[0].size(); ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    const int64_t chunks = (numel + chunk - 1) / chunk;
    TORCH_CHECK(chunks <= kMaxLaunchBlocks, msg("multi_tensor_apply: tensor ", (int64_t)t, " has ", numel,
                                                  " elements, more than ", kMaxLaunchBlocks, " chunks of ", chunk));
    if (slots == Table::kMaxTensors || blocks + chunks > kMaxLaunchBlocks) flush();
    for (int d = 0; d < Depth; ++d) table.addr[d][slots] = lists[d][t].data_ptr();
    if constexpr (WithScalar) table.scalar[slots] = (*scalars)[t].data_ptr<float>();
    table.numel[slots] = numel;
    table.global_index[slots] = (int)t;
    table.first_block[slots] = (int)blocks;
    ++slots;
    blocks += chunks;
  }
  flush();
}

// Run functor `f` on `Grid` (CudaGrid in the CUDA build, the tests' CPU emulation) over `lists`: f(lane, chunk, noop,
// table, args...) once per thread of each planned launch; `noop` is a 0-dim int tensor that the functors may read.
template <typename Grid, int Depth, typename Functor, typename... Args>
void multi_tensor_apply(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists, Functor f, Args... args) {
  auto launch = [&](const TensorTable<Depth, false>& table, int blocks) {
    Grid::run(table, blocks, noop.data_ptr<int>(), f, args...);
  };
  plan_launches<Depth, false>(lists, nullptr, Grid::chunk(), LaunchRef<TensorTable<Depth, false>>(launch));
}

// The same with one 1-element fp32 tensor per tensor of the lists (on their device), read as t.scalar[slot].
template <typename Grid, int Depth, typename Functor, typename... Args>
void multi_tensor_apply_with_scalars(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists,
                                     const std::vector<at::Tensor>& scalars, Functor f, Args... args) {
  auto launch = [&](const TensorTable<Depth, true>& table, int blocks) {
    Grid::run(table, blocks, noop.data_ptr<int>(), f, args...);
  };
  plan_launches<Depth, true>(lists, &scalars, Grid::chunk(), LaunchRef<TensorTable<Depth, true>>(launch));
}

// A block sum: each thread's f.partial(lane, chunk, noop, table) summed over its block, then f.finish(lane, table, sum, args...).
template <typename Grid, int Depth, typename Functor, typename... Args>
void multi_tensor_sum(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists, Functor f, Args... args) {
  auto launch = [&](const TensorTable<Depth, false>& table, int blocks) {
    Grid::run_sum(table, blocks, noop.data_ptr<int>(), f, args...);
  };
  plan_launches<Depth, false>(lists, nullptr, Grid::chunk(), LaunchRef<TensorTable<Depth, false>>(launch));
}

}  // namespace mixedprec
