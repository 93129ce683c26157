// The stress kernels' element functions, shared by every device's kernels and
// their references (host and device): one definition, so a mismatch is the
// hardware's, not the code's.
#pragma once
#include <cmath>
#include <cstdint>
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
  const Philox4 r = philox_draw(seed, RngStream::kStress, static_cast<uint32_t>(i),
                                static_cast<uint32_t>(i >> 32), 0, 0);
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
MGPU_HD uint64_t stress_word(StressPattern p, uint64_t seed, int pass, uint64_t i) {
  switch (p) {
    case StressPattern::kWalkingOnes:
      return uint64_t{1} << ((i + static_cast<uint64_t>(pass)) & 63);
    case StressPattern::kAddress:  // address-in-address, flipped every other pass
      return (pass & 1) ? ~i : i;
    case StressPattern::kRandom: {
      const Philox4 r = philox_draw(seed, RngStream::kStress, static_cast<uint32_t>(i),
                                    static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(pass), 1);
      return (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
    }
  }
  return 0;
}

}  // namespace mgpu
