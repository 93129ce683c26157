// Reductions: sum of squares (gradient norm and NaN/Inf detection, CPU
// reference: CpuBackend::sum_squares), the bias gradient's column sums (CPU
// reference: the dbias loop of CpuBackend::linear_backward, including its
// `accumulate` semantics), and the fixed-order final pass shared by every
// reducing kernel. No atomics: results are deterministic run to run.
//
// Why these shapes (docs/ARCHITECTURE.md, "Reduction shapes", works the sizes out):
// - sum_squares reads 4 bytes per element once and writes one double per block.
//   Each thread issues kSumUnroll independent 16-byte loads before it adds any,
//   so a warp keeps enough bytes in flight to saturate device memory. The grid is
//   n / 4096 blocks (one unrolled round per thread) up to kReduceBlocks, one
//   resident wave. The grid depends on n alone (never on the GPU), so the bits do too.
// - column_sums reads dout (B, OUT) once. Rows are split across blocks as well
//   as columns (column_splits: ~kReduceBlocks blocks in all), each thread keeps
//   kColUnroll row loads in flight, and a second pass adds the splits' partial
//   sums in split order (no atomics): a narrow head runs many short blocks instead
//   of one block walking long chains of dependent loads. The partials (splits x
//   OUT floats, <= kColumnPartialsSize) are scratch the backend allocates once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace kernels {

