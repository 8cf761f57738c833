// The GPU's launches of the multi-tensor functors (multi_tensor.h), for the kernel units nvcc compiles without ATen's
// headers (core_kernels.cu, step_kernel.cu): each functor's launch function (kernel_keys.h's contract), which the host's
// CudaGrid (cuda_dispatch.cpp) finds by the functor's key and calls with a planned table and the current stream. The
// tests' emulation runs the same functors on a grid of the same shape that loops over blocks and threads on the CPU.
#pragma once
#include <cuda_runtime.h>
#include "kernel_keys.h"
#include "multi_tensor.h"

namespace mixedprec {

// At least two blocks per multiprocessor: the 8-bit steps' functors would take 66-71 registers a thread and leave room
// for one block (16 warps) only, too few to keep loads in flight; capped at 64, two blocks fit.
template <typename Table, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlockSize, 2)
multi_tensor_kernel(int64_t chunk, const int* __restrict__ noop, Table table, Functor f, Args... args) {
  f(Lane{(int)blockIdx.x, (int)threadIdx.x, (int)blockDim.x}, chunk, noop, table, args...);
}

// Each thread's partial sum (f.partial), summed over the block in shared memory, handed to f.finish by thread 0.
template <typename Table, typename Functor, typename... Args>
__global__ void multi_tensor_sum_kernel(int64_t chunk, const int* __restrict__ noop, Table table, Functor f, Args... args) {
  __shared__ float partial[kBlockSize];
  const Lane lane{(int)blockIdx.x, (int)threadIdx.x, (int)blockDim.x};
  partial[threadIdx.x] = f.partial(lane, chunk, noop, table);
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) f.finish(lane, table, partial[0], args...);
}

template <typename F, typename L = typename F::Args> struct Launcher;
template <typename F, typename... A> struct Launcher<F, ArgList<A...>> {
  static const char* launch(const typename F::Table& table, int blocks, const int* noop, void* stream, A... args) {
    const auto s = static_cast<cudaStream_t>(stream);
    if constexpr (is_block_sum<F>::value) multi_tensor_sum_kernel<<<blocks, kBlockSize, 0, s>>>(kCudaChunk, noop, table, F(), args...);
    else multi_tensor_kernel<<<blocks, kBlockSize, 0, s>>>(kCudaChunk, noop, table, F(), args...);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
};

template <typename F> KernelEntry entry_of() {
  static_assert(std::is_same_v<decltype(&Launcher<F>::launch), typename LaunchOf<F>::type>, "the launch's type is the contract's");
  return {F::kKey, reinterpret_cast<void*>(&Launcher<F>::launch)};
}

}  // namespace mixedprec
