// The unscale/scale ops on the GPU: scale_kernels.h's functor, launched by CudaGrid.
#include "multi_tensor_apply.cuh"
#include "scale_kernels.h"

namespace mixedprec {

at::Tensor scale_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_check_on<CudaGrid, false>(src, dst, scale, scale_ptr);
}
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_check_on<CudaGrid, true>(src, dst, scale, scale_ptr);
}

}  // namespace mixedprec