namespace {

// Fixed pairwise order over N accumulators (N a power of two): the same bits
// whichever of them the compiler keeps in flight.
template <typename T, int N>
__device__ __forceinline__ T pairwise_sum(T (&acc)[N]) {
  static_assert((N & (N - 1)) == 0, "N must be a power of two");
#pragma unroll
  for (int width = N / 2; width > 0; width /= 2)
#pragma unroll
    for (int i = 0; i < width; ++i) acc[i] += acc[i + width];
  return acc[0];
}

// --- sum of squares ------------------------------------------------------------
// x (n) is read as n / 4 quads (4 consecutive floats) and n % 4 trailing floats.
// Quad q belongs to thread q mod P (P: threads in the grid, a function of n) and
// to its accumulator (q / P) mod kSumUnroll; a warp's float4 loads cover 512
// contiguous bytes. The pointer's alignment only picks how a quad is loaded (one
// 16-byte load when x is 16-byte aligned, four 4-byte loads otherwise), never
// which accumulator it joins: the bits depend on the input and n alone, so ranks
// holding the same gradients agree on the norm wherever their buffers start.
// A float's square is exact in double, so FMA contraction cannot change a bit.
constexpr int kSumUnroll = 4;  // independent 16-byte loads in flight per thread

template <bool kAligned>
__device__ __forceinline__ float4 load_quad(const float* __restrict__ x, size_t q) {
  if (kAligned) return reinterpret_cast<const float4*>(x)[q];
  const float* p = x + 4 * q;
  return make_float4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ double add_squares(double acc, float4 v) {
  acc += double(v.x) * v.x;
  acc += double(v.y) * v.y;
  acc += double(v.z) * v.z;
  acc += double(v.w) * v.w;
  return acc;
}

// partials[block] = sum of x^2 over the block's quads (and, block 0, the tail).
template <bool kAligned>
__global__ void sum_squares_kernel(double* __restrict__ partials, const float* __restrict__ x, size_t n) {
  __shared__ double smem[kThreads];
  const size_t quads = n / 4, stride = size_t(gridDim.x) * blockDim.x;
  size_t q = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  double acc[kSumUnroll] = {};
  // Every load of a round is issued before the first add that needs one.
  for (; q + (kSumUnroll - 1) * stride < quads; q += kSumUnroll * stride) {
    float4 v[kSumUnroll];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) v[u] = load_quad<kAligned>(x, q + u * stride);
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) acc[u] = add_squares(acc[u], v[u]);
  }
#pragma unroll
  for (int u = 0; u < kSumUnroll; ++u)
    if (q + u * stride < quads) acc[u] = add_squares(acc[u], load_quad<kAligned>(x, q + u * stride));
  if (blockIdx.x == 0 && threadIdx.x < n % 4) {
    const float t = x[4 * quads + threadIdx.x];
    acc[0] += double(t) * t;
  }
  const double sum = block_sum(pairwise_sum(acc), smem);
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

// --- column sums ---------------------------------------------------------------
// Block (kColTile, kColRows): a warp reads kColTile consecutive floats of one
// row (128 contiguous bytes); blockIdx.y picks a stretch of rows (a split).
constexpr int kColTile = 32, kColRows = 8;
constexpr int kColUnroll = 8;  // independent row loads in flight per thread
// At most one unrolled round per thread in the second pass (its rows are splits).
constexpr int kColMaxSplits = kColRows * kColUnroll;
static_assert(kColumnPartialsSize >= 2 * kReduceBlocks * kColTile, "see kColumnPartialsSize");

// in (rows, OUT), split y = blockIdx.y = rows [y r, min(rows, (y + 1) r)) with
// r = rows_per_split. Thread (tx, ty) sums column tile * kColTile + tx over the
// split's rows ty, ty + kColRows, ... (kColUnroll independent loads a round,
// each into its own accumulator, so none waits for another), then ty = 0 adds
// the kColRows sums in order. One split (gridDim.y == 1):
// out (OUT) = the sums (added to out when accumulate); several: out
// (gridDim.y, OUT), row y the split's sums, for a second pass over them.
__global__ void column_sums_kernel(float* __restrict__ out, const float* __restrict__ in, int rows, int OUT,
                                   int rows_per_split, bool accumulate) {
  __shared__ float smem[kColRows][kColTile + 1];
  const int j = blockIdx.x * kColTile + threadIdx.x;
  const int r0 = blockIdx.y * rows_per_split, r1 = rows - r0 < rows_per_split ? rows : r0 + rows_per_split;
  float acc[kColUnroll] = {};
  if (j < OUT) {
    const float* col = in + j;
    int b = r0 + threadIdx.y;
    for (; b + (kColUnroll - 1) * kColRows < r1; b += kColUnroll * kColRows) {
      float v[kColUnroll];
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) v[u] = col[size_t(b + u * kColRows) * OUT];
#pragma unroll
      for (int u = 0; u < kColUnroll; ++u) acc[u] += v[u];
    }
#pragma unroll
    for (int u = 0; u < kColUnroll; ++u)
      if (b + u * kColRows < r1) acc[u] += col[size_t(b + u * kColRows) * OUT];
  }
  smem[threadIdx.y][threadIdx.x] = pairwise_sum(acc);
  __syncthreads();
  if (threadIdx.y == 0 && j < OUT) {
    float total = 0.0f;
    for (int r = 0; r < kColRows; ++r) total += smem[r][threadIdx.x];
    if (gridDim.y > 1)
      out[size_t(blockIdx.y) * OUT + j] = total;
    else
      out[j] = accumulate ? out[j] + total : total;
  }
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Row splits of column_sums (B, OUT): enough blocks in all to fill the GPU
// (about kReduceBlocks), at least one unrolled round of rows per thread, at most
// one round in the second pass, within the scratch. A function of (B, OUT) only.
int column_splits(int B, int OUT) {
  int splits = ceil_div(kReduceBlocks, ceil_div(OUT, kColTile));
  splits = std::min({splits, ceil_div(B, kColRows * kColUnroll), kColMaxSplits, kColumnPartialsSize / OUT});
  return std::max(splits, 1);
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
  // One unrolled round per thread until the grid is full (kReduceBlocks).
  const int blocks = reduce_blocks(n, size_t(kThreads) * 4 * kSumUnroll);
  if (reinterpret_cast<uintptr_t>(x) % alignof(float4) == 0)
    MGPU_LAUNCH(sum_squares_kernel<true>, blocks, kThreads, 0, stream)(partials, x, n);
  else
    MGPU_LAUNCH(sum_squares_kernel<false>, blocks, kThreads, 0, stream)(partials, x, n);
  MGPU_CUDA_CHECK_LAUNCH("sum_squares_kernel");
  FinalizeArgs f;
  f.partials = partials;
  f.nblocks = blocks;
  f.out_d = out;
  finalize_partials(f, stream);
}

void column_sums(float* dbias, const float* dout, int B, int OUT, bool accumulate, float* scratch,
                 cudaStream_t stream) {
  if (OUT <= 0) return;
  const int splits = column_splits(B, OUT);
  const dim3 block(kColTile, kColRows);
  const unsigned tiles = static_cast<unsigned>(ceil_div(OUT, kColTile));
  if (splits == 1) {
    MGPU_LAUNCH(column_sums_kernel, dim3(tiles, 1), block, 0, stream)(dbias, dout, B, OUT, B, accumulate);
    MGPU_CUDA_CHECK_LAUNCH("column_sums_kernel");
    return;
  }
  MGPU_LAUNCH(column_sums_kernel, dim3(tiles, splits), block, 0, stream)
  (scratch, dout, B, OUT, ceil_div(B, splits), false);
  MGPU_CUDA_CHECK_LAUNCH("column_sums_kernel");
  // The second pass: column sums of the (splits, OUT) partials, in split order.
  MGPU_LAUNCH(column_sums_kernel, dim3(tiles, 1), block, 0, stream)(dbias, scratch, splits, OUT, splits, accumulate);
  MGPU_CUDA_CHECK_LAUNCH("column_sums_kernel");
}

}  // namespace kernels
}  // namespace mgpu
