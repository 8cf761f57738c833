// Global and per-tensor L2 norms over many tensors: block sums of squares, added per tensor in double.
#include "multi_tensor_apply.cuh"

namespace mixedprec {

template <typename T> struct SquareSumFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, double* per_tensor) {
    __shared__ float partial[kBlockSize];
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const T* x = static_cast<const T*>(t.addr[0][slot]);
    float acc = 0.f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) { const float v = to_float(x[i]); acc += v * v; }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if ((int)threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(&per_tensor[t.global_index[slot]], (double)partial[0]);
  }
};

std::vector<at::Tensor> l2norm_cuda(const std::vector<at::Tensor>& ts) {
  auto sums = at::zeros({(int64_t)ts.size()}, ts[0].options().dtype(at::kDouble));
  auto noop = at::zeros({}, ts[0].options().dtype(at::kInt));
  // one launch sequence per dtype present
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    std::vector<at::Tensor> sel;
    std::vector<int64_t> idx;
    for (size_t i = 0; i < ts.size(); ++i) if (ts[i].scalar_type() == dtype) { sel.push_back(ts[i]); idx.push_back(i); }
    if (sel.empty()) continue;
    auto part = at::zeros({(int64_t)sel.size()}, ts[0].options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mixedprec_l2norm_cuda", [&] {
      multi_tensor_apply<1>(noop, {sel}, SquareSumFunctor<scalar_t>(), part.data_ptr<double>());
    });
    sums.index_copy_(0, at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(ts[0].device()), part);
  }
  return {sums.sum().sqrt().to(at::kFloat), sums.sqrt().to(at::kFloat)};
}

}  // namespace mixedprec
