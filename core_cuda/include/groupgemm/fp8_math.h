// The float8 arithmetic of the core, exactly: encoding a float32 as e4m3 / e5m2 (round
// to nearest even, saturating to the largest finite value), decoding, and a block's scale
// from its amax. __host__ __device__, so the CPU backend, the CUDA quantization kernels
// and the tests compute the same bits (no fast-math: every step is an exact or correctly
// rounded IEEE operation).
#pragma once

#include <cstdint>
#include <cstring>

#include "groupgemm/fp8.h"
#include "groupgemm/schedule.h"

namespace groupgemm {

struct Fp8Format {
  int bias;           // exponent bias
  int mantissa_bits;  // explicit mantissa bits
  uint8_t max_bits;   // the largest finite value's bits (sign clear)
  float max_value;    // that value
};

// fp8.h's row of the format.
GG_HD Fp8Format fp8_format(Fp8Type t) {
  Fp8Format f{};
  switch (t) {
#define GG_FP8_FORMAT(id, name, bias, mantissa, max_value, max_bits) \
  case Fp8Type::id: f = Fp8Format{bias, mantissa, max_bits, max_value}; break;
    GROUPGEMM_FP8_TYPES(GG_FP8_FORMAT)
#undef GG_FP8_FORMAT
  }
  return f;
}

GG_HD uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

GG_HD float bits_float(uint32_t u) {
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

// Round half to even of a non-negative float below 2^23: adding 2^23 rounds it to an
// integer in the (default, nearest-even) rounding mode, and subtracting it back is exact.
// Without fast-math no compiler folds the two additions.
GG_HD float round_half_even(float v) {
  const float two23 = 8388608.0f;
  return (v + two23) - two23;
}

// float32 -> float8 bits: nearest even; beyond the largest finite value (infinities
// included) saturates to it, as CUDA's __NV_SATFINITE conversions do; NaN -> 0x7f.
GG_HD uint8_t float_to_fp8(float x, Fp8Type t) {
  const Fp8Format f = fp8_format(t);
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float a = bits_float(magnitude);
  const float min_normal = bits_float(static_cast<uint32_t>(128 - f.bias) << 23);  // 2^(1 - bias)
  uint32_t bits;
  if (a < min_normal) {
    // Subnormal or zero: a / 2^(1 - bias - mantissa_bits) is exact and below 2^mantissa_bits,
    // and its rounding carries into the smallest normal's encoding by itself.
    const float unit_inverse = bits_float(static_cast<uint32_t>(127 + f.bias - 1 + f.mantissa_bits) << 23);
    bits = static_cast<uint32_t>(round_half_even(a * unit_inverse));
  } else {
    // Normal: round float32's 23 mantissa bits to mantissa_bits, nearest even (a carry
    // moves into the exponent), then rebias the exponent.
    const int shift = 23 - f.mantissa_bits;
    const uint32_t rounded = (magnitude + ((1u << (shift - 1)) - 1u) + ((magnitude >> shift) & 1u)) >> shift;
    const uint32_t exponent = (rounded >> f.mantissa_bits) - 127u + static_cast<uint32_t>(f.bias);
    bits = (exponent << f.mantissa_bits) | (rounded & ((1u << f.mantissa_bits) - 1u));
  }
  if (bits > f.max_bits) bits = f.max_bits;
  return static_cast<uint8_t>(sign | bits);
}

// float8 bits -> float32 (exact).
GG_HD float fp8_to_float(uint8_t b, Fp8Type t) {
  const Fp8Format f = fp8_format(t);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b & 0x7fu) >> f.mantissa_bits;
  const uint32_t mantissa = b & ((1u << f.mantissa_bits) - 1u);
  const uint32_t all_ones = (1u << (7 - f.mantissa_bits)) - 1u;
  // e4m3fn has no infinity and one NaN (S.1111.111); e5m2 is IEEE-like (S.11111.00 is infinity).
  const bool special = exponent == all_ones && (t == Fp8Type::e5m2 || mantissa == 7u);
  if (special) {
    const bool inf = t == Fp8Type::e5m2 && mantissa == 0u;
    return bits_float(sign | (inf ? 0x7f800000u : 0x7fc00000u));
  }
  if (exponent == 0) {  // subnormal: mantissa * 2^(1 - bias - mantissa_bits), exact
    const float unit = bits_float(static_cast<uint32_t>(127 + 1 - f.bias - f.mantissa_bits) << 23);
    return bits_float(sign | float_bits(static_cast<float>(mantissa) * unit));
  }
  return bits_float(sign | ((exponent - static_cast<uint32_t>(f.bias) + 127u) << 23) |
                    (mantissa << (23 - f.mantissa_bits)));
}

// max(a, |v|), a NaN (of one bit pattern) once any is seen: associative and commutative,
// so any reduction order (one CPU loop, a GPU tree) gives the same amax bits.
GG_HD float amax_step(float a, float v) {
  const float m = bits_float(float_bits(v) & 0x7fffffffu);
  if (a != a || m != m) return bits_float(0x7fc00000u);
  return m > a ? m : a;
}

// A block's scale from its amax: amax / max_finite, at least 2^-126 (the smallest normal
// float32, so q = x / scale cannot overflow into infinity), rounded up to a power of two
// when power_of_two (then x / scale is an exact scaling). An all-zero block gets 1; a
// NaN or infinite amax gives a NaN or infinite scale (its q values are NaN or 0).
GG_HD float fp8_scale(float amax, Fp8Type t, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;
  if (!(amax <= 3.4028234663852886e38f)) return amax;  // NaN or infinity
  float s = amax / fp8_format(t).max_value;
  const float min_normal = bits_float(0x00800000u);
  if (s < min_normal) s = min_normal;
  if (power_of_two) {
    const uint32_t u = float_bits(s);
    if (u & 0x007fffffu) s = bits_float((u & 0xff800000u) + 0x00800000u);
  }
  return s;
}

// q = x / scale as float8 bits.
GG_HD uint8_t quantize_value(float x, float scale, Fp8Type t) { return float_to_fp8(x / scale, t); }

}  // namespace groupgemm
