// Device helpers shared by the kernel files: launch geometry and the
// fixed-order block reductions that keep every reduction deterministic.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

// Every kernel launch goes through MGPU_LAUNCH(kernel, grid, block, shared_bytes,
// stream)(args...): nvcc's <<< >>> here; the GPU emulation build
// (emulation/README.md) defines its own before this header is read.
#ifndef MGPU_LAUNCH
#define MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<grid, block, shared_bytes, stream>>>
#endif

namespace mgpu {
namespace kernels {

constexpr int kThreads = 256;

// Grid for a grid-stride loop over n elements (capped: the loop covers the rest).
inline unsigned grid_for(size_t n, int threads = kThreads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(blocks, size_t{1} << 16)));
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
