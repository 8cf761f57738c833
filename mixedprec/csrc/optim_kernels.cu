// Fused SGD and Adam/AdamW steps on fp32 masters: read the (half) grads, unscale, update the master and its
// state, write the half model copy. When the overflow flag is set every block returns at once, and the Adam
// step counter does not move: the skip is decided on the device, with no host sync.
#include "multi_tensor_apply.cuh"

namespace mixedprec {

template <typename G, typename O> struct SgdFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, float inv_scale, float lr, float momentum, float damp,
                             float wd, bool nesterov, bool first_run, bool has_out) {
    if (*noop) return;
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const G* g = static_cast<const G*>(t.addr[0][slot]);
    float* p = static_cast<float*>(t.addr[1][slot]);
    float* m = momentum != 0.f ? static_cast<float*>(t.addr[2][slot]) : nullptr;
    O* o = has_out ? static_cast<O*>(t.addr[3][slot]) : nullptr;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float gi = __fmul_rn(to_float(g[i]), inv_scale);
      if (wd != 0.f) gi = __fadd_rn(gi, __fmul_rn(wd, p[i]));
      if (m) {
        m[i] = first_run ? gi : __fadd_rn(__fmul_rn(m[i], momentum), __fmul_rn(damp, gi));
        gi = nesterov ? __fadd_rn(gi, __fmul_rn(momentum, m[i])) : m[i];
      }
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, gi));
      if (o) o[i] = static_cast<O>(p[i]);
    }
  }
};

// The scalars arrive as the host computes them (in double, rounded once to float), as the reference's Python scalars do;
// the per-step factors come from the step count: `host_step` when the host advanced it, else the device counter `step`.
template <typename G, typename O> struct AdamFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, const float* step, double host_step, float inv_scale, double lr,
                             double beta1, double beta2, float omb1, float b2, float omb2, float eps, float l2, float decay,
                             bool decoupled, bool has_out) {
    if (*noop) return;
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const G* g = static_cast<const G*>(t.addr[0][slot]);
    float* p = static_cast<float*>(t.addr[1][slot]);
    float* m = static_cast<float*>(t.addr[2][slot]);
    float* v = static_cast<float*>(t.addr[3][slot]);
    O* o = has_out ? static_cast<O*>(t.addr[4][slot]) : nullptr;
    const double s = step ? (double)*step : host_step;
    const float step_size = (float)(lr / (1.0 - pow(beta1, s)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, s));
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float gi = __fmul_rn(to_float(g[i]), inv_scale);
      if (decoupled) p[i] = __fmul_rn(p[i], decay);
      else if (l2 != 0.f) gi = __fadd_rn(gi, __fmul_rn(l2, p[i]));
      m[i] = __fadd_rn(m[i], __fmul_rn(omb1, __fsub_rn(gi, m[i])));
      v[i] = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(omb2, gi), gi));
      const float denom = __fadd_rn(__fdiv_rn(sqrtf(v[i]), bc2_sqrt), eps);
      p[i] = __fsub_rn(p[i], __fmul_rn(step_size, __fdiv_rn(m[i], denom)));
      if (o) o[i] = static_cast<O>(p[i]);
    }
  }
};

__global__ void advance_step_kernel(const int* noop, float* step) { if (!*noop) *step += 1.f; }

static at::Tensor as_int_flag(const at::Tensor& found_inf) { return found_inf.to(at::kInt); }

void sgd_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                   const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool first_run) {
  if (params.empty()) return;
  auto flag = as_int_flag(found_inf);
  const bool has_out = !out.empty();
  const auto& m = momentum != 0 ? bufs : params;      // an unused list when there is no momentum
  const auto& o = has_out ? out : params;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "mixedprec_sgd_cuda", [&] {
    using G = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o[0].scalar_type(), "mixedprec_sgd_cuda_out", [&] {
      multi_tensor_apply<4>(flag, {grads, params, m, o}, SgdFunctor<G, scalar_t>(), (float)inv_scale, (float)lr, (float)momentum,
                            (float)(1.0 - dampening), (float)weight_decay, nesterov, first_run, has_out);
    });
  });
}

// `step` on the device: it advances there, unless the device flag `found_inf` is set (no host sync). `step` on the CPU
// (torch's layout for a non-capturable optimizer): then `found_inf` must be a CPU tensor too, and the host advances it.
void adam_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                    const at::Tensor& step, double inv_scale, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled) {
  if (params.empty()) return;
  TORCH_CHECK(step.scalar_type() == at::kFloat && step.numel() == 1, "adam_step: step must be a 1-element fp32 tensor");
  const c10::cuda::CUDAGuard guard(params[0].device());
  at::Tensor flag;
  double host_step = 0;
  if (step.is_cuda()) {
    flag = as_int_flag(found_inf);
    advance_step_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(flag.data_ptr<int>(), step.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    TORCH_CHECK(found_inf.device().is_cpu(), "adam_step: with the step count on the CPU, found_inf must be a CPU tensor too "
                "(keep both on the GPU to decide the skip there)");
    if (found_inf.item<bool>()) return;
    float* stp = step.data_ptr<float>();
    *stp += 1.f;
    host_step = *stp;
    flag = at::zeros({}, params[0].options().dtype(at::kInt));
  }
  const float* device_step = step.is_cuda() ? step.data_ptr<float>() : nullptr;
  const bool has_out = !out.empty();
  const auto& o = has_out ? out : params;
  const float omb1 = 1.0 - beta1, b2 = beta2, omb2 = 1.0 - beta2, fe = eps;
  const float l2 = decoupled ? 0.f : (float)weight_decay, decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "mixedprec_adam_cuda", [&] {
    using G = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o[0].scalar_type(), "mixedprec_adam_cuda_out", [&] {
      multi_tensor_apply<5>(flag, {grads, params, exp_avgs, exp_avg_sqs, o}, AdamFunctor<G, scalar_t>(), device_step, host_step,
                            (float)inv_scale, lr, beta1, beta2, omb1, b2, omb2, fe, l2, decay, decoupled, has_out);
    });
  });
}

}  // namespace mixedprec
