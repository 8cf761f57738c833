// Fused SGD and Adam/AdamW steps on fp32 masters: read the (half) grads, unscale, update the master and its
// state, write the half model copy. When the overflow flag is set every block returns at once: the skip is decided
// on the device, with no host sync (the caller advances Adam's step counts by 1 - flag, on the device too).
#include "multi_tensor_apply.cuh"
#include "bf16_bits.h"

namespace mixedprec {

// How a functor finds each master (bf16_bits.h): an fp32 param (and its optional half copy in the `out` list), a bf16
// param with its int16 low halves in the `out` list's place (split), or a bf16 param rounded stochastically.
enum MasterMode { kFp32 = 0, kSplit = 1, kStochastic = 2 };

template <int Mode> __device__ __forceinline__ float load_master(void* p, void* lo, int64_t i) {
  if constexpr (Mode == kFp32) return static_cast<float*>(p)[i];
  else if constexpr (Mode == kSplit) return join_bf16(static_cast<uint16_t*>(p)[i], static_cast<int16_t*>(lo)[i]);
  else return bits_float((uint32_t)static_cast<uint16_t*>(p)[i] << 16);
}

template <int Mode, typename O> __device__ __forceinline__ void store_master(float x, void* p, void* lo, O* o, uint64_t seed, int64_t i) {
  if constexpr (Mode == kFp32) { static_cast<float*>(p)[i] = x; if (o) o[i] = static_cast<O>(x); }
  else if constexpr (Mode == kSplit) split_bf16(x, static_cast<uint16_t*>(p)[i], static_cast<int16_t*>(lo)[i]);
  else static_cast<uint16_t*>(p)[i] = round_stochastic(x, rounding_bits(seed, (uint64_t)i));
}

template <typename G, typename O, int Mode> struct SgdFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, float inv_scale, float lr, float momentum, float damp,
                             float wd, float decay, bool decoupled, bool nesterov, bool first_run, bool has_buf, bool has_out, const int64_t* seeds) {
    if (*noop) return;
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const G* g = static_cast<const G*>(t.addr[0][slot]);
    void* p = t.addr[1][slot];
    float* m = has_buf ? static_cast<float*>(t.addr[2][slot]) : nullptr;
    void* lo = Mode == kSplit ? t.addr[3][slot] : nullptr;
    O* o = Mode == kFp32 && has_out ? static_cast<O*>(t.addr[3][slot]) : nullptr;
    const uint64_t seed = Mode == kStochastic ? (uint64_t)seeds[t.global_index[slot]] : 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float p0 = load_master<Mode>(p, lo, i);
      float gi = __fmul_rn(to_float(g[i]), inv_scale);
      if (wd != 0.f) gi = __fadd_rn(gi, __fmul_rn(wd, p0));
      if (m) {
        m[i] = first_run ? gi : __fadd_rn(__fmul_rn(m[i], momentum), __fmul_rn(damp, gi));
        gi = nesterov ? __fadd_rn(gi, __fmul_rn(momentum, m[i])) : m[i];
      }
      const float pv = decoupled ? __fmul_rn(p0, decay) : p0;
      store_master<Mode>(__fsub_rn(pv, __fmul_rn(lr, gi)), p, lo, o, seed, i);
    }
  }
};

// The scalars arrive as the host computes them (in double, rounded once to float), as the reference's Python scalars do;
// the per-step factors come from each tensor's own step count (t.scalar[slot], on the device) plus one; the caller
// advances the counts afterwards, on the device, unless the flag is set.
template <typename G, typename O, int Mode> struct AdamFunctor {
  template <typename Table>
  __device__ void operator()(int64_t chunk, const int* noop, Table& t, float inv_scale, double lr, double beta1, double beta2,
                             float omb1, float b2, float omb2, float eps, float l2, float decay, bool decoupled, bool has_out, const int64_t* seeds) {
    if (*noop) return;
    int64_t begin, end;
    const int slot = block_range(t, chunk, begin, end);
    const G* g = static_cast<const G*>(t.addr[0][slot]);
    void* p = t.addr[1][slot];
    float* m = static_cast<float*>(t.addr[2][slot]);
    float* v = static_cast<float*>(t.addr[3][slot]);
    void* lo = Mode == kSplit ? t.addr[4][slot] : nullptr;
    O* o = Mode == kFp32 && has_out ? static_cast<O*>(t.addr[4][slot]) : nullptr;
    const uint64_t seed = Mode == kStochastic ? (uint64_t)seeds[t.global_index[slot]] : 0;
    const double s = (double)*t.scalar[slot] + 1.0;           // this step's count; the caller advances it afterwards
    const float step_size = (float)(lr / (1.0 - pow(beta1, s)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, s));
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float pv = load_master<Mode>(p, lo, i);
      float gi = __fmul_rn(to_float(g[i]), inv_scale);
      if (decoupled) pv = __fmul_rn(pv, decay);
      else if (l2 != 0.f) gi = __fadd_rn(gi, __fmul_rn(l2, pv));
      m[i] = __fadd_rn(m[i], __fmul_rn(omb1, __fsub_rn(gi, m[i])));
      v[i] = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(omb2, gi), gi));
      const float denom = __fadd_rn(__fdiv_rn(sqrtf(v[i]), bc2_sqrt), eps);
      store_master<Mode>(__fsub_rn(pv, __fmul_rn(step_size, __fdiv_rn(m[i], denom))), p, lo, o, seed, i);
    }
  }
};

