// Launchers of the CUDA backend's kernels (one .cu file per family, llm.c
// style; each kernel names its CPU reference in csrc/cpu/cpu_backend.cpp).
// Every launcher enqueues on `stream` and returns without synchronising;
// launch errors throw DeviceError. Included by CUDA translation units only.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../csrc/core/backend.h"

namespace mgpu {
namespace kernels {

// Deterministic reductions write one partial per block (at most this many
// blocks, a function of the problem size only) and a single block sums them in
// a fixed order: same input, same bits, on any GPU. 528 blocks of 256 threads
// fill one wave of 4 blocks per SM on the GPU the kernels were sized for
// (reduce.cu says why; docs/ARCHITECTURE.md has the sizes).
constexpr int kReduceBlocks = 528;
// Doubles of scratch a backend must hand to the reducing launchers.
constexpr int kPartialsSize = 2 * kReduceBlocks + 8;
// Floats of scratch column_sums needs: its row splits' partial sums (splits x
// OUT; column_splits in reduce.cu keeps that below 2 * kReduceBlocks * 32).
constexpr int kColumnPartialsSize = 2 * kReduceBlocks * 32;

// elementwise.cu
// bias (C) -> out (B, C), every row a copy of bias (seeds out for a beta=1 GEMM).
void broadcast_rows(float* out, const float* bias, int B, int C, cudaStream_t stream);
void scale(float* x, size_t n, float alpha, cudaStream_t stream);
void axpy(float* y, const float* x, size_t n, float alpha, cudaStream_t stream);  // y += alpha x
// src (n, W), index (rows) -> dst (rows, W): dst row r = src row index[r] (4-byte words)
void gather_rows(uint32_t* dst, const uint32_t* src, const int64_t* index, int rows, int W, cudaStream_t stream);
// fp32 -> bf16 / fp16, round to nearest even (n elements; out holds 2-byte values).
void cast_to_bf16(void* out, const float* in, size_t n, cudaStream_t stream);
void cast_to_fp16(void* out, const float* in, size_t n, cudaStream_t stream);
// bf16 / fp16 -> fp32, exact (n elements).
void widen_from_bf16(float* out, const void* in, size_t n, cudaStream_t stream);
void widen_from_fp16(float* out, const void* in, size_t n, cudaStream_t stream);

// Where a kernel also writes each fp32 value it produces rounded to the GEMMs'
// half type (the backend's persistent half weights, its half operands), at the
// same index; out == nullptr: nowhere.
struct HalfShadow {
  void* out = nullptr;
  bool bf16 = true;  // else fp16
};

// dropout.cu
// h (B, C) in place: relu, then inverted dropout with the DropoutKey mask;
// replay (device, nullable) overrides key.step and key.first_sample, read when the kernel runs.
void relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key, cudaStream_t stream,
                          const ReplayArgs* replay = nullptr, HalfShadow shadow = {});
// *dst = args on the stream (what captured dropout and loss kernels read): the
// values are the launch's argument, fixed when enqueued, so consecutive calls
// never see each other's values.
void set_replay_args(ReplayArgs* dst, const ReplayArgs& args, cudaStream_t stream);
// dh (n) *= [h > 0] / (1 - p)
void relu_dropout_backward(float* dh, const float* h, size_t n, float p, cudaStream_t stream, HalfShadow shadow = {});
// Host execution of the exact per-element code the forward kernel runs
// (curand_Philox4x32_10 compiled for the host): mask (B, C) of 0 or 1/(1-p).
void dropout_mask_on_host(float* mask, int B, int C, float p, const DropoutKey& key);
// curand_Philox4x32_10 on the host, for comparing with mgpu's philox.h.
void curand_philox_on_host(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

// losses.cu (partials: kPartialsSize doubles of device scratch)
// pred (B, D), target (B, D) -> *loss_out = grad_scale * sum (pred - target)^2, dpred (nullable);
// replay (device, nullable) overrides grad_scale, read when the kernels run (as in cross entropy).
void mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B, int D,
                          float grad_scale, double* partials, cudaStream_t stream, const ReplayArgs* replay = nullptr);
// Labels outside [0, C) that cross_entropy_forward_backward met, for the host
// to report (Backend::cross_entropy_forward_backward). `device` (2 values,
// device memory) collects a launch's: count and the smallest (row << 32 | label
// bits), kNoLabelError when none; the launch's final pass folds them into `host`
// (3 values, pinned: count, that key of the first launch with any, its C) and
// resets `device`. The host reads `host` once the stream is synchronised.
struct LabelErrors {
  unsigned long long* device = nullptr;
  unsigned long long* host = nullptr;
};
constexpr unsigned long long kNoLabelError = ~0ull;
// logits (B, C), labels (B) -> *loss_out, dlogits (nullable), *correct_out (nullable);
// rows with a label outside [0, C) add nothing (zero gradient rows) and are
// recorded in `errors` (nullable members: not recorded).
void cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out, const float* logits,
                                    const int32_t* labels, int B, int C, float grad_scale, double* partials,
                                    const LabelErrors& errors, cudaStream_t stream, const ReplayArgs* replay = nullptr);

