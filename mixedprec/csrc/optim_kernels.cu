// The fused SGD and Adam/AdamW steps on the GPU: optim_kernels.h's functors, launched by CudaGrid.
#include "multi_tensor_apply.cuh"
#include "optim_kernels.h"

namespace mixedprec {

void sgd_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                   const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled,
                   const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& state_seeds,
                   const std::vector<at::Tensor>& state_scales) {
  sgd_step_on<CudaGrid>(grads, params, bufs, out, found_inf, inv_scale, lr, momentum, dampening, weight_decay, nesterov, first_run, decoupled,
                        lows, seeds, state_seeds, state_scales);
}

void adam_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                    const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds,
                    const std::optional<at::Tensor>& state_seeds, const std::vector<at::Tensor>& state_scales) {
  adam_step_on<CudaGrid>(grads, params, exp_avgs, exp_avg_sqs, out, found_inf, steps, inv_scale, lr, beta1, beta2, eps, weight_decay, decoupled,
                         lows, seeds, state_seeds, state_scales);
}

}  // namespace mixedprec
