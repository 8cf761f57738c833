// The host's side of the multi-tensor ops: the tensors checked for a launch, each op's element types dispatched to its
// functor (scale_kernels.h, l2norm_kernel.h, optim_kernels.h) and its launches planned (multi_tensor_plan.h) on a grid:
// CudaGrid in the CUDA build (cuda_dispatch.cpp), the tests' CPU emulation of it (tests/csrc/cuda_emulator.cpp).
#pragma once
#include "multi_tensor_plan.h"
#include "scale_kernels.h"
#include "l2norm_kernel.h"
#include "optim_kernels.h"

namespace mixedprec {

// What every grid checks of a launch at compile time (kernel_keys.h's contract): the functor holds nothing (its kernel
// makes its own), it is launched with exactly the table and argument types its kernel is built for, and a step key
// decodes to this very functor (so the kernel that key builds is the one dispatched).
template <typename Table, typename Functor, typename... A> constexpr void check_contract() {
  static_assert(std::is_empty_v<Functor>, "a functor holds nothing");
  static_assert(std::is_same_v<Table, typename Functor::Table> && std::is_same_v<ArgList<A...>, typename Functor::Args>,
                "a functor is launched with exactly the table and arguments its kernel is built for");
  if constexpr (key_kind(Functor::kKey) >= kSgdKernel)
    static_assert(std::is_same_v<StepFunctorOf<Functor::kKey>, Functor>, "a step key names its functor");
}

template <typename Grid, bool Add>
at::Tensor scale_check_on(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const float* scale_ptr) {
  if (src.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kBool));
  auto flag = at::zeros({}, src[0].options().dtype(at::kInt));
  const typename Grid::Guard guard(src[0].device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src[0].scalar_type(), "mixedprec_scale_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst[0].scalar_type(), "mixedprec_scale_dst", [&] {
      multi_tensor_apply<Grid, 2>(flag, {src, dst}, ScaleFunctor<S, scalar_t, Add>(), (float)scale, scale_ptr, flag.data_ptr<int>());
    });
  });
  return flag.to(at::kBool);
}

template <typename Grid>
std::vector<at::Tensor> l2norm_on(const std::vector<at::Tensor>& ts) {
  const typename Grid::Guard guard(ts[0].device());
  auto sums = at::zeros({(int64_t)ts.size()}, ts[0].options().dtype(at::kDouble));
  auto noop = at::zeros({}, ts[0].options().dtype(at::kInt));
  // one launch sequence per dtype present
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    std::vector<at::Tensor> sel;
    std::vector<int64_t> idx;
    for (size_t i = 0; i < ts.size(); ++i) if (ts[i].scalar_type() == dtype) { sel.push_back(ts[i]); idx.push_back(i); }
    if (sel.empty()) continue;
    auto part = at::zeros({(int64_t)sel.size()}, ts[0].options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mixedprec_l2norm", [&] {
      multi_tensor_sum<Grid, 1>(noop, {sel}, SquareSumFunctor<scalar_t>(), part.data_ptr<double>());
    });
    sums.index_copy_(0, at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(ts[0].device()), part);
  }
  return {sums.sum().sqrt().to(at::kFloat), sums.sqrt().to(at::kFloat)};
}

// The storage mode of a call: fp32 masters, split bf16 (`lows` given) or stochastic rounding (`seeds` given).
inline int master_mode(const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds) {
  return !lows.empty() ? kSplit : (seeds.has_value() && seeds->defined()) ? kStochastic : kFp32;
}

#define MIXEDPREC_MODES(MODE, ...)                                                                          \
  switch (MODE) {                                                                                           \
    case kSplit: { constexpr int kMode = kSplit; __VA_ARGS__(); break; }                                    \
    case kStochastic: { constexpr int kMode = kStochastic; __VA_ARGS__(); break; }                          \
    default: { constexpr int kMode = kFp32; __VA_ARGS__(); break; }                                         \
  }

// The state mode of a call: bf16 or 8-bit when the first state tensor is (the bindings check that all are alike).
inline int state_mode(const std::vector<at::Tensor>& state) {
  if (state.empty()) return kStateFp32;
  return state[0].scalar_type() == at::kBFloat16 ? kStateBf16 : state[0].scalar_type() == at::kChar ? kState8 : kStateFp32;
}

// List j of the scales of 8-bit state (`state_scales` is list-major, `n` tensors per list), or `fill` (an unused list).
inline std::vector<at::Tensor> scale_list(const std::vector<at::Tensor>& state_scales, size_t j, size_t n, const std::vector<at::Tensor>& fill) {
  if (state_scales.size() < (j + 1) * n) return fill;
  return std::vector<at::Tensor>(state_scales.begin() + j * n, state_scales.begin() + (j + 1) * n);
}

#define MIXEDPREC_STATE_MODES(SMODE, ...)                                                                   \
  switch (SMODE) {                                                                                          \
    case kStateBf16: { constexpr int kSMode = kStateBf16; __VA_ARGS__(); break; }                           \
    case kState8: { constexpr int kSMode = kState8; __VA_ARGS__(); break; }                                 \
    default: { constexpr int kSMode = kStateFp32; __VA_ARGS__(); break; }                                   \
  }

// A type passed as a value (C++17 has no std::type_identity): `body(TypeTag<float>())`, then
// `typename decltype(tag)::type`.
template <typename T> struct TypeTag { using type = T; };

