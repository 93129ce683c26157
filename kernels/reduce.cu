// Reductions: sum of squares (gradient norm and NaN/Inf detection, CPU
// reference: CpuBackend::sum_squares), the bias gradient's column sums (CPU
// reference: the dbias loop of CpuBackend::linear_backward, including its
// `accumulate` semantics), and the fixed-order final pass shared by every
// reducing kernel. No atomics: results are deterministic run to run.
#include <cuda_runtime.h>

#include "../csrc/cuda/cuda_check.h"
#include "common.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

__global__ void sum_squares_kernel(double* __restrict__ partials, const float* __restrict__ x, size_t n) {
  __shared__ double smem[kThreads];
  double sum = 0.0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    sum += double(x[i]) * x[i];
  sum = block_sum(sum, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void finalize_kernel(FinalizeArgs a) {
  __shared__ double smem[kThreads];
  for (int s = 0; s < a.nseries; ++s) {
    const double* p = a.partials + s * kReduceBlocks;
    double v = 0.0;
    for (int i = threadIdx.x; i < a.nblocks; i += kThreads) v += p[i];
    v = block_sum(v, smem);
    if (threadIdx.x == 0) {
      const float scale = s == 0 && a.replay ? a.replay->grad_scale : a.scale[s];
      if (a.out_f[s]) *a.out_f[s] = static_cast<float>(v * scale);
      if (s == 0 && a.out_d) *a.out_d = v;
    }
  }
  // One thread, after the loss kernel: no atomics needed here.
  unsigned long long* dev = a.label_errors.device;
  unsigned long long* host = a.label_errors.host;
  if (threadIdx.x == 0 && dev && host && dev[0]) {
    if (host[0] == 0) {
      host[1] = dev[1];
      host[2] = static_cast<unsigned long long>(a.classes);
    }
    host[0] += dev[0];
    dev[0] = 0;
    dev[1] = kNoLabelError;
  }
}

constexpr int kColTile = 32, kRowThreads = 16;

// dout (B, OUT) -> dbias (OUT): threads (tx, ty) sum rows ty, ty + 16, ... of
// column tx of the block's tile, then ty = 0 adds the 16 partial sums in order.
__global__ void column_sums_kernel(float* __restrict__ dbias, const float* __restrict__ dout, int B, int OUT,
                                   bool accumulate) {
  __shared__ float smem[kRowThreads][kColTile + 1];
  const int j = blockIdx.x * kColTile + threadIdx.x;
  float sum = 0.0f;
  if (j < OUT)
    for (int b = threadIdx.y; b < B; b += kRowThreads) sum += dout[size_t(b) * OUT + j];
  smem[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && j < OUT) {
    float total = 0.0f;
    for (int r = 0; r < kRowThreads; ++r) total += smem[r][threadIdx.x];
    dbias[j] = accumulate ? dbias[j] + total : total;
  }
}

}  // namespace

int reduce_blocks(size_t work, size_t per_block) {
  const size_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : blocks > size_t(kReduceBlocks) ? size_t(kReduceBlocks) : blocks);
}

void finalize_partials(const FinalizeArgs& args, cudaStream_t stream) {
  MGPU_LAUNCH(finalize_kernel, 1, kThreads, 0, stream)(args);
  MGPU_CUDA_CHECK_LAUNCH("finalize_kernel");
}

void sum_squares(double* out, const float* x, size_t n, double* partials, cudaStream_t stream) {
  const int blocks = reduce_blocks(n, size_t(kThreads) * 8);
  MGPU_LAUNCH(sum_squares_kernel, blocks, kThreads, 0, stream)(partials, x, n);
  MGPU_CUDA_CHECK_LAUNCH("sum_squares_kernel");
  FinalizeArgs f;
  f.partials = partials;
  f.nblocks = blocks;
  f.out_d = out;
  finalize_partials(f, stream);
}

void column_sums(float* dbias, const float* dout, int B, int OUT, bool accumulate, cudaStream_t stream) {
  if (OUT <= 0) return;
  const dim3 block(kColTile, kRowThreads);
  const unsigned grid = static_cast<unsigned>((OUT + kColTile - 1) / kColTile);
  MGPU_LAUNCH(column_sums_kernel, grid, block, 0, stream)(dbias, dout, B, OUT, accumulate);
  MGPU_CUDA_CHECK_LAUNCH("column_sums_kernel");
}

}  // namespace kernels
}  // namespace mgpu
