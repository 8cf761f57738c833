// The multi-tensor machinery of the CUDA kernels, written once for two compilers. nvcc compiles it into the GPU kernels
// (cuda_launch.cuh launches them); the host compiler compiles the very same functors and launch planning into the
// CPU emulation of the tests (tests/csrc/cuda_emulator.cpp), which runs every block and thread of a launch in a loop, so
// that the CUDA kernels' indexing and arithmetic are checked against the pure-PyTorch references on machines without a
// GPU. Only the launch itself, the shared-memory block sum and the intrinsics behind the arithmetic helpers differ.
// This header is the device side and includes no ATen header, so that nvcc compiles a kernel unit in seconds; the
// host's planning of launches over ATen tensors is in multi_tensor_plan.h.
//
// A launch works on a table, passed by value as the kernel argument (it must stay under the 4 KB kernel-argument limit):
// the addresses of up to kMaxTensors tensors of each list (and, for ops that need one, of a per-tensor fp32 scalar such
// as Adam's step count), and for each tensor the index of its first block: a tensor's chunks are consecutive blocks, so
// a launch has as many blocks as its tensors have chunks, with no cap, and a block finds its tensor by a binary search
// over those first blocks. The host starts a new table when the tensors fill one. A launch therefore fills the GPU
// whatever the tensors' sizes (100M params in 25 tensors are one launch of 1526 blocks), where a table of one entry
// per block (apex's design, and ours before) capped a launch at a few hundred blocks: 60% of an H200's threads, and a
// tail per launch.
// Within a chunk, a block's threads take packs of kPack consecutive elements, one vector access per list each, where
// every list's address is aligned alike for it (pack_head); the ragged ends, and lists aligned differently (views into
// flat buffers at other offsets), go element by element. The emulation's pack accesses check their alignment, which a
// CPU would not, so a pack that the GPU would fault on fails the tests here.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include "bf16_bits.h"

#ifdef __CUDACC__
#define MIXEDPREC_UNROLL _Pragma("unroll")
#else
#define MIXEDPREC_UNROLL
#endif
#ifndef MIXEDPREC_COUNT_ACCESS                 // the emulation counts pack and element accesses (tests only)
#define MIXEDPREC_COUNT_ACCESS(width)
#endif

namespace mixedprec {

constexpr int kBlockSize = 512;                // threads per block on the GPU
constexpr int64_t kCudaChunk = 2048 * 32;      // elements per block
constexpr int kPack = 4;                       // elements per vector access: 16 bytes of fp32, 8 of a half type
static_assert(kCudaChunk % kPack == 0, "a chunk must hold whole packs, so that every chunk starts aligned as its tensor does");
// Tensors per table for list depth 1..7, so that the table stays under the kernel-argument limit.
constexpr int kMaxTensorsFor[8] = {0, 160, 96, 72, 56, 48, 40, 36};

template <int Depth, bool WithScalar = false> struct TensorTable {
  static constexpr int kMaxTensors = kMaxTensorsFor[Depth];
  void* addr[Depth][kMaxTensors];
  float* scalar[WithScalar ? kMaxTensors : 1];   // a per-tensor scalar in device memory (WithScalar only)
  int64_t numel[kMaxTensors];
  int global_index[kMaxTensors];            // index of the tensor in the caller's lists (for per-tensor outputs)
  int first_block[kMaxTensors];             // the first block of each slot's tensor (its chunks follow it)
  int slots;                                // slots in use
};

// One thread of a launch: its block, its index in the block, and the block's size.
struct Lane { int block, thread, threads; };

// The table slot of block `block`: the last slot whose first block is at or before it (a binary search).
template <typename Table> MIXEDPREC_HD int slot_of(const Table& t, int block) {
  int lo = 0, hi = t.slots - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The table slot a block works on, and the element range [begin, end) of its chunk.
template <typename Table>
MIXEDPREC_HD int block_range(const Table& t, const Lane& lane, int64_t chunk, int64_t& begin, int64_t& end) {
  const int slot = slot_of(t, lane.block);
  begin = (int64_t)(lane.block - t.first_block[slot]) * chunk;
  end = t.numel[slot] < begin + chunk ? t.numel[slot] : begin + chunk;
  return slot;
}

// fp32 arithmetic rounded once per operation, as the references round it: no fused multiply-add (nvcc's intrinsics on
// the GPU; the emulation is compiled with -ffp-contract=off), and a correctly rounded division and square root.
MIXEDPREC_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MIXEDPREC_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MIXEDPREC_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MIXEDPREC_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MIXEDPREC_HD float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MIXEDPREC_HD bool finite(float x) {
#ifdef __CUDA_ARCH__
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}
template <typename T> MIXEDPREC_HD float to_float(T x) { return static_cast<float>(x); }

// kPack elements of one list, laid out for a single vector access.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

MIXEDPREC_HD void check_pack_aligned(const void* p, size_t bytes) {
#ifndef __CUDA_ARCH__                          // the emulation: a GPU would fault on this access, a CPU would not
  if (reinterpret_cast<uintptr_t>(p) % bytes)
    throw std::logic_error("mixedprec: a " + std::to_string(bytes) + "-byte pack access at a misaligned address (the GPU would fault here)");
#endif
}

// Elements i..i+N-1 of `p` into `out`: one vector access for a pack (N == kPack, `p + i` aligned for it), else one load.
template <int N, typename T> MIXEDPREC_HD void load(const T* p, int64_t i, T (&out)[N]) {
  MIXEDPREC_COUNT_ACCESS(N);
  if constexpr (N == 1) out[0] = p[i];
  else {
    check_pack_aligned(p + i, sizeof(Pack<T, N>));
    const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p + i);
    MIXEDPREC_UNROLL for (int j = 0; j < N; ++j) out[j] = pk.v[j];
  }
}

template <int N, typename T> MIXEDPREC_HD void store(T* p, int64_t i, const T (&in)[N]) {
  MIXEDPREC_COUNT_ACCESS(N);
  if constexpr (N == 1) p[i] = in[0];
  else {
    check_pack_aligned(p + i, sizeof(Pack<T, N>));
    Pack<T, N> pk;
    MIXEDPREC_UNROLL for (int j = 0; j < N; ++j) pk.v[j] = in[j];
    *reinterpret_cast<Pack<T, N>*>(p + i) = pk;
  }
}

// Where a list's packs start: the elements before its first address aligned for a pack (0..kPack-1), -1 if no element
// is (an address that is not a multiple of the element size), and kAnyHead for an unused list (a null pointer).
constexpr int kAnyHead = -2;
template <typename T> MIXEDPREC_HD int list_head(const T* p) {
  if (p == nullptr) return kAnyHead;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(T)) return -1;
  return (int)((kPack - (a / sizeof(T)) % kPack) % kPack);
}
MIXEDPREC_HD int common_head(int a, int b) { return a == kAnyHead ? b : b == kAnyHead ? a : a == b ? a : -1; }

