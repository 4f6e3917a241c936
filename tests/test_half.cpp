// fp16 / bf16 host conversions (core/half.h).
#include "core/half.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace fasttree {
namespace {

bool is_half_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// Every one of the 65536 half bit patterns survives half -> float -> half unchanged (NaNs stay NaN
// with their sign and payload; the quiet bit is forced on).
TEST(Half, ExhaustiveRoundTrip) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = half_to_float(h);
    const uint16_t back = float_to_half(f);
    if (is_half_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << i;
      ASSERT_EQ(back, h | 0x200u) << std::hex << i;
    } else {
      ASSERT_EQ(back, h) << std::hex << i << " -> " << f;
    }
  }
}

TEST(Half, KnownValues) {
  EXPECT_EQ(float_to_half(0.0f), 0x0000);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(0.5f), 0x3800);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1023.0f, -24)), 0x03ff);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(float_to_half(1e10f), 0x7c00);
  EXPECT_EQ(float_to_half(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_half(1e-10f), 0x0000);
  EXPECT_EQ(float_to_half(-1e-10f), 0x8000);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_TRUE(is_half_nan(float_to_half(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_half_nan(float_to_half(-std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN whose payload lives only in the low mantissa bits must not become inf.
  EXPECT_TRUE(is_half_nan(float_to_half(std::bit_cast<float>(0x7f800001u))));
  EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);
  EXPECT_EQ(half_to_float(0x8001), -std::ldexp(1.0f, -24));
  static_assert(float_to_half(1.0f) == 0x3c00 && half_to_float(0x3c00) == 1.0f);
}

// Midpoints between consecutive finite halves round to the even neighbour; a hair either side goes
// to the nearer one. Covers subnormals, the subnormal/normal boundary and the overflow threshold.
TEST(Half, RoundingTies) {
  for (uint32_t i = 0; i < 0x7c00u; ++i) {
    const uint16_t lo = static_cast<uint16_t>(i);
    const uint16_t hi = static_cast<uint16_t>(i + 1);  // 0x7c00 (inf) for the last finite value
    const double a = half_to_float(lo);
    const double b = hi == 0x7c00u ? 65536.0 : static_cast<double>(half_to_float(hi));
    const float mid = static_cast<float>((a + b) / 2);  // exact in fp32
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
    const uint16_t even = (lo & 1u) ? hi : lo;
    ASSERT_EQ(float_to_half(mid), even) << std::hex << i;
    ASSERT_EQ(float_to_half(-mid), even | 0x8000u) << std::hex << i;
    ASSERT_EQ(float_to_half(std::nextafter(mid, 0.0f)), lo) << std::hex << i;
    ASSERT_EQ(float_to_half(std::nextafter(mid, 1e30f)), hi) << std::hex << i;
  }
  EXPECT_EQ(float_to_half(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24 -> 0
  EXPECT_EQ(float_to_half(std::ldexp(3.0f, -25)), 0x0002);  // tie between 1 and 2 ulps -> 2
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);       // tie -> even 1.0
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);   // tie -> even
}

#ifdef __FLT16_MAX__
// Compare with the compiler's own IEEE conversion on random bit patterns of every magnitude.
TEST(Half, MatchesCompilerFloat16) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 2000000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    const _Float16 ref = static_cast<_Float16>(f);
    ASSERT_EQ(float_to_half(f), std::bit_cast<uint16_t>(ref)) << f;
  }
}
#endif

TEST(Half, Bf16RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  // 1 + 2^-8 is halfway between 1.0 (0x3f80, even) and 1 + 2^-7 (0x3f81): ties to even.
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // odd lower -> up
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f807fffu)), 0x3f80);  // below the tie
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // NaN stays NaN, including a payload only in the low 16 bits (plain rounding would give inf).
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t b = float_to_bf16(std::bit_cast<float>(bits));
    EXPECT_TRUE(std::isnan(bf16_to_float(b))) << std::hex << bits;
    EXPECT_EQ(b >> 15, bits >> 31);
  }
  // Subnormals round like normals.
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00008000u)), 0x0000);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00018000u)), 0x0002);
}

TEST(Half, Bf16ExhaustiveRoundTripAndNearest) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float f = bf16_to_float(b);
    ASSERT_EQ(std::bit_cast<uint32_t>(f), i << 16);
    if (std::isnan(f)) ASSERT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
    else ASSERT_EQ(float_to_bf16(f), b) << std::hex << i;
  }
  // Random floats: the result is one of the two neighbours and the nearer one.
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float f = std::bit_cast<float>(bits);
    if (!std::isfinite(f)) continue;
    const uint16_t b = float_to_bf16(f);
    const uint16_t down = static_cast<uint16_t>(bits >> 16);
    const uint32_t low = bits & 0xffffu;
    const uint16_t expect = low < 0x8000u ? down : low > 0x8000u ? down + 1 : (down & 1u ? down + 1 : down);
    ASSERT_EQ(b, expect) << std::hex << bits;
  }
}

}  // namespace
}  // namespace fasttree
