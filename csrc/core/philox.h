// Philox4x32-10 counter-based random numbers (Salmon et al., SC'11), usable from
// host and device code. Initialization and dropout masks are pure functions of
// (seed, counter), so every rank and every backend draws the same numbers.
#pragma once
#include <cstdint>

#include "host_device.h"

namespace mgpu {

struct Philox4 {
  uint32_t v[4];
};

MGPU_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform float in [0, 1) from the top 24 bits, exactly representable.
MGPU_HD float uniform01(uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }

// Streams are separated by a tag folded into the key, so init and dropout never
// share random numbers even for equal counters.
enum class RngStream : uint32_t { kInit = 0x1A17u, kDropout = 0xD7A0u, kStress = 0x57E5u };

MGPU_HD Philox4 philox_draw(uint64_t seed, RngStream stream, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  return philox4x32_10(c0, c1, c2, c3, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32) ^ (static_cast<uint32_t>(stream) * 0x9E3779B9u));
}

}  // namespace mgpu