// The elements before the first index at which every list can be read in packs, or -1 when no index suits them all.
template <typename... T> MIXEDPREC_HD int pack_head(const T*... lists) {
  int head = kAnyHead;
  ((head = common_head(head, list_head(lists))), ...);
  return head == kAnyHead ? 0 : head;
}

template <int N> using Width = std::integral_constant<int, N>;

// The elements [begin, end) of one chunk, shared among a block's threads: body(Width<kPack>(), i) for each aligned pack
// i..i+kPack-1, body(Width<1>(), i) for the elements before the first pack and after the last (all of them when
// head < 0). A chunk starts at a multiple of kPack, so `head`, counted from the tensor's start, holds for every chunk.
template <typename Body>
MIXEDPREC_HD void walk(const Lane& lane, int64_t begin, int64_t end, int head, Body&& body) {
  const int64_t first = head < 0 ? end : (begin + head < end ? begin + head : end);
  const int64_t packs = (end - first) / kPack;
  const int64_t rest = first + packs * kPack;
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
  for (int64_t k = lane.thread; k < packs; k += lane.threads) body(Width<kPack>(), first + k * kPack);  // unrolled
  for (int64_t i = begin + lane.thread; i < first; i += lane.threads) body(Width<1>(), i);
  for (int64_t i = rest + lane.thread; i < end; i += lane.threads) body(Width<1>(), i);
}

// Warps. On the GPU a warp's 32 lanes are 32 calls of a functor that run in lock-step, and warp_max combines their
// values by shuffles. The emulation runs a functor that says it is warp-wide (kWarpWide) once per warp, and that call
// does the work of all kLanesPerCall = 32 lanes, phase by phase, with a loop in place of the shuffles.
constexpr int kWarp = 32;
#ifdef __CUDA_ARCH__
constexpr int kLanesPerCall = 1;
#else
constexpr int kLanesPerCall = kWarp;
#endif
constexpr int kQPerLane = 8;                   // 8-bit state: elements of a 256-element quantisation block per lane

template <typename F, typename = void> struct is_warp_wide : std::false_type {};
template <typename F>
struct is_warp_wide<F, std::void_t<decltype(F::kWarpWide)>> : std::integral_constant<bool, F::kWarpWide> {};

// The largest of each list's values over a warp's lanes (v[lane in the call][list]), given to every lane.
template <int N> MIXEDPREC_HD void warp_max(uint32_t (&v)[kLanesPerCall][N]) {
#ifdef __CUDA_ARCH__
  MIXEDPREC_UNROLL for (int k = 0; k < N; ++k)
    MIXEDPREC_UNROLL for (int o = kWarp / 2; o > 0; o >>= 1)
      v[0][k] = max(v[0][k], __shfl_xor_sync(0xffffffffu, v[0][k], o));
#else
  for (int k = 0; k < N; ++k) {
    uint32_t m = 0;
    for (int c = 0; c < kLanesPerCall; ++c) m = m > v[c][k] ? m : v[c][k];
    for (int c = 0; c < kLanesPerCall; ++c) v[c][k] = m;
  }
#endif
}

MIXEDPREC_HD void atomic_add(double* p, double x) {
#ifdef __CUDA_ARCH__
  atomicAdd(p, x);
#else
  *p += x;                                     // the emulation runs one thread at a time
#endif
}

}  // namespace mixedprec
