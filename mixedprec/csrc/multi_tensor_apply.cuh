// The GPU's launches of the multi-tensor functors (multi_tensor.h): CudaGrid, the grid that the ops' host code
// (scale_kernels.h, l2norm_kernel.h, optim_kernels.h) runs them on in the CUDA build. The tests' emulation supplies a
// grid of the same shape that loops over blocks and threads on the CPU (tests/csrc/cuda_emulator.cpp).
#pragma once
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
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

struct CudaGrid {
  using Guard = c10::cuda::CUDAGuard;
  static int64_t chunk() { return kCudaChunk; }

  template <typename Table, typename Functor, typename... Args>
  static void run(const Table& table, int blocks, const int* noop, Functor f, Args... args) {
    multi_tensor_kernel<<<blocks, kBlockSize, 0, c10::cuda::getCurrentCUDAStream()>>>(kCudaChunk, noop, table, f, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename Table, typename Functor, typename... Args>
  static void run_sum(const Table& table, int blocks, const int* noop, Functor f, Args... args) {
    multi_tensor_sum_kernel<<<blocks, kBlockSize, 0, c10::cuda::getCurrentCUDAStream()>>>(kCudaChunk, noop, table, f, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace mixedprec
