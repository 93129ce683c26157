// Error checking for CUDA runtime, cuBLAS and kernel launches: every failure
// becomes an mgpu::DeviceError naming the call, the library's error string and
// file:line, so Python sees a typed exception instead of a dead process.
// Shared by the kernels and the CUDA backend (csrc/cuda includes it from here:
// csrc/cuda -> kernels -> csrc/core); needs the CUDA headers.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "../csrc/core/errors.h"

namespace mgpu {
namespace cuda_detail {

[[noreturn]] inline void throw_cuda(cudaError_t rc, const char* call, const char* file, int line) {
  // Clear the thread's last error: left behind, the next launch check would
  // report it again under another kernel's name (sticky errors stay anyway).
  cudaGetLastError();
  throw DeviceError(detail::concat(call, " failed: ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc), " (", file,
                                   ":", line, ")"));
}

inline const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

[[noreturn]] inline void throw_cublas(cublasStatus_t rc, const char* call, const char* file, int line) {
  throw DeviceError(detail::concat(call, " failed: ", cublas_status_name(rc), " (", file, ":", line, ")"));
}

}  // namespace cuda_detail
}  // namespace mgpu

#define MGPU_CUDA_CHECK(call)                                                                          \
  do {                                                                                                 \
    const cudaError_t mgpu_rc_ = (call);                                                               \
    if (mgpu_rc_ != cudaSuccess) ::mgpu::cuda_detail::throw_cuda(mgpu_rc_, #call, __FILE__, __LINE__); \
  } while (0)

#define MGPU_CUBLAS_CHECK(call)                                                                                    \
  do {                                                                                                             \
    const cublasStatus_t mgpu_rc_ = (call);                                                                        \
    if (mgpu_rc_ != CUBLAS_STATUS_SUCCESS) ::mgpu::cuda_detail::throw_cublas(mgpu_rc_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here; faults
// inside the kernel surface at the next synchronising call, also as DeviceError.
#define MGPU_CUDA_CHECK_LAUNCH(name)                                                                  \
  do {                                                                                                \
    const cudaError_t mgpu_rc_ = cudaGetLastError();                                                  \
    if (mgpu_rc_ != cudaSuccess) ::mgpu::cuda_detail::throw_cuda(mgpu_rc_, name, __FILE__, __LINE__); \
  } while (0)
