// Device helpers shared by the kernel files: launch geometry, the fixed-order
// block reductions that keep every reduction deterministic, and the fp32 <->
// bf16/fp16 conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

// Every kernel launch goes through MGPU_LAUNCH(kernel, grid, block, shared_bytes,
// stream)(args...): nvcc's <<< >>> here; the GPU emulation build
// (emulation/README.md) defines its own before this header is read.
#ifndef MGPU_LAUNCH
#define MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
#endif

namespace mgpu {
namespace kernels {

constexpr int kThreads = 256;

// Element-wise type conversions, one functor each (a kernel templated on one
// names it): fp32 -> bf16 / fp16 round to nearest even (beyond fp16's range
// +-Inf, which the loss scaler sees and skips), and back exactly.
struct ToBf16 {
  using In = float;
  using Out = __nv_bfloat16;
  __device__ Out operator()(In x) const { return __float2bfloat16_rn(x); }
};
struct ToFp16 {
  using In = float;
  using Out = __half;
  __device__ Out operator()(In x) const { return __float2half_rn(x); }
};
struct FromBf16 {
  using In = __nv_bfloat16;
  using Out = float;
  __device__ Out operator()(In x) const { return __bfloat162float(x); }
};
struct FromFp16 {
  using In = __half;
  using Out = float;
  __device__ Out operator()(In x) const { return __half2float(x); }
};

// Writes v's half-precision value at i where a kernel keeps a half copy of
// what it writes (kernels::HalfShadow), with the casts' own rounding.
template <class Shadow>
__device__ __forceinline__ void write_shadow(const Shadow& s, size_t i, float v) {
  if (!s.out) return;
  if (s.bf16)
    static_cast<ToBf16::Out*>(s.out)[i] = ToBf16()(v);
  else
    static_cast<ToFp16::Out*>(s.out)[i] = ToFp16()(v);
}

// Grid for a grid-stride loop over n elements (capped: the loop covers the rest).
inline unsigned grid_for(size_t n, int threads = kThreads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(blocks, size_t{1} << 16)));
}

// Whether a grid-stride loop over n elements (grid_for(n) blocks of kThreads) can count
// in 32 bits without its index wrapping: a kernel that divides by a row width per
// element then takes a 32-bit division (a 64-bit one is a long instruction sequence).
inline bool indexes_in_32_bits(size_t n) { return n < (size_t{1} << 32) - 2 * size_t(kThreads) * grid_for(n); }

// launch(Count{}) with Count the type such a loop over n elements counts in: uint32_t where
// indexes_in_32_bits(n), else size_t. A kernel templated on Count launches through it.
template <typename Launch>
void with_index_type(size_t n, Launch&& launch) {
  if (indexes_in_32_bits(n))
    launch(uint32_t{});
  else
    launch(size_t{});
}

// Sum of v over a block of kThreads threads, as a fixed binary tree in shared
// memory; every thread gets the result. Call from all threads of the block.
__device__ __forceinline__ double block_sum(double v, double* smem) {
  __syncthreads();  // smem may still be read from a previous call
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) smem[threadIdx.x] += smem[threadIdx.x + stride];
    __syncthreads();
  }
  return smem[0];
}

}  // namespace kernels
}  // namespace mgpu
