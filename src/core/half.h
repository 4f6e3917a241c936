// Host-side conversions between fp32 and the 16-bit float formats used for Q/K/V.
//   fp16 (IEEE binary16): 1 sign, 5 exponent (bias 15), 10 mantissa bits; subnormals down to 2^-24.
//   bf16: the upper 16 bits of an fp32 (1 sign, 8 exponent, 7 mantissa bits).
// float -> 16 bit rounds to nearest, ties to even; overflow gives +-inf; NaN stays NaN (quiet, sign and
// top payload bits kept). 16 bit -> float is exact.
#pragma once
#include <bit>
#include <cstdint>

namespace fasttree {

constexpr uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN
    if (ax == 0x7f800000u) return sign | 0x7c00u;
    const uint16_t payload = static_cast<uint16_t>((ax >> 13) & 0x3ffu);
    return sign | 0x7e00u | payload;  // quiet bit set, so the result is never inf
  }
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520: rounds (ties to even) to inf
  if (ax < 0x38800000u) {                        // below 2^-14: half subnormal or zero
    if (ax <= 0x33000000u) return sign;          // <= 2^-25 (the tie rounds to even 0)
    const uint32_t exp = ax >> 23;               // 102..112 here
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // result in units of 2^-24: mant * 2^(exp - 150 + 24)
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // may carry into the smallest normal
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t h = (ax >> 13) - (112u << 10);  // rebias exponent 127 -> 15
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
  return sign | static_cast<uint16_t>(h);
}

constexpr float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

constexpr uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t lsb = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + lsb) >> 16);
}

constexpr float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

}  // namespace fasttree
