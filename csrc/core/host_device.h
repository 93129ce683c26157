// MGPU_HD: marks the small functions compiled for both the host and the device,
// so a CUDA kernel and its CPU reference share one definition of the math.
#pragma once

#if defined(__CUDACC__)
#define MGPU_HD __host__ __device__ __forceinline__
#else
#define MGPU_HD inline
#endif
