// Loss kernels: MSE and softmax cross-entropy, each fused forward + backward.
// CPU reference: CpuBackend::mse_forward_backward and
// CpuBackend::cross_entropy_forward_backward. Loss sums accumulate in double
// like the CPU's and reduce in a fixed order (per-block partials, then
// finalize_partials), so a step's loss is bit-reproducible. Cross entropy
// never trusts a label: a row outside [0, C) is left out and recorded for the
// host (LabelErrors), as the CPU leaves it out and throws.
#include <cuda_runtime.h>

#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

constexpr int kWarpsPerBlock = kThreads / 32;

// pred (B, D), target (B, D): partials[block] = sum (pred - target)^2 over the
// block's elements; dpred = 2 grad_scale (pred - target), grad_scale from
// replay (nullable, device) when set.
__global__ void mse_kernel(double* __restrict__ partials, float* __restrict__ dpred, const float* __restrict__ pred,
                           const float* __restrict__ target, size_t n, float two_scale, const ReplayArgs* replay) {
  __shared__ double smem[kThreads];
  if (replay) two_scale = 2.0f * replay->grad_scale;
  double sum = 0.0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float diff = pred[i] - target[i];
    sum += double(diff) * diff;
    if (dpred) dpred[i] = two_scale * diff;
  }
  sum = block_sum(sum, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// One warp per row of logits (B, C). The argmax is the first maximal index,
// as in the CPU loop, so ties count the same. bad_labels (nullable, device):
// LabelErrors::device.
__global__ void cross_entropy_kernel(double* __restrict__ partials, float* __restrict__ dlogits,
                                     const float* __restrict__ logits, const int32_t* __restrict__ labels, int B, int C,
                                     float grad_scale, unsigned long long* bad_labels, const ReplayArgs* replay) {
  __shared__ double warp_loss[kWarpsPerBlock];
  if (replay) grad_scale = replay->grad_scale;
  __shared__ int warp_hits[kWarpsPerBlock];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double loss_sum = 0.0;
  int hits = 0;
  for (int b = blockIdx.x * kWarpsPerBlock + warp; b < B; b += gridDim.x * kWarpsPerBlock) {
    const float* x = logits + size_t(b) * C;
    const int y = labels[b];
    if (y < 0 || y >= C) {  // the whole warp sees the same label: no divergence at the shuffles below
      if (lane == 0 && bad_labels) {
        atomicAdd(&bad_labels[0], 1ull);
        atomicMin(&bad_labels[1], (static_cast<unsigned long long>(b) << 32) | static_cast<uint32_t>(y));
      }
      if (dlogits)
        for (int j = lane; j < C; j += 32) dlogits[size_t(b) * C + j] = 0.0f;
      continue;
    }
    float best = -INFINITY;
    int best_j = C;  // sentinel: larger than any real index
    for (int j = lane; j < C; j += 32)
      if (best_j == C || x[j] > best) {
        best = x[j];
        best_j = j;
      }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, offset);
      const int oj = __shfl_xor_sync(0xffffffffu, best_j, offset);
      if (oj != C && (best_j == C || ob > best || (ob == best && oj < best_j))) {
        best = ob;
        best_j = oj;
      }
    }
    // With NaN logits the merge above is not associative: take lane 0's view
    // so every lane agrees (the loss is NaN either way).
    best_j = __shfl_sync(0xffffffffu, best_j, 0);
    const float mx = x[best_j];
    double denom = 0.0;
    for (int j = lane; j < C; j += 32) denom += exp(double(x[j] - mx));
    for (int offset = 16; offset > 0; offset >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, offset);
    if (lane == 0) {
      loss_sum += log(denom) - double(x[y] - mx);
      hits += best_j == y;
    }
    if (dlogits) {
      float* g = dlogits + size_t(b) * C;
      const float inv = static_cast<float>(1.0 / denom);
      for (int j = lane; j < C; j += 32) g[j] = grad_scale * (expf(x[j] - mx) * inv - (j == y ? 1.0f : 0.0f));
    }
  }
  if (lane == 0) {
    warp_loss[warp] = loss_sum;
    warp_hits[warp] = hits;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    int total_hits = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      total += warp_loss[w];
      total_hits += warp_hits[w];
    }
    partials[blockIdx.x] = total;
    partials[kReduceBlocks + blockIdx.x] = total_hits;
  }
}

}  // namespace

void mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B, int D,
                          float grad_scale, double* partials, cudaStream_t stream, const ReplayArgs* replay) {
  const size_t n = size_t(B) * D;
  const int blocks = reduce_blocks(n, size_t(kThreads) * 8);
  MGPU_LAUNCH(mse_kernel, blocks, kThreads, 0, stream)(partials, dpred, pred, target, n, 2.0f * grad_scale, replay);
  MGPU_CUDA_CHECK_LAUNCH("mse_kernel");
  FinalizeArgs f;
  f.partials = partials;
  f.nblocks = blocks;
  f.out_f[0] = loss_out;
  f.scale[0] = grad_scale;
  f.replay = replay;
  finalize_partials(f, stream);
}

void cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out, const float* logits,
                                    const int32_t* labels, int B, int C, float grad_scale, double* partials,
                                    const LabelErrors& errors, cudaStream_t stream, const ReplayArgs* replay) {
  const int blocks = reduce_blocks(size_t(B), kWarpsPerBlock);
  MGPU_LAUNCH(cross_entropy_kernel, blocks, kThreads, 0, stream)
  (partials, dlogits, logits, labels, B, C, grad_scale, errors.device, replay);
  MGPU_CUDA_CHECK_LAUNCH("cross_entropy_kernel");
  FinalizeArgs f;
  f.partials = partials;
  f.nblocks = blocks;
  f.nseries = 2;
  f.out_f[0] = loss_out;
  f.scale[0] = grad_scale;
  f.replay = replay;
  f.out_f[1] = correct_out;
  f.scale[1] = 1.0f;
  f.label_errors = errors;
  f.classes = C;
  finalize_partials(f, stream);
}

}  // namespace kernels
}  // namespace mgpu
