// Fused optimizer updates, one pass over the parameters. CPU reference:
// CpuBackend::sgd_update and CpuBackend::adamw_update (PyTorch's rules: SGD
// adds weight decay to the gradient and initialises the momentum buffer to the
// first gradient; AdamW decays the weights decoupled from the gradient). Each
// update can also write the new parameter in the GEMMs' half type (HalfShadow)
// through the functors cast_to_bf16 / cast_to_fp16 use (common.cuh), for 2 bytes
// a parameter instead of a cast pass that reads it again. The step's verdict
// (CPU reference: CpuBackend::step_verdict, and step_verdict_from_shards for a
// sharded step) is decide_step / decide_sharded_step, shared with the CPU.
#include <cmath>

#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

// grad_scale (gs) is applied as the gradient is read, with __fmul_rn so that
// nvcc cannot fuse it into a following FMA: the update then equals a separate
// scale pass followed by the unscaled update, as the CPU backend computes it.
// Per-step values come from the launch (s) or, in a replayed capture, from the
// replay's arguments; a verdict (decided on the device) can skip the update
// and supplies the step's unscale/clip factor. Every thread reads the same few
// words of both: one cached load each.
struct StepInputs {
  const StepVerdict* verdict;
  const ReplayArgs* replay;
};

// False: this step's update does not run. Otherwise s and gs hold its values.
__device__ __forceinline__ bool step_values(const StepInputs& in, UpdateScalars& s, float& gs) {
  if (!update_runs(in.verdict, gs, gs)) return false;
  if (in.replay) s = in.replay->update;
  return true;
}

__global__ void sgd_kernel(float* __restrict__ param, const float* __restrict__ grad, size_t n, UpdateScalars s,
                           float wd, float gs, HalfShadow shadow, StepInputs in) {
  if (!step_values(in, s, gs)) return;
  const float lr = s.lr;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float p = param[i] - lr * (__fmul_rn(grad[i], gs) + wd * param[i]);
    param[i] = p;
    write_shadow(shadow, i, p);
  }
}

__global__ void sgd_momentum_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ buf,
                                    size_t n, UpdateScalars s, float wd, float mom, float gs, HalfShadow shadow,
                                    StepInputs in) {
  if (!step_values(in, s, gs)) return;
  const float lr = s.lr;
  const bool first = s.first_step != 0;
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
  float one_minus_b1, one_minus_b2, b2, eps, grad_scale;
};

__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, size_t n, UpdateScalars s, AdamWConsts c, HalfShadow shadow,
                             StepInputs in) {
  float gs = c.grad_scale;
  if (!step_values(in, s, gs)) return;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(grad[i], gs);
    const float mi = m[i] + c.one_minus_b1 * (g - m[i]);
    const float vi = c.b2 * v[i] + c.one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * s.inv_sqrt_bc2 + c.eps;
    const float p = param[i] * s.decay - s.step_size * (mi / denom);
    param[i] = p;
    write_shadow(shadow, i, p);
  }
}

// One thread: the verdict from the sum of squares already in v->sum_squares.
// Both flags are host-pinned and written by others (a fold kernel, the NCCL
// watchdog thread): read through volatile, never from a cached copy.
__global__ void step_verdict_kernel(StepVerdict* v, const float* slots, float loss_scale, float max_norm,
                                    const unsigned long long* pending_label_errors, const int* comm_failed,
                                    const ReplayArgs* replay) {
  const float scale = replay ? replay->loss_scale : loss_scale;
  const bool labels_ok =
      !(pending_label_errors && *static_cast<const volatile unsigned long long*>(pending_label_errors));
  const bool comm_ok = !(comm_failed && *static_cast<const volatile int*>(comm_failed));
  decide_step(*v, slots, scale, max_norm, labels_ok && comm_ok);
}

// One thread each: a sharded step's share of the health check, and the verdict from every rank's share.
__global__ void shard_health_sums_kernel(float* sums, const float* slots, const double* sum_squares) {
  write_shard_sums(sums, slots, *sum_squares);
}

