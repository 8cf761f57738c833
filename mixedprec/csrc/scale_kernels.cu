// dst = src*scale (or dst += src*scale) over many tensors, raising a device flag on any non-finite input. The scale is
// a host number, or (scale_ptr) a 1-element fp32 tensor on the device, so that a scale the device computed needs no host read.
#include "multi_tensor_apply.cuh"

namespace mixedprec {

template <typename S, typename D, bool Add> struct ScaleFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, float host_scale, const float* scale_ptr, int* flag) {
    const float scale = scale_ptr ? *scale_ptr : host_scale;
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const S* src = static_cast<const S*>(t.addr[0][slot]);
    D* dst = static_cast<D*>(t.addr[1][slot]);
    bool bad = false;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float x = to_float(src[i]);
      bad |= !isfinite(x);
      const float prod = __fmul_rn(x, scale);                   // no fused multiply-add: match the reference's rounding
      dst[i] = static_cast<D>(Add ? __fadd_rn(to_float(dst[i]), prod) : prod);
    }
    if (bad) *flag = 1;
  }
};

template <bool Add>
at::Tensor scale_cuda_impl(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  auto flag = at::zeros({}, src[0].options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src[0].scalar_type(), "mixedprec_scale_cuda_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst[0].scalar_type(), "mixedprec_scale_cuda_dst", [&] {
      multi_tensor_apply<2>(flag, {src, dst}, ScaleFunctor<S, scalar_t, Add>(), (float)scale, scale_ptr, flag.data_ptr<int>());
    });
  });
  return flag.to(at::kBool);
}

at::Tensor scale_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_cuda_impl<false>(src, dst, scale, scale_ptr);
}
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  return scale_cuda_impl<true>(src, dst, scale, scale_ptr);
}

}  // namespace mixedprec
