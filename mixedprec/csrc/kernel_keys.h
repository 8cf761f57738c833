// The contract between the host's dispatch (kernel_dispatch.h, compiled by g++ into the extension) and the CUDA kernels
// that nvcc builds apart from it: core_kernels.cu (the unscale and the L2 norms, built with the extension) and
// step_kernel.cu (one fused step kernel per module, built the first time a run asks for it, so that a first use compiles
// the one or two step kernels it needs, not all 144). Each functor has a key naming it (kKey: its kind and template
// arguments), the table it reads (Table) and its launch's argument types (Args). A launch function of a kernel module
// takes exactly (table, blocks, noop, stream, Args...); the host checks at compile time that what it passes is Args, and
// that a step key decodes to the very functor it dispatched (optim_kernels.h's StepFunctorOf), so no pointer is ever
// called with another functor's arguments. ATen-free: nvcc compiles the kernel units without ATen's headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace mixedprec {

template <typename T> struct DtypeCode;
template <> struct DtypeCode<float> { static constexpr uint32_t value = 0; };
template <> struct DtypeCode<double> { static constexpr uint32_t value = 1; };
template <> struct DtypeCode<c10::Half> { static constexpr uint32_t value = 2; };
template <> struct DtypeCode<c10::BFloat16> { static constexpr uint32_t value = 3; };
constexpr uint32_t kDtypeCodes = 4;
template <uint32_t Code>
using DtypeOf = std::conditional_t<Code == 0, float, std::conditional_t<Code == 1, double,
                                   std::conditional_t<Code == 2, c10::Half, c10::BFloat16>>>;

enum KernelKind : uint32_t { kScaleKernel = 1, kScaleAddKernel = 2, kSquareSumKernel = 3, kSgdKernel = 4, kAdamKernel = 5 };

// kind, two element types (dtype codes), a master mode and a state mode, four bits each under the kind
constexpr uint32_t kernel_key(uint32_t kind, uint32_t a, uint32_t b = 0, uint32_t mode = 0, uint32_t smode = 0) {
  return kind << 16 | a << 12 | b << 8 | mode << 4 | smode;
}
constexpr uint32_t key_kind(uint32_t key) { return key >> 16; }
constexpr uint32_t key_a(uint32_t key) { return key >> 12 & 15; }
constexpr uint32_t key_b(uint32_t key) { return key >> 8 & 15; }
constexpr uint32_t key_mode(uint32_t key) { return key >> 4 & 15; }
constexpr uint32_t key_smode(uint32_t key) { return key & 15; }

template <typename... A> struct ArgList {};

// A functor that is launched as a block sum (partial, then finish) says so with kBlockSum.
template <typename F, typename = void> struct is_block_sum : std::false_type {};
template <typename F>
struct is_block_sum<F, std::void_t<decltype(F::kBlockSum)>> : std::integral_constant<bool, F::kBlockSum> {};

// The launch function of functor F's kernel: the error text of a failed launch, or null.
template <typename F, typename L = typename F::Args> struct LaunchOf;
template <typename F, typename... A> struct LaunchOf<F, ArgList<A...>> {
  using type = const char* (*)(const typename F::Table&, int blocks, const int* noop, void* stream, A...);
};

// What a kernel module holds: its kernels' keys and launch functions.
struct KernelEntry { uint32_t key; void* launch; };
struct KernelList { const KernelEntry* entries; size_t count; };
constexpr const char* kKernelListCapsule = "mixedprec.KernelList";

}  // namespace mixedprec
