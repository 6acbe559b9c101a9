// Portable conversions between the 16-bit storage types and float.
//
// The CPU handlers use these; the CUDA kernels use the hardware conversions of
// <cuda_bf16.h>/<cuda_fp16.h>, which round the same way (to nearest, ties to even), so
// both backends store the same bits for the same fp32 value.
#pragma once

#include <cstdint>
#include <cstring>

#include "jaxfuse/platform.h"

namespace jaxfuse {

// Raw 16-bit storage; the meaning (bf16 or f16) is carried by the load/store function.
struct bfloat16_bits { uint16_t bits; };
struct float16_bits { uint16_t bits; };

JAXFUSE_HOST_DEVICE uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

JAXFUSE_HOST_DEVICE float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

JAXFUSE_HOST_DEVICE float ToFloat(float value) { return value; }

JAXFUSE_HOST_DEVICE float ToFloat(bfloat16_bits value) {
  return BitsToFloat(static_cast<uint32_t>(value.bits) << 16);
}

JAXFUSE_HOST_DEVICE float ToFloat(float16_bits value) {
  const uint32_t sign = static_cast<uint32_t>(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> bfloat16, round to nearest even; NaN stays NaN (quiet).
JAXFUSE_HOST_DEVICE bfloat16_bits ToBFloat16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((bits >> 16) | 0x40u)};
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<uint16_t>((bits + rounding_bias) >> 16)};
}

// float -> IEEE half, round to nearest even, overflow to inf, NaN stays NaN.
JAXFUSE_HOST_DEVICE float16_bits ToFloat16(float value) {
  uint32_t bits = FloatBits(value);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t half;
  if (bits >= (143u << 23)) {             // >= 65536: inf, or NaN
    half = bits > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (bits < (113u << 23)) {       // below the smallest normal half: subnormal or 0
    // Adding 0.5 lets the FPU's own round-to-nearest-even place the mantissa bits.
    const float shifted = BitsToFloat(bits) + 0.5f;
    half = FloatBits(shifted) - FloatBits(0.5f);
  } else {
    const uint32_t mantissa_odd = (bits >> 13) & 1u;
    bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    half = bits >> 13;
  }
  return {static_cast<uint16_t>(half | (sign >> 16))};
}

// Store helpers chosen by the storage type.
template <typename T> struct Storage;
template <> struct Storage<float> {
  JAXFUSE_HOST_DEVICE static float Store(float value) { return value; }
};
template <> struct Storage<bfloat16_bits> {
  JAXFUSE_HOST_DEVICE static bfloat16_bits Store(float value) { return ToBFloat16(value); }
};
template <> struct Storage<float16_bits> {
  JAXFUSE_HOST_DEVICE static float16_bits Store(float value) { return ToFloat16(value); }
};

template <typename T>
JAXFUSE_HOST_DEVICE T FromFloat(float value) { return Storage<T>::Store(value); }

}  // namespace jaxfuse