__global__ void step_verdict_from_shards_kernel(StepVerdict* v, const float* all_sums, int ranks, float loss_scale,
                                                float max_norm, const unsigned long long* pending_label_errors,
                                                const int* comm_failed, const ReplayArgs* replay) {
  const float scale = replay ? replay->loss_scale : loss_scale;
  const bool labels_ok =
      !(pending_label_errors && *static_cast<const volatile unsigned long long*>(pending_label_errors));
  const bool comm_ok = !(comm_failed && *static_cast<const volatile int*>(comm_failed));
  decide_sharded_step(*v, all_sums, ranks, scale, max_norm, labels_ok && comm_ok);
}

}  // namespace

void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp,
                cudaStream_t stream, HalfShadow shadow, const ReplayArgs* replay) {
  if (n == 0) return;
  const UpdateScalars s = update_scalars(hp);
  const StepInputs in{hp.verdict, replay};
  if (hp.momentum > 0.0f) {
    MGPU_LAUNCH(sgd_momentum_kernel, grid_for(n), kThreads, 0, stream)
    (param, grad, momentum_buf, n, s, hp.weight_decay, hp.momentum, hp.grad_scale, shadow, in);
    MGPU_CUDA_CHECK_LAUNCH("sgd_momentum_kernel");
  } else {
    MGPU_LAUNCH(sgd_kernel, grid_for(n), kThreads, 0, stream)
    (param, grad, n, s, hp.weight_decay, hp.grad_scale, shadow, in);
    MGPU_CUDA_CHECK_LAUNCH("sgd_kernel");
  }
}

void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n, const AdamWParams& hp,
                  cudaStream_t stream, HalfShadow shadow, const ReplayArgs* replay) {
  if (n == 0) return;
  // Bias corrections in double on the host, as the CPU backend computes them.
  const UpdateScalars s = update_scalars(hp);
  AdamWConsts c;
  c.one_minus_b1 = 1.0f - hp.beta1;
  c.one_minus_b2 = 1.0f - hp.beta2;
  c.b2 = hp.beta2;
  c.eps = hp.eps;
  c.grad_scale = hp.grad_scale;
  MGPU_LAUNCH(adamw_kernel, grid_for(n), kThreads, 0, stream)
  (param, grad, exp_avg, exp_avg_sq, n, s, c, shadow, StepInputs{hp.verdict, replay});
  MGPU_CUDA_CHECK_LAUNCH("adamw_kernel");
}

void step_verdict(StepVerdict* verdict, const float* slots, float loss_scale, float max_norm,
                  const unsigned long long* pending_label_errors, const int* comm_failed, cudaStream_t stream,
                  const ReplayArgs* replay) {
  MGPU_LAUNCH(step_verdict_kernel, 1, 1, 0, stream)
  (verdict, slots, loss_scale, max_norm, pending_label_errors, comm_failed, replay);
  MGPU_CUDA_CHECK_LAUNCH("step_verdict_kernel");
}

void shard_health_sums(float* sums, const float* slots, const double* sum_squares, cudaStream_t stream) {
  MGPU_LAUNCH(shard_health_sums_kernel, 1, 1, 0, stream)(sums, slots, sum_squares);
  MGPU_CUDA_CHECK_LAUNCH("shard_health_sums_kernel");
}

void step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale, float max_norm,
                              const unsigned long long* pending_label_errors, const int* comm_failed,
                              cudaStream_t stream, const ReplayArgs* replay) {
  MGPU_LAUNCH(step_verdict_from_shards_kernel, 1, 1, 0, stream)
  (verdict, all_sums, ranks, loss_scale, max_norm, pending_label_errors, comm_failed, replay);
  MGPU_CUDA_CHECK_LAUNCH("step_verdict_from_shards_kernel");
}

}  // namespace kernels
}  // namespace mgpu
