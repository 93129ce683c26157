// The stress kernels' element functions, shared by every device's kernels and
// their references (host and device): one definition, so a mismatch is the
// hardware's, not the code's.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "errors.h"
#include "philox.h"

namespace mgpu {

// Element verified by sample k of `checks` over n values: one per stretch of
// q = n / checks, shifted by k mod q, so the samples come from every lane and
// thread of a block instead of the same one (a stride of 256 would sample
// thread 0 only). No product overflows (k q <= n).
MGPU_HD uint64_t stress_sample_index(uint64_t k, uint64_t n, uint64_t checks) {
  const uint64_t q = n / checks;
  return k * q + k % q;
}

// One step of the transcendental chain (10 transcendental calls). Bounded: maps
// (0, 1) into [0.1, 0.9], so iterating it never overflows.
MGPU_HD float stress_chain(float x) {
  float v = sinf(x) + cosf(x);
  v = tanf(0.5f * v);
  v = atanf(v);
  v = expf(0.5f * v);
  v = logf(v + 1.5f);
  v = sqrtf(fabsf(v) + 0.1f);
  v = powf(v, 1.1f);
  v = sinhf(0.5f * v) / coshf(0.5f * v);
  return 0.1f + 0.8f * fabsf(v) / (1.0f + fabsf(v));
}
constexpr int kStressChainOps = 10;

// Start value of element i: uniform in [0.1, 0.9).
MGPU_HD float stress_start(uint64_t seed, uint64_t i) {
  const Philox4 r =
      philox_draw(seed, RngStream::kStress, static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), 0, 0);
  return 0.1f + 0.8f * uniform01(r.v[0]);
}

// Memory patterns: the 64-bit word at index i of pass `pass`.
enum class StressPattern { kWalkingOnes, kAddress, kRandom };

// Host only: a pattern by its name in StressDevice::memory.
inline StressPattern parse_stress_pattern(const std::string& name) {
  if (name == "walking_ones") return StressPattern::kWalkingOnes;
  if (name == "address") return StressPattern::kAddress;
  if (name == "random") return StressPattern::kRandom;
  throw ConfigError("unknown memory pattern '" + name + "' (expected walking_ones, address or random)");
}
// The random pattern's words 2k and 2k + 1: all 128 bits of one Philox4x32-10
// call (a call per word would spend half of each on nothing, and Philox, not
// memory, would bound the pass).
MGPU_HD void stress_random_pair(uint64_t seed, int pass, uint64_t k, uint64_t w[2]) {
  const Philox4 r = philox_draw(seed, RngStream::kStress, static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32),
                                static_cast<uint32_t>(pass), 1);
  w[0] = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
  w[1] = (static_cast<uint64_t>(r.v[2]) << 32) | r.v[3];
}

MGPU_HD uint64_t stress_word(StressPattern p, uint64_t seed, int pass, uint64_t i) {
  switch (p) {
    case StressPattern::kWalkingOnes: return uint64_t{1} << ((i + static_cast<uint64_t>(pass)) & 63);
    case StressPattern::kAddress:  // address-in-address, flipped every other pass
      return (pass & 1) ? ~i : i;
    case StressPattern::kRandom: {
      uint64_t w[2];
      stress_random_pair(seed, pass, i / 2, w);
      return w[i % 2];
    }
  }
  return 0;
}

// Words 2k and 2k + 1 of a pattern: the unit every memory kernel and reference
// loops over (a buffer of odd length ignores the last pair's second word).
MGPU_HD void stress_word_pair(StressPattern p, uint64_t seed, int pass, uint64_t k, uint64_t w[2]) {
  if (p == StressPattern::kRandom) {
    stress_random_pair(seed, pass, k, w);
    return;
  }
  w[0] = stress_word(p, seed, pass, 2 * k);
  w[1] = stress_word(p, seed, pass, 2 * k + 1);
}

// --- The GEMM burn's independent check ------------------------------------
// The burn compares every result with the first of its (n, seed, precision), so
// the first must be right on its own: kStressGemmChecks of its elements
// (stress_sample_index over n * n) are recomputed as fp64 dot products of the
// operands the GEMM saw (fp32, or the bf16 copies widened exactly) and must lie
// within stress_gemm_bound. A defect that corrupts every run the same way (a
// stuck bit, a bad lane) is invisible to the comparison, not to this check.
constexpr uint64_t kStressGemmChecks = 4096;

// Relative error of one product from rounding the operands beyond what the
// reference sees: tf32 keeps 10 of fp32's 23 mantissa bits (rounded or
// truncated, < 2^-10 per operand, so < 2^-9 + 2^-20 per product); the fp32 and
// bf16 references use the GEMM's own operands. Host only.
inline double stress_gemm_input_error(const std::string& precision) {
  if (precision == "fp32" || precision == "bf16") return 0.0;
  if (precision == "tf32") return 0x1.02p-9;
  throw ConfigError("GEMM precision must be fp32, tf32 or bf16, got '" + precision + "'");
}

// Largest |C[i] - reference| accepted for an element whose k products have
// absolute sum abs_sum: the worst case of fp32 accumulation in any order,
// rounding or truncating (k + 1 roundings of at most 2^-23 each, doubled for
// margin), plus the operands' input error. No false alarm on a sound device;
// a top-mantissa-bit flip (a 25-50% error) of an element not far below
// abs_sum * bound factor is caught.
MGPU_HD double stress_gemm_bound(double abs_sum, int k, double input_error) {
  return (input_error + 2.0 * (k + 2) * 0x1p-23) * abs_sum;
}

// Whether a GEMM element passes its independent check (NaN/Inf never do).
MGPU_HD bool stress_gemm_element_ok(float got, double reference, double abs_sum, int k, double input_error) {
  return fabs(double(got) - reference) <= stress_gemm_bound(abs_sum, k, input_error);
}

// fp32 -> bf16 -> fp32, round to nearest even as __float2bfloat16: the host
// reference of the bf16 burn's operands. Host only.
inline float stress_round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
    bits |= 0x00400000u;  // NaN stays a (quiet) NaN
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
  }
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

}  // namespace mgpu