// The element type O of the half model copy, which is part of every functor's type: dispatched only where there is a copy
// (fp32 masters with `out`), and float (unused) otherwise, so that no kernel is compiled for a copy that cannot exist.
template <int Mode, typename Body> void with_out_type(bool has_out, at::ScalarType type, Body&& body) {
  if constexpr (Mode == kFp32) {
    if (has_out) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "mixedprec_out",
                                      [&] { body(TypeTag<scalar_t>()); });
      return;
    }
  }
  body(TypeTag<float>());
}

// A step's functor arguments, dispatched once for SGD and Adam: body(TypeTag<G>, TypeTag<O> of the copy, master mode,
// state mode), the modes as integral constants.
template <typename Body>
void with_step_types(at::ScalarType grads, int mode, bool has_out, at::ScalarType out, int smode, Body&& body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads, "mixedprec_step", [&] {
    using G = scalar_t;
    MIXEDPREC_MODES(mode, [&] {
      with_out_type<kMode>(has_out, out, [&](auto out_type) {
        MIXEDPREC_STATE_MODES(smode, [&] {
          body(TypeTag<G>(), out_type, std::integral_constant<int, kMode>(), std::integral_constant<int, kSMode>());
        });
      });
    });
  });
}

inline const int64_t* seeds_ptr(const std::optional<at::Tensor>& seeds) {
  return seeds.has_value() && seeds->defined() ? seeds->data_ptr<int64_t>() : nullptr;
}

// The overflow flag as the kernels' int no-op flag, on the params' device (a CPU flag is copied there).
inline at::Tensor as_int_flag(const at::Tensor& found_inf, const at::Tensor& like) { return found_inf.to(like.device(), at::kInt); }

template <typename Grid>
void sgd_step_on(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                 const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                 double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled,
                 const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& state_seeds,
                 const std::vector<at::Tensor>& state_scales) {
  if (params.empty()) return;
  const typename Grid::Guard guard(params[0].device());
  auto flag = as_int_flag(found_inf, params[0]);
  const bool has_out = !out.empty();
  const bool has_buf = !bufs.empty();
  const int smode = state_mode(bufs);
  const int64_t* state_seed_ptr = seeds_ptr(state_seeds);
  const int mode = master_mode(lows, seeds);
  const int64_t* seed_ptr = mode == kStochastic ? seeds->data_ptr<int64_t>() : nullptr;
  const auto& m = has_buf ? bufs : params;            // an unused list when there is no momentum buffer
  const auto& o = mode == kSplit ? lows : has_out ? out : params;
  with_step_types(grads[0].scalar_type(), mode, has_out, o[0].scalar_type(), smode, [&](auto g, auto copy, auto md, auto sm) {
    using F = SgdFunctor<typename decltype(g)::type, typename decltype(copy)::type, decltype(md)::value, decltype(sm)::value>;
    auto run = [&](auto depth, const std::vector<std::vector<at::Tensor>>& lists) {
      multi_tensor_apply<Grid, decltype(depth)::value>(flag, lists, F(), (float)inv_scale, (float)lr, (float)momentum,
                                                       (float)(1.0 - dampening), decoupled ? 0.f : (float)weight_decay,
                                                       decoupled ? (float)(1.0 - lr * weight_decay) : 1.f, decoupled, nesterov, first_run, has_buf,
                                                       has_out, seed_ptr, state_seed_ptr);
    };
    if constexpr (decltype(sm)::value == kState8) run(Width<5>(), {grads, params, m, o, scale_list(state_scales, 0, params.size(), params)});
    else run(Width<4>(), {grads, params, m, o});
  });
}

// `steps[i]` is tensor i's step count before this step, a 1-element fp32 tensor beside the params (torch's capturable
// layout); the caller advances it afterwards when the step is taken. The skip is decided from `found_inf` beside the
// params (no host sync).
template <typename Grid>
void adam_step_on(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                  const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps,
                  double weight_decay, bool decoupled, const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds,
                  const std::optional<at::Tensor>& state_seeds, const std::vector<at::Tensor>& state_scales) {
  if (params.empty()) return;
  const typename Grid::Guard guard(params[0].device());
  auto flag = as_int_flag(found_inf, params[0]);
  const bool has_out = !out.empty();
  const int smode = state_mode(exp_avgs);
  const int64_t* state_seed_ptr = seeds_ptr(state_seeds);
  const int mode = master_mode(lows, seeds);
  const int64_t* seed_ptr = mode == kStochastic ? seeds->data_ptr<int64_t>() : nullptr;
  const auto& o = mode == kSplit ? lows : has_out ? out : params;
  const float omb1 = 1.0 - beta1, b2 = beta2, omb2 = 1.0 - beta2, fe = eps;
  const float l2 = decoupled ? 0.f : (float)weight_decay, decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.f;
  with_step_types(grads[0].scalar_type(), mode, has_out, o[0].scalar_type(), smode, [&](auto g, auto copy, auto md, auto sm) {
    using F = AdamFunctor<typename decltype(g)::type, typename decltype(copy)::type, decltype(md)::value, decltype(sm)::value>;
    auto run = [&](auto depth, const std::vector<std::vector<at::Tensor>>& lists) {
      multi_tensor_apply_with_scalars<Grid, decltype(depth)::value>(flag, lists, steps, F(), (float)inv_scale, lr, beta1, beta2, omb1, b2,
                                                                    omb2, fe, l2, decay, decoupled, has_out, seed_ptr, state_seed_ptr);
    };
    if constexpr (decltype(sm)::value == kState8)
      run(Width<7>(), {grads, params, exp_avgs, exp_avg_sqs, o, scale_list(state_scales, 0, params.size(), params),
                       scale_list(state_scales, 1, params.size(), params)});
    else run(Width<5>(), {grads, params, exp_avgs, exp_avg_sqs, o});
  });
}

}  // namespace mixedprec
