// Elementwise kernels of the CUDA backend: bias broadcast (the linear layer's
// bias, CPU reference: CpuBackend::linear_forward's row copies), scale and axpy
// (CpuBackend::scale / CpuBackend::axpy), and the fp32 -> bf16/fp16 casts of
// the mixed-precision GEMM inputs (no CPU counterpart: the CPU computes in fp32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../csrc/cuda/cuda_check.h"
#include "common.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

__global__ void broadcast_rows_kernel(float* __restrict__ out, const float* __restrict__ bias, size_t n,
                                      int C) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = bias[i % C];
}

__global__ void scale_kernel(float* __restrict__ x, size_t n, float alpha) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] *= alpha;
}

__global__ void axpy_kernel(float* __restrict__ y, const float* __restrict__ x, size_t n, float alpha) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] += alpha * x[i];
}

__global__ void cast_bf16_kernel(__nv_bfloat16* __restrict__ out, const float* __restrict__ in, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void cast_fp16_kernel(__half* __restrict__ out, const float* __restrict__ in, size_t n) {
  // Values beyond fp16's range become +-Inf: the loss scaler sees them and skips the step.
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2half_rn(in[i]);
}

}  // namespace

void broadcast_rows(float* out, const float* bias, int B, int C, cudaStream_t stream) {
  const size_t n = size_t(B) * C;
  if (n == 0) return;
  MGPU_LAUNCH(broadcast_rows_kernel, grid_for(n), kThreads, 0, stream)(out, bias, n, C);
  MGPU_CUDA_CHECK_LAUNCH("broadcast_rows_kernel");
}

void scale(float* x, size_t n, float alpha, cudaStream_t stream) {
  if (n == 0) return;
  MGPU_LAUNCH(scale_kernel, grid_for(n), kThreads, 0, stream)(x, n, alpha);
  MGPU_CUDA_CHECK_LAUNCH("scale_kernel");
}

void axpy(float* y, const float* x, size_t n, float alpha, cudaStream_t stream) {
  if (n == 0) return;
  MGPU_LAUNCH(axpy_kernel, grid_for(n), kThreads, 0, stream)(y, x, n, alpha);
  MGPU_CUDA_CHECK_LAUNCH("axpy_kernel");
}

void cast_to_bf16(void* out, const float* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  MGPU_LAUNCH(cast_bf16_kernel, grid_for(n), kThreads, 0, stream)(static_cast<__nv_bfloat16*>(out), in, n);
  MGPU_CUDA_CHECK_LAUNCH("cast_bf16_kernel");
}

void cast_to_fp16(void* out, const float* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  MGPU_LAUNCH(cast_fp16_kernel, grid_for(n), kThreads, 0, stream)(static_cast<__half*>(out), in, n);
  MGPU_CUDA_CHECK_LAUNCH("cast_fp16_kernel");
}

}  // namespace kernels
}  // namespace mgpu