// The storage mode of a call: fp32 masters, split bf16 (`lows` given) or stochastic rounding (`seeds` given).
static int master_mode(const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds) {
  return !lows.empty() ? kSplit : (seeds.has_value() && seeds->defined()) ? kStochastic : kFp32;
}

#define MIXEDPREC_MODES(MODE, ...)                                                                          \
  switch (MODE) {                                                                                           \
    case kSplit: { constexpr int kMode = kSplit; __VA_ARGS__(); break; }                                    \
    case kStochastic: { constexpr int kMode = kStochastic; __VA_ARGS__(); break; }                          \
    default: { constexpr int kMode = kFp32; __VA_ARGS__(); break; }                                         \
  }

// The overflow flag as the kernels' int no-op flag, on the params' device (a CPU flag is copied there).
static at::Tensor as_int_flag(const at::Tensor& found_inf, const at::Tensor& like) { return found_inf.to(like.device(), at::kInt); }

void sgd_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                   const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled,
                   const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  auto flag = as_int_flag(found_inf, params[0]);
  const bool has_out = !out.empty();
  const bool has_buf = !bufs.empty();
  const int mode = master_mode(lows, seeds);
  const int64_t* seed_ptr = mode == kStochastic ? seeds->data_ptr<int64_t>() : nullptr;
  const auto& m = has_buf ? bufs : params;            // an unused list when there is no momentum buffer
  const auto& o = mode == kSplit ? lows : has_out ? out : params;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "mixedprec_sgd_cuda", [&] {
    using G = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, has_out ? o[0].scalar_type() : at::kFloat, "mixedprec_sgd_cuda_out", [&] {
      using O = scalar_t;
      MIXEDPREC_MODES(mode, [&] {
        multi_tensor_apply<4>(flag, {grads, params, m, o}, SgdFunctor<G, O, kMode>(), (float)inv_scale, (float)lr, (float)momentum,
                              (float)(1.0 - dampening), decoupled ? 0.f : (float)weight_decay,
                              decoupled ? (float)(1.0 - lr * weight_decay) : 1.f, decoupled, nesterov, first_run, has_buf, has_out, seed_ptr);
      });
    });
  });
}

// `steps[i]` is tensor i's step count before this step, a 1-element fp32 tensor on the device (torch's capturable layout);
// the caller advances it afterwards when the step is taken. The skip is decided on the device from `found_inf` (no host sync).
void adam_step_cuda(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                    const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  auto flag = as_int_flag(found_inf, params[0]);
  const bool has_out = !out.empty();
  const int mode = master_mode(lows, seeds);
  const int64_t* seed_ptr = mode == kStochastic ? seeds->data_ptr<int64_t>() : nullptr;
  const auto& o = mode == kSplit ? lows : has_out ? out : params;
  const float omb1 = 1.0 - beta1, b2 = beta2, omb2 = 1.0 - beta2, fe = eps;
  const float l2 = decoupled ? 0.f : (float)weight_decay, decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "mixedprec_adam_cuda", [&] {
    using G = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, has_out ? o[0].scalar_type() : at::kFloat, "mixedprec_adam_cuda_out", [&] {
      using O = scalar_t;
      MIXEDPREC_MODES(mode, [&] {
        multi_tensor_apply_with_scalars<5>(flag, {grads, params, exp_avgs, exp_avg_sqs, o}, steps, AdamFunctor<G, O, kMode>(),
                                           (float)inv_scale, lr, beta1, beta2, omb1, b2, omb2, fe, l2, decay, decoupled, has_out, seed_ptr);
      });
    });
  });
}

}  // namespace mixedprec
