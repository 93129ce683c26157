// Fused optimizer updates, one pass over the parameters. CPU reference:
// CpuBackend::sgd_update and CpuBackend::adamw_update (PyTorch's rules: SGD
// adds weight decay to the gradient and initialises the momentum buffer to the
// first gradient; AdamW decays the weights decoupled from the gradient). Each
// update can also write the new parameter in the GEMMs' half type (HalfShadow)
// through the functors cast_to_bf16 / cast_to_fp16 use (common.cuh), for 2 bytes
// a parameter instead of a cast pass that reads it again.
#include <cmath>

#include "../csrc/cuda/cuda_check.h"
#include "common.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

__device__ __forceinline__ void write_shadow(const HalfShadow& s, size_t i, float p) {
  if (!s.out) return;
  if (s.bf16)
    static_cast<ToBf16::Out*>(s.out)[i] = ToBf16()(p);
  else
    static_cast<ToFp16::Out*>(s.out)[i] = ToFp16()(p);
}

// grad_scale (gs) is applied as the gradient is read, with __fmul_rn so that
// nvcc cannot fuse it into a following FMA: the update then equals a separate
// scale pass followed by the unscaled update, as the CPU backend computes it.
__global__ void sgd_kernel(float* __restrict__ param, const float* __restrict__ grad, size_t n, float lr,
                           float wd, float gs, HalfShadow shadow) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float p = param[i] - lr * (__fmul_rn(grad[i], gs) + wd * param[i]);
    param[i] = p;
    write_shadow(shadow, i, p);
  }
}

__global__ void sgd_momentum_kernel(float* __restrict__ param, const float* __restrict__ grad,
                                    float* __restrict__ buf, size_t n, float lr, float wd, float mom,
                                    bool first, float gs, HalfShadow shadow) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(grad[i], gs) + wd * param[i];
    const float b = first ? g : mom * buf[i] + g;
    buf[i] = b;
    const float p = param[i] - lr * b;
    param[i] = p;
    write_shadow(shadow, i, p);
  }
}

struct AdamWConsts {
  float step_size, inv_sqrt_bc2, decay, one_minus_b1, one_minus_b2, b2, eps, grad_scale;
};

__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, size_t n, AdamWConsts c, HalfShadow shadow) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(grad[i], c.grad_scale);
    const float mi = m[i] + c.one_minus_b1 * (g - m[i]);
    const float vi = c.b2 * v[i] + c.one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * c.inv_sqrt_bc2 + c.eps;
    const float p = param[i] * c.decay - c.step_size * (mi / denom);
    param[i] = p;
    write_shadow(shadow, i, p);
  }
}

}  // namespace

void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp,
                cudaStream_t stream, HalfShadow shadow) {
  if (n == 0) return;
  if (hp.momentum > 0.0f) {
    MGPU_LAUNCH(sgd_momentum_kernel, grid_for(n), kThreads, 0, stream)(param, grad, momentum_buf, n, hp.lr,
                                                              hp.weight_decay, hp.momentum, hp.first_step,
                                                              hp.grad_scale, shadow);
    MGPU_CUDA_CHECK_LAUNCH("sgd_momentum_kernel");
  } else {
    MGPU_LAUNCH(sgd_kernel, grid_for(n), kThreads, 0, stream)(param, grad, n, hp.lr, hp.weight_decay,
                                                     hp.grad_scale, shadow);
    MGPU_CUDA_CHECK_LAUNCH("sgd_kernel");
  }
}

void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                  const AdamWParams& hp, cudaStream_t stream, HalfShadow shadow) {
  if (n == 0) return;
  // Bias corrections in double on the host, exactly as the CPU backend does.
  const double t = static_cast<double>(hp.step);
  AdamWConsts c;
  c.step_size = static_cast<float>(hp.lr / (1.0 - std::pow(double(hp.beta1), t)));
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double(hp.beta2), t)));
  c.decay = 1.0f - hp.lr * hp.weight_decay;
  c.one_minus_b1 = 1.0f - hp.beta1;
  c.one_minus_b2 = 1.0f - hp.beta2;
  c.b2 = hp.beta2;
  c.eps = hp.eps;
  c.grad_scale = hp.grad_scale;
  MGPU_LAUNCH(adamw_kernel, grid_for(n), kThreads, 0, stream)(param, grad, exp_avg, exp_avg_sq, n, c, shadow);
  MGPU_CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace kernels
}  // namespace mgpu
