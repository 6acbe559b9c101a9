// FP8 (OCP E4M3FN and E5M2) and E8M0 conversions and the scale rules of the recipes, as
// both backends see them.
//
// FloatToFp8 rounds to nearest, ties to even, saturates finite overflow and infinities to
// the largest finite value (the "satfinite" mode of cuda_fp8.h's __nv_cvt_float2_to_fp8x2,
// which the CUDA kernels use and which gives identical bits), and keeps NaN a NaN. It is
// the same as the jnp reference's clip(v, -max, max).astype(float8_*).
#pragma once

#include <cstdint>

#include "jaxfuse/numeric.h"
#include "jaxfuse/platform.h"

namespace jaxfuse {

enum class Fp8Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

// Largest finite values: E4M3FN 1.75 * 2^8, E5M2 1.75 * 2^15.
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

JAXFUSE_HOST_DEVICE float Fp8Max(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max;
}

// float -> fp8 bits. M mantissa bits, exponent bias B, largest finite code kMaxCode.
template <int M, int B, uint32_t kMaxCode, uint32_t kNaN>
JAXFUSE_HOST_DEVICE uint8_t FloatToFp8Bits(float value) {
  const uint32_t bits = FloatBits(value);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | kNaN);
  // Smallest normal of the format: 2^(1 - B).
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - B) << 23;
  uint32_t code;
  if (magnitude >= kMinNormalBits) {
    constexpr int kShift = 23 - M;
    // Round to nearest even on the dropped mantissa bits (a carry may bump the exponent,
    // which is the correct rounded result), then re-bias the exponent.
    const uint32_t rounded = magnitude + ((1u << (kShift - 1)) - 1u) + ((magnitude >> kShift) & 1u);
    const uint32_t shifted = rounded >> kShift;
    constexpr uint32_t kRebias = static_cast<uint32_t>(127 - B) << M;
    code = shifted - kRebias;
    if (shifted >= (0xffu << M) || code > kMaxCode) code = kMaxCode;  // saturate (inf too)
  } else {
    // Subnormal range: value / 2^(1 - B - M) is below 2^M; round it to an integer with the
    // FPU's own round-to-nearest-even (adding 2^23 leaves no fraction bits). Reaching 2^M
    // gives the smallest normal's code, which is right.
    const float scaled = BitsToFloat(magnitude) * BitsToFloat(static_cast<uint32_t>(127 + B - 1 + M) << 23);
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;
    code = static_cast<uint32_t>(rounded);
  }
  return static_cast<uint8_t>(sign | code);
}

JAXFUSE_HOST_DEVICE uint8_t FloatToE4M3(float value) {
  return FloatToFp8Bits<3, 7, 0x7eu, 0x7fu>(value);
}
JAXFUSE_HOST_DEVICE uint8_t FloatToE5M2(float value) {
  return FloatToFp8Bits<2, 15, 0x7bu, 0x7eu>(value);
}
JAXFUSE_HOST_DEVICE uint8_t FloatToFp8(float value, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? FloatToE4M3(value) : FloatToE5M2(value);
}

JAXFUSE_HOST_DEVICE float E4M3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return BitsToFloat(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

JAXFUSE_HOST_DEVICE float E5M2ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 2) & 0x1fu;
  const uint32_t mantissa = code & 0x3u;
  if (exponent == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mantissa << 21));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 1.52587890625e-5f;  // 2^-16
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 21));
}

// |value| for the amax reductions, with NaN counted as 0 (fmaxf semantics: a NaN element
// never poisons its whole group's scale; it is still stored as NaN).
JAXFUSE_HOST_DEVICE float AbsForAmax(float value) {
  const float magnitude = value < 0.0f ? -value : value;
  return magnitude == magnitude ? magnitude : 0.0f;
}

// Current / block scaling: scale = fp8_max / amax, so the largest element maps to the
// largest finite FP8 value. amax == 0 (all zeros, or an empty group) and amax = inf give
// scale 1 (never inf or NaN); a scale that overflows (tiny amax) is clamped to FLT_MAX.
JAXFUSE_HOST_DEVICE float ScaleFromAmax(float amax, float fp8_max) {
  if (!(amax > 0.0f) || amax > 3.4028234663852886e38f) return 1.0f;
  const float scale = fp8_max / amax;
  return scale > 3.4028234663852886e38f ? 3.4028234663852886e38f : scale;
}

// MXFP8 (OCP MX): a power-of-two block scale stored as E8M0 (the biased exponent, 127 =
// 2^0). We round the exponent UP, as NVIDIA's MXFP8 kernels do: 2^e >= amax / fp8_max, so
// amax / 2^e never exceeds the FP8 range. amax == 0 or inf gives 2^0, as ScaleFromAmax
// (infinities then saturate; a finite amax never reaches e = 254, whose 2^(127 - e) would
// be subnormal and flushed to zero under FTZ). Biased result in [0, 254].
JAXFUSE_HOST_DEVICE uint8_t E8M0FromAmax(float amax, float fp8_max) {
  if (!(amax > 0.0f) || amax > 3.4028234663852886e38f) return 127;
  const uint32_t bits = FloatBits(amax / fp8_max);
  uint32_t exponent = (bits >> 23) & 0xffu;
  if ((bits & 0x7fffffu) != 0u) exponent += 1u;  // round up (also lifts subnormals to 2^-126)
  return static_cast<uint8_t>(exponent > 254u ? 254u : exponent);
}

// 2^(e - 127) as a float (e = 0 is the subnormal 2^-127).
JAXFUSE_HOST_DEVICE float E8M0ToFloat(uint8_t biased) {
  return biased == 0 ? BitsToFloat(0x00400000u) : BitsToFloat(static_cast<uint32_t>(biased) << 23);
}

// 2^(127 - e), the multiplier applied before rounding (exact; e = 254 gives 2^-127).
JAXFUSE_HOST_DEVICE float E8M0InverseToFloat(uint8_t biased) {
  return E8M0ToFloat(static_cast<uint8_t>(254 - biased));
}

// Scaling modes shared by the Python wrappers (jaxfuse/_src/ops/quantize/ffi.py).
enum class ScalingMode : int32_t {
  kCurrent = 0,      // one scale per group of rows (per tensor: a single group)
  kBlock1D = 1,      // 1 x block along the last dim, fp32 scales
  kBlock2D = 2,      // block x block tiles of the last two dims, fp32 scales
  kMxfp8 = 3,        // 1 x block along the last dim, E8M0 scales
};

}  // namespace jaxfuse
