// The L2 norms on the GPU: l2norm_kernel.h's functor, launched by CudaGrid.
#include "multi_tensor_apply.cuh"
#include "l2norm_kernel.h"

namespace mixedprec {

std::vector<at::Tensor> l2norm_cuda(const std::vector<at::Tensor>& ts) { return l2norm_on<CudaGrid>(ts); }

}  // namespace mixedprec
