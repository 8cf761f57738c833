// dst = src*scale (or dst += src*scale) over many tensors, raising a device flag on any non-finite input.
#include "multi_tensor_apply.cuh"

namespace mixedprec {

template <typename S, typename D, bool Add> struct ScaleFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, float scale, int* flag) {
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
at::Tensor scale_cuda_impl(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale) {
  auto flag = at::zeros({}, src[0].options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src[0].scalar_type(), "mixedprec_scale_cuda_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst[0].scalar_type(), "mixedprec_scale_cuda_dst", [&] {
      multi_tensor_apply<2>(flag, {src, dst}, ScaleFunctor<S, scalar_t, Add>(), (float)scale, flag.data_ptr<int>());
    });
  });
  return flag.to(at::kBool);
}

at::Tensor scale_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale) {
  return scale_cuda_impl<false>(src, dst, scale);
}
at::Tensor scale_add_check_cuda(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale) {
  return scale_cuda_impl<true>(src, dst, scale);
}

}  // namespace mixedprec
