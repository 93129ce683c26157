// Elementwise kernels of the CUDA backend: bias broadcast (the linear layer's
// bias, CPU reference: CpuBackend::linear_forward's row copies), scale and axpy
// (CpuBackend::scale / CpuBackend::axpy), the row gather of resident datasets
// (CpuBackend::gather_rows), and the fp32 <-> bf16/fp16
// conversions of the mixed-precision GEMM inputs and of gradient compression
// (CpuBackend::narrow / CpuBackend::widen).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

// Count: with_index_type(n)'s (the column in 32-bit arithmetic where it fits).
template <typename Count>
__global__ void broadcast_rows_kernel(float* __restrict__ out, const float* __restrict__ bias, Count n, Count C) {
  for (Count i = blockIdx.x * Count(blockDim.x) + threadIdx.x; i < n; i += Count(gridDim.x) * blockDim.x)
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

// One thread a word; consecutive threads read consecutive words of a row (coalesced).
// Count as broadcast_rows_kernel's.
template <typename Count>
__global__ void gather_rows_kernel(uint32_t* __restrict__ dst, const uint32_t* __restrict__ src,
                                   const int64_t* __restrict__ index, Count n, Count W) {
  for (Count i = blockIdx.x * Count(blockDim.x) + threadIdx.x; i < n; i += Count(gridDim.x) * blockDim.x) {
    const Count r = i / W, c = i - r * W;
    dst[i] = src[size_t(index[r]) * W + c];
  }
}

template <typename Convert>
__global__ void convert_kernel(typename Convert::Out* __restrict__ out, const typename Convert::In* __restrict__ in,
                               size_t n) {
  const Convert convert;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = convert(in[i]);
}

template <typename Convert>
void convert(void* out, const void* in, size_t n, cudaStream_t stream, const char* name) {
  if (n == 0) return;
  MGPU_LAUNCH(convert_kernel<Convert>, grid_for(n), kThreads, 0, stream)
  (static_cast<typename Convert::Out*>(out), static_cast<const typename Convert::In*>(in), n);
  MGPU_CUDA_CHECK_LAUNCH(name);
}

}  // namespace

void broadcast_rows(float* out, const float* bias, int B, int C, cudaStream_t stream) {
  const size_t n = size_t(B) * C;
  if (n == 0) return;
  with_index_type(n, [&](auto count) {
    using Count = decltype(count);
    MGPU_LAUNCH(broadcast_rows_kernel<Count>, grid_for(n), kThreads, 0, stream)(out, bias, Count(n), Count(C));
  });
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

void gather_rows(uint32_t* dst, const uint32_t* src, const int64_t* index, int rows, int W, cudaStream_t stream) {
  const size_t n = size_t(rows) * W;
  if (n == 0) return;
  with_index_type(n, [&](auto count) {
    using Count = decltype(count);
    MGPU_LAUNCH(gather_rows_kernel<Count>, grid_for(n), kThreads, 0, stream)(dst, src, index, Count(n), Count(W));
  });
  MGPU_CUDA_CHECK_LAUNCH("gather_rows_kernel");
}

void cast_to_bf16(void* out, const float* in, size_t n, cudaStream_t stream) {
  convert<ToBf16>(out, in, n, stream, "convert_kernel<ToBf16>");
}

void cast_to_fp16(void* out, const float* in, size_t n, cudaStream_t stream) {
  convert<ToFp16>(out, in, n, stream, "convert_kernel<ToFp16>");
}

void widen_from_bf16(float* out, const void* in, size_t n, cudaStream_t stream) {
  convert<FromBf16>(out, in, n, stream, "convert_kernel<FromBf16>");
}

void widen_from_fp16(float* out, const void* in, size_t n, cudaStream_t stream) {
  convert<FromFp16>(out, in, n, stream, "convert_kernel<FromFp16>");
}

}  // namespace kernels
}  // namespace mgpu
