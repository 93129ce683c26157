// ReLU + inverted dropout, forward and backward. CPU reference:
// CpuBackend::relu_dropout_forward / relu_dropout_backward. The mask is the
// DropoutKey definition of backend.h, bit for bit: unit j of global sample i is
// kept iff uniform01(word j / G of Philox4x32-10(counter {j % G, i, layer, step},
// key {seed lo, seed hi ^ stream tag})) >= p, G = dropout_groups(C). The words
// come from cuRAND's curand_Philox4x32_10, compiled here for host and device so
// the host can run the very code of the kernel (dropout_mask_on_host) and tests
// can compare it with the CPU backend without a GPU.
#include <cuda_runtime.h>

// cuRAND's Philox header is device-only by default; its host path (plain 64-bit
// multiplies) gives the same words as the device path (__umulhi).
#define QUALIFIERS static __forceinline__ __host__ __device__
#include <curand_philox4x32_x.h>
#undef QUALIFIERS

#include "../csrc/core/philox.h"
#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

// The per-launch constants of one layer's mask.
struct MaskParams {
  uint32_t key0, key1;  // Philox key: seed lo, seed hi ^ dropout stream tag
  uint32_t layer, step;
  int64_t first_sample;
  int C, groups;
  float p, keep_scale;
};

MaskParams mask_params(int C, float p, const DropoutKey& key) {
  MaskParams m;
  m.key0 = static_cast<uint32_t>(key.seed);
  // Same stream separation as philox_draw (philox.h).
  m.key1 = static_cast<uint32_t>(key.seed >> 32) ^ (static_cast<uint32_t>(RngStream::kDropout) * 0x9E3779B9u);
  m.layer = key.layer;
  m.step = static_cast<uint32_t>(key.step);
  m.first_sample = key.first_sample;
  m.C = C;
  m.groups = dropout_groups(C);
  m.p = p;
  m.keep_scale = 1.0f / (1.0f - p);
  return m;
}

// The four words of counter g of local row b.
__host__ __device__ __forceinline__ uint4 mask_words(const MaskParams& m, int b, int g) {
  const uint32_t sample = static_cast<uint32_t>(m.first_sample + b);
  return curand_Philox4x32_10(make_uint4(static_cast<uint32_t>(g), sample, m.layer, m.step),
                              make_uint2(m.key0, m.key1));
}

__host__ __device__ __forceinline__ uint32_t word(const uint4& w, int k) {
  return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}

// Multiplier of unit j = k * groups + g: 0 (dropped) or 1 / (1 - p).
__host__ __device__ __forceinline__ float keep_factor(const MaskParams& m, uint32_t bits) {
  return uniform01(bits) >= m.p ? m.keep_scale : 0.0f;
}

// The values come in the launch's arguments, which CUDA copies when the launch
// is enqueued (CPU reference: CpuBackend::replay's args).
__global__ void set_replay_args_kernel(ReplayArgs* dst, ReplayArgs args) { *dst = args; }

// shadow: the GEMMs' half copy of each value written (see HalfShadow), so the
// next layer's GEMMs need no cast pass over the activations or their gradients.
__global__ void relu_kernel(float* __restrict__ h, size_t n, HalfShadow shadow) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = h[i] <= 0.0f ? 0.0f : h[i];  // NaN passes, as in PyTorch
    h[i] = v;
    write_shadow(shadow, i, v);
  }
}

// One thread per (row, counter): one Philox call serves the row's four units
// g, g + G, g + 2G, g + 3G; neighbouring threads touch neighbouring units.
// replay (nullable): the step and first sample to use instead of m's (captured graphs; see Backend).
// Count: with_index_type(B * groups)'s (the row and counter in 32-bit arithmetic where they fit).
template <typename Count>
__global__ void relu_dropout_kernel(float* __restrict__ h, int B, MaskParams m, const ReplayArgs* replay,
                                    HalfShadow shadow) {
  if (replay) {
    m.step = static_cast<uint32_t>(replay->step);
    m.first_sample = replay->first_sample;
  }
  const Count total = Count(B) * Count(m.groups), groups = Count(m.groups);
  for (Count t = blockIdx.x * Count(blockDim.x) + threadIdx.x; t < total; t += Count(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(t / groups), g = static_cast<int>(t % groups);
    const uint4 w = mask_words(m, b, g);
    float* row = h + size_t(b) * m.C;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int j = k * m.groups + g;
      if (j < m.C) {
        const float v = row[j];
        const float out = (v <= 0.0f ? 0.0f : v) * keep_factor(m, word(w, k));
        row[j] = out;
        write_shadow(shadow, size_t(b) * m.C + j, out);
      }
    }
  }
}

__global__ void relu_dropout_backward_kernel(float* __restrict__ dh, const float* __restrict__ h, size_t n,
                                             float keep_scale, HalfShadow shadow) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = h[i] <= 0.0f ? 0.0f : dh[i] * keep_scale;
    dh[i] = v;
    write_shadow(shadow, i, v);
  }
}

}  // namespace

void relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key, cudaStream_t stream,
                          const ReplayArgs* replay, HalfShadow shadow) {
  const size_t n = size_t(B) * C;
  if (n == 0) return;
  if (p <= 0.0f) {
    MGPU_LAUNCH(relu_kernel, grid_for(n), kThreads, 0, stream)(h, n, shadow);
    MGPU_CUDA_CHECK_LAUNCH("relu_kernel");
    return;
  }
  const MaskParams m = mask_params(C, p, key);
  const size_t units = size_t(B) * m.groups;
  with_index_type(units, [&](auto count) {
    MGPU_LAUNCH(relu_dropout_kernel<decltype(count)>, grid_for(units), kThreads, 0, stream)(h, B, m, replay, shadow);
  });
  MGPU_CUDA_CHECK_LAUNCH("relu_dropout_kernel");
}

void set_replay_args(ReplayArgs* dst, const ReplayArgs& args, cudaStream_t stream) {
  MGPU_LAUNCH(set_replay_args_kernel, 1, 1, 0, stream)(dst, args);
  MGPU_CUDA_CHECK_LAUNCH("set_replay_args_kernel");
}

void relu_dropout_backward(float* dh, const float* h, size_t n, float p, cudaStream_t stream, HalfShadow shadow) {
  if (n == 0) return;
  const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  MGPU_LAUNCH(relu_dropout_backward_kernel, grid_for(n), kThreads, 0, stream)(dh, h, n, keep_scale, shadow);
  MGPU_CUDA_CHECK_LAUNCH("relu_dropout_backward_kernel");
}

void dropout_mask_on_host(float* mask, int B, int C, float p, const DropoutKey& key) {
  const MaskParams m = mask_params(C, p, key);
  for (int b = 0; b < B; ++b)
    for (int g = 0; g < m.groups; ++g) {
      const uint4 w = mask_words(m, b, g);
      for (int k = 0; k < 4; ++k) {
        const int j = k * m.groups + g;
        if (j < C) mask[size_t(b) * C + j] = keep_factor(m, word(w, k));
      }
    }
}

void curand_philox_on_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  const uint4 w =
      curand_Philox4x32_10(make_uint4(counter[0], counter[1], counter[2], counter[3]), make_uint2(key[0], key[1]));
  out[0] = w.x;
  out[1] = w.y;
  out[2] = w.z;
  out[3] = w.w;
}

}  // namespace kernels
}  // namespace mgpu
