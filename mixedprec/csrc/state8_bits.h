// 8-bit optimizer state (state='8bit'), element by element, for the CPU and CUDA kernels alike. The pure-PyTorch
// references (mixedprec/ops.py: quantize8_ref, dequantize8_ref) compute the same bits.
//
// A state tensor is kept as one 8-bit code per element, laid out as its param (int8 for a signed code, uint8 for an
// unsigned one, so that a tensor says how to read it), and one fp32 scale per block of kQBlock
// elements (in memory order from the tensor's start). The scale is a power of two, 2^(e+1) where 2^e <= the block's
// largest magnitude < 2^(e+1), so every element of the block divided by it lies in (-1, 1) and the division is exact.
// The code is a small float relative to the scale, with 3 mantissa bits and gradual underflow:
//   signed (first moments, momentum): sign, 4 exponent bits, 3 mantissa bits: magnitudes 2^-17 .. 1 of the scale;
//   unsigned (Adam's second moment):  5 exponent bits, 3 mantissa bits: magnitudes 2^-33 .. 1 of the scale.
// Encoding works on the fp32 bits, with integers only (so every implementation gets the same bits): the magnitude is
// laid out as an fp32-like number with the code's exponent bias, and 16 random bits (bf16_bits.h's rounding_bits, from
// the element's index and the list's seed) are added below the 3 kept mantissa bits before truncating: stochastic
// rounding, unbiased to within 2^-16 of a code step, so that Adam's small per-step changes (0.1% of v at beta2=0.999,
// far below a code step) accumulate in expectation instead of stagnating. A positive second moment never encodes to 0
// (it rounds up to the smallest code instead), so a quantised denominator never undercuts the true one down to eps.
// A block whose largest magnitude is below 2^-80 is all zeros (scale 0); a block holding inf or NaN gets a NaN scale, so
// a diverged state stays loud. Decoding is exact: a code's value times a power of two, both exact in fp32.
#pragma once
#include "bf16_bits.h"

namespace mixedprec {

constexpr int64_t kQBlock = 256;               // elements per scale
constexpr uint32_t kQ8SmallestExp = 127 - 80;  // biased exponent below which a block's largest magnitude counts as zero

MIXEDPREC_HD int q8_bias(bool is_signed) { return is_signed ? 15 : 31; }

// The scale of a block from its largest magnitude's bits (max over the block of bits & 0x7fffffff).
MIXEDPREC_HD float q8_scale(uint32_t max_bits) {
  const uint32_t e = max_bits >> 23;
  if (e < kQ8SmallestExp) return 0.f;
  if (e >= 254) return bits_float(0x7fc00000u);  // inf or NaN (or a magnitude whose scale would overflow): NaN
  return bits_float((e + 1) << 23);
}

// The code of x (in the low 8 bits) in a block whose scale is finite and not zero, with exponent field `se` (>= 48, as
// q8_scale gives), rounded stochastically with the 16 random bits r. Written without branches (every case computed,
// then selected), so that the CPU's loops over a block vectorise. A code's exponent field f >= 1 is the magnitude's bits
// with the exponent lowered by se - bias; below, the fraction with its leading one shifted right (gradual underflow).
// An fp32 zero or subnormal x codes to 0 in both (its f is below -31), so an unsigned code needs only c == 0 raised to 1.
// (The same codes as the field-by-field form for every fp32 x below the scale, at ten scales, in a one-off check;
// tests/test_state8.py holds the kernels to the reference at every magnitude.)
MIXEDPREC_HD uint32_t q8_code(float x, uint32_t se, uint32_t r, bool is_signed) {
  const uint32_t u = float_bits(x), mag = u & 0x7fffffffu, ex = mag >> 23, bias = (uint32_t)q8_bias(is_signed);
  const int32_t f = (int32_t)ex - (int32_t)se + (int32_t)bias;          // the code's exponent field
  const uint32_t below = 1u - (uint32_t)f < 31u ? 1u - (uint32_t)f : 31u;   // f < 1: the shift (f >= 1: unused)
  const uint32_t t = f >= 1 ? mag - ((se - bias) << 23) : ((mag & 0x7fffffu) | 0x800000u) >> below;
  const uint32_t c = (t + (r << 4)) >> 20;
  if (is_signed) return ex != 0 ? c | ((u >> 24) & 0x80u) : 0u;
  return mag != 0 ? (c > 1u ? c : 1u) : 0u;                              // a positive second moment stays positive
}

// Whether a block of scale exponent field `se` holds codes: not a zero block (scale 0) or a diverged one (NaN).
MIXEDPREC_HD bool q8_coded(uint32_t se) { return se != 0 && se != 255; }

// The code of x in a block with scale `scale`, rounded stochastically with the 16 random bits r.
MIXEDPREC_HD uint8_t q8_encode(float x, float scale, uint32_t r, bool is_signed) {
  const uint32_t se = float_bits(scale) >> 23;
  return (uint8_t)(q8_coded(se) ? q8_code(x, se, r, is_signed) : 0u);
}

// The value of code `c` in a block with scale `scale` (exact): a code whose exponent field is 1 or more is an fp32
// number once its exponent is raised by 127 - bias; field 0 is its mantissa times the smallest step. (The same values
// as the field-by-field form for every code at every scale, in a one-off check.)
MIXEDPREC_HD float q8_decode(uint8_t code, float scale, bool is_signed) {
  const uint32_t c = is_signed ? code & 0x7fu : code, bias = (uint32_t)q8_bias(is_signed);
  const uint32_t normal = (c << 20) + ((127u - bias) << 23);
  const uint32_t small = float_bits((float)(c & 7u) * bits_float((127u - 2u - bias) << 23));
  const uint32_t is_normal = 0u - (uint32_t)(c >= 8u);                 // all ones or zero: a select without a branch
  const float v = bits_float((normal & is_normal) | (small & ~is_normal)) * scale;
  return bits_float(float_bits(v) ^ (is_signed ? ((uint32_t)code & 0x80u) << 24 : 0u));   // the sign, without a branch
}

}  // namespace mixedprec