// optimizers.cu (HalfShadow: the parameters' half copy, written with them)
// replay (device, in a capture): the per-step values come from its `update`.
void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp,
                cudaStream_t stream, HalfShadow shadow = {}, const ReplayArgs* replay = nullptr);
void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n, const AdamWParams& hp,
                  cudaStream_t stream, HalfShadow shadow = {}, const ReplayArgs* replay = nullptr);
// decide_step on verdict (its sum_squares written before, in stream order);
// pending_label_errors and comm_failed (host-pinned, nullable): nonzero
// refuses the update; replay (device, in a capture): its loss_scale replaces loss_scale.
void step_verdict(StepVerdict* verdict, const float* slots, float loss_scale, float max_norm,
                  const unsigned long long* pending_label_errors, const int* comm_failed, cudaStream_t stream,
                  const ReplayArgs* replay = nullptr);

// A sharded step's health check (see step_verdict.h): sums (kShardSums) =
// slots (2) and *sum_squares (device double, written before in stream order);
// then the verdict from `ranks` ranks' sums, flags and replay as step_verdict.
void shard_health_sums(float* sums, const float* slots, const double* sum_squares, cudaStream_t stream);
void step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale, float max_norm,
                              const unsigned long long* pending_label_errors, const int* comm_failed,
                              cudaStream_t stream, const ReplayArgs* replay = nullptr);

// reduce.cu
// *out (device double) = sum x^2 (NaN/Inf propagate); partials: kPartialsSize doubles.
void sum_squares(double* out, const float* x, size_t n, double* partials, cudaStream_t stream);
// dout (B, OUT) -> dbias (OUT) = column sums (+= when accumulate); scratch:
// kColumnPartialsSize floats.
void column_sums(float* dbias, const float* dout, int B, int OUT, bool accumulate, float* scratch, cudaStream_t stream);
// Sums series s = 0..nseries-1 of `nblocks` partials each (series s at
// partials + s * kReduceBlocks) in a fixed order; writes out_f[s] = sum * scale[s]
// where out_f[s] is set, and *out_d = series 0 where out_d is set.
struct FinalizeArgs {
  const double* partials = nullptr;
  int nblocks = 1;
  int nseries = 1;
  float* out_f[2] = {nullptr, nullptr};
  float scale[2] = {1.0f, 1.0f};
  const ReplayArgs* replay = nullptr;  // (device) its grad_scale replaces scale[0] when set
  double* out_d = nullptr;
  LabelErrors label_errors;  // folded device -> host when both are set (cross entropy)
  int classes = 0;           // C of those labels
};
void finalize_partials(const FinalizeArgs& args, cudaStream_t stream);
// Blocks a reducing kernel over `work` items should use (1..kReduceBlocks).
int reduce_blocks(size_t work, size_t per_block);

}  // namespace kernels
}  // namespace mgpu
