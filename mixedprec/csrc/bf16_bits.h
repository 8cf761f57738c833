// bf16 masters without an fp32 copy, element by element, for the CPU and CUDA kernels alike. The pure-PyTorch
// references (mixedprec/ops.py: split_bf16_ref, join_bf16_ref, round_stochastic_ref) compute the same bits.
//
// Split ("16+16"): an fp32 master x is kept as a bf16 `hi` (the model's weight) and an int16 `lo` with
//   bits(x) == (hi << 16) + lo  (mod 2^32),
// where hi is x rounded to the nearest bf16, ties away from zero, so that lo = bits(x) - (hi << 16) lies in
// [-0x8000, 0x7fff]. The master is exact; the weight is within half a bf16 ulp of it (torch's .to(bfloat16) rounds ties to
// even instead: the two differ only when the low 16 bits of x are exactly 0x8000).
//
// Stochastic rounding: x is rounded up in magnitude with probability (low 16 bits of x) / 2^16, else truncated, using 16
// random bits that depend only on (seed, element index): reproducible, independent of threads and chunking, and unbiased.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MIXEDPREC_HD __host__ __device__ __forceinline__
#else
#define MIXEDPREC_HD inline
#endif

namespace mixedprec {

MIXEDPREC_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u; std::memcpy(&u, &x, 4); return u;
#endif
}

MIXEDPREC_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x; std::memcpy(&x, &u, 4); return x;
#endif
}

// The exact fp32 master from its bf16 high half (as raw bits) and its int16 low half.
MIXEDPREC_HD float join_bf16(uint16_t hi, int16_t lo) {
  return bits_float(((uint32_t)hi << 16) + (uint32_t)(int32_t)lo);
}

// Split an fp32 master into its nearest bf16 (ties away from zero; raw bits) and the signed remainder.
MIXEDPREC_HD void split_bf16(float x, uint16_t& hi, int16_t& lo) {
  const uint32_t u = float_bits(x);
  const uint32_t h = (u + 0x8000u) >> 16;
  hi = (uint16_t)h;
  lo = (int16_t)(int32_t)(u - (h << 16));
}

// 16 random bits from the low half of an element's index and a 64-bit key (the seed's low half, and its high half xor
// the index's): a Weyl step, then a multiply-xorshift mix whose high bits depend on every bit below them. Two multiplies
// in all, so the step costs what an fp32-master step costs; 32-bit lanes, so the CPU loop vectorises.
MIXEDPREC_HD uint32_t rounding_bits32(uint32_t index_lo, uint32_t key_lo, uint32_t key_hi) {
  uint32_t x = (index_lo ^ key_lo) * 0x9e3779b9u + key_hi;
  x ^= x >> 15; x *= 0x2c1b3c6du;
  return x >> 16;
}

// 16 random bits for element `index` of a tensor whose rounding seed is `seed`.
MIXEDPREC_HD uint32_t rounding_bits(uint64_t seed, uint64_t index) {
  return rounding_bits32((uint32_t)index, (uint32_t)seed, (uint32_t)(seed >> 32) ^ (uint32_t)(index >> 32));
}

// x rounded to bf16 (raw bits) stochastically with the 16 random bits `r`; inf stays inf and NaN stays NaN (no branch).
MIXEDPREC_HD uint16_t round_stochastic(float x, uint32_t r) {
  const uint32_t u = float_bits(x);
  const bool special = (u & 0x7f800000u) == 0x7f800000u;
  const uint32_t kept = (u >> 16) | ((u & 0x007fffffu) ? 0x0040u : 0u);
  return (uint16_t)(special ? kept : (u + r) >> 16);
}

}  // namespace mixedprec
