// Multi-tensor apply: run one functor over chunks of many tensors in few kernel launches.
// The host packs the addresses of up to kMaxTensors tensors of each list (and, for ops that need one, the address of
// a per-tensor fp32 scalar such as Adam's step count), and a block -> (tensor, chunk) map of up to kMaxBlocks blocks,
// into a struct passed by value as the kernel argument (it must stay under the 4 KB kernel-argument limit),
// launches, and starts a new table when either fills up. A tensor whose chunks
// span two launches is carried over into the next table. The design follows the public description of
// NVIDIA apex's multi_tensor_apply; this is an independent implementation.
#pragma once
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <vector>
#include "messages.h"

namespace mixedprec {

constexpr int kBlockSize = 512;
constexpr int64_t kCudaChunk = 2048 * 32;
// Tensors per table for list depth 1..5, so that the table stays under the kernel-argument limit.
constexpr int kMaxTensorsFor[6] = {0, 110, 64, 48, 36, 30};
constexpr int kMaxBlocks = 320;

template <int Depth, bool WithScalar = false> struct TensorTable {
  static constexpr int kMaxTensors = kMaxTensorsFor[Depth];
  void* addr[Depth][kMaxTensors];
  float* scalar[WithScalar ? kMaxTensors : 1];   // a per-tensor scalar in device memory (WithScalar only)
  int64_t numel[kMaxTensors];
  int global_index[kMaxTensors];            // index of the tensor in the caller's lists (for per-tensor outputs)
  unsigned char block_tensor[kMaxBlocks];   // which table slot each block works on
  int block_chunk[kMaxBlocks];              // which chunk of that tensor
};

template <typename Table, typename Functor, typename... Args>
__global__ void multi_tensor_kernel(int64_t chunk, const int* __restrict__ noop, Table table, Functor f, Args... args) {
  f(chunk, noop, table, args...);
}

// lists[d][i] is the i-th tensor of list d; every list has the same length and paired tensors the same numel.
// With WithScalar, scalars[i] is a 1-element fp32 tensor on the same device, seen by the functor as t.scalar[slot].
template <int Depth, bool WithScalar, typename Functor, typename... Args>
void multi_tensor_apply_impl(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists, const std::vector<at::Tensor>* scalars,
                             Functor f, Args... args) {
  TORCH_CHECK((int)lists.size() == Depth, msg("multi_tensor_apply: expected ", Depth, " tensor lists, got ", lists.size()));
  const int64_t n = lists[0].size();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(lists[0][0].device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  TensorTable<Depth, WithScalar> table;
  int slots = 0, blocks = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int d = 0; d < Depth; ++d) table.addr[d][slots] = lists[d][t].data_ptr();
    if constexpr (WithScalar) table.scalar[slots] = (*scalars)[t].data_ptr<float>();
    table.numel[slots] = numel;
    table.global_index[slots] = (int)t;
    ++slots;
    const int64_t chunks = (numel + kCudaChunk - 1) / kCudaChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = (unsigned char)(slots - 1);
      table.block_chunk[blocks] = (int)c;
      ++blocks;
      const bool table_full = blocks == kMaxBlocks;
      const bool slots_full = slots == TensorTable<Depth, WithScalar>::kMaxTensors && c == chunks - 1;
      const bool last = t == n - 1 && c == chunks - 1;
      if (table_full || slots_full || last) {
        multi_tensor_kernel<<<blocks, kBlockSize, 0, stream>>>(kCudaChunk, noop.data_ptr<int>(), table, f, args...);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        blocks = 0;
        if (c == chunks - 1) slots = 0;
        else {                                 // the current tensor carries over into the next table
          for (int d = 0; d < Depth; ++d) table.addr[d][0] = table.addr[d][slots - 1];
          if constexpr (WithScalar) table.scalar[0] = table.scalar[slots - 1];
          table.numel[0] = table.numel[slots - 1];
          table.global_index[0] = table.global_index[slots - 1];
          slots = 1;
        }
      }
    }
  }
  if (blocks > 0) {                            // only when the last tensors were empty
    multi_tensor_kernel<<<blocks, kBlockSize, 0, stream>>>(kCudaChunk, noop.data_ptr<int>(), table, f, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <int Depth, typename Functor, typename... Args>
void multi_tensor_apply(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists, Functor f, Args... args) {
  multi_tensor_apply_impl<Depth, false>(noop, lists, nullptr, f, args...);
}

template <int Depth, typename Functor, typename... Args>
void multi_tensor_apply_with_scalars(const at::Tensor& noop, const std::vector<std::vector<at::Tensor>>& lists,
                                     const std::vector<at::Tensor>& scalars, Functor f, Args... args) {
  static_assert(sizeof(TensorTable<Depth, true>) <= 4000, "the tensor table must fit the 4 KB kernel-argument limit");
  multi_tensor_apply_impl<Depth, true>(noop, lists, &scalars, f, args...);
}

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }

// The table slot this block works on, and the element range [begin, end) of its chunk.
template <typename Table>
__device__ __forceinline__ int block_range(const Table& t, int64_t chunk, int64_t& begin, int64_t& end) {
  const int slot = t.block_tensor[blockIdx.x];
  begin = (int64_t)t.block_chunk[blockIdx.x] * chunk;
  end = min(t.numel[slot], begin + chunk);
  return slot;
}

}  // namespace mixedprec
