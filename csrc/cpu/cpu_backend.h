// CPU backend: sgemm for the linear layers (OpenBLAS, or oneDNN's JIT sgemm for
// small products where it is faster: see CpuGemm), OpenMP-parallel vectorisable
// loops for everything elementwise. The reference every other backend's kernels
// are tested against.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "../core/backend.h"
#include "../core/capture_registry.h"

namespace mgpu {

// Which library computes a GEMM. kAuto is a rule of the shape and the CPU's vector
// width, never a timing, so a run's results never depend on the machine's load:
// - AVX2 CPUs: oneDNN for products of at most kOneDnnMaxWork multiply-adds (its JIT
//   kernels win there), OpenBLAS above (equal or better). On more threads OpenBLAS
//   takes them all: idle OpenMP workers sleep there (mgpu's OMP_WAIT_POLICY=passive, for
//   OpenBLAS's threads' sake), and each small oneDNN call would begin by waking one.
// - AVX-512 CPUs: oneDNN. On one thread, OpenBLAS keeps products narrower than
//   kOneDnnMinWidthAvx512 output columns (a narrow output layer, a narrow weight
//   gradient). On more threads oneDNN takes them too: OpenBLAS's worker threads spin
//   after a call, and oneDNN's OpenMP team would find one core taken.
// docs/benchmarks.md and docs/journal.md have the measurements behind each choice.
// MGPU_CPU_GEMM=auto|openblas|onednn picks for the process.
enum class CpuGemm { kAuto, kOpenBlas, kOneDnn };
constexpr double kOneDnnMaxWork = double(1 << 22);
constexpr int kOneDnnMinWidthAvx512 = 64;
bool cpu_has_avx512();  // the CPU's, at run time (not what mgpu was compiled for)
// kAuto's choice for a row-major (M, N, K) product, C (M, N) = A (M, K) B (K, N),
// computed with `threads` threads.
CpuGemm auto_cpu_gemm(int M, int N, int K, int threads, bool avx512, bool onednn);
bool onednn_available();
std::string onednn_version();                     // "" without oneDNN
CpuGemm parse_cpu_gemm(const std::string& name);  // throws ConfigError
const char* cpu_gemm_name(CpuGemm gemm);

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads);
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }
  void set_threads(int threads) override;
  int threads() const override { return threads_; }
  void set_gemm(CpuGemm gemm);  // throws ConfigError for oneDNN in a build without it
  CpuGemm gemm() const { return gemm_; }
  // The library that computes an (M, N, K) product under the current setting.
  CpuGemm gemm_library(int M, int N, int K) const;

  void* allocate_bytes(size_t bytes) override;
  void free_bytes(void* ptr) noexcept override;
  void copy_to_backend(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void zero(float* x, size_t n) override;
  void synchronize() override {}

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B, int IN,
                      int OUT) override;
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int B, int IN, int OUT, bool accumulate) override;
  void relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key) override;
  void relu_dropout_backward(float* dh, const float* h, size_t n, float p) override;
  void mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B, int D,
                            float grad_scale) override;
  void cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out, const float* logits,
                                      const int32_t* labels, int B, int C, float grad_scale) override;
  void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp) override;
  void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                    const AdamWParams& hp) override;
  void step_verdict(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale,
                    float max_norm, const int* comm_failed) override;
  void shard_health_sums(float* sums, const float* grads, size_t n, const float* slots) override;
  void step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale,
                                float max_norm, const int* comm_failed) override;
  double sum_squares(const float* x, size_t n) override;
  void scale(float* x, size_t n, float alpha) override;
  void narrow(void* half, const float* x, size_t n, Precision dtype) override;
  void widen(float* x, const void* half, size_t n, Precision dtype) override;
  void axpy(float* y, const float* x, size_t n, float alpha) override;
  void gather_rows(void* dst, const void* src, const int64_t* index, int rows, int W) override;
  void copy_within_backend(void* dst, const void* src, size_t bytes) override;

  // Capture as a list of recorded calls, replayed in order: nothing to gain on a
  // CPU, but it is the reference the CUDA graphs are checked against, and it
  // lets the step's capture logic be tested where there is no GPU. Steps use it
  // only when asked (StepOptions::Graph::kOn).
  bool supports_capture() const override { return true; }
  void begin_capture() override;
  int end_capture() override;
  void abort_capture() noexcept override;
  void replay(int graph, const ReplayArgs& args) override;
  void release_captures() override;
  uint64_t capture_generation() const override { return captures_.generation(); }

 private:
  // While capturing: record `call` and return true (the caller returns at once).
  bool record(std::function<void()> call);
  void refuse_in_capture(const char* what) const;
  // The updates with their per-step values given (the host's, or a replay's).
  void sgd_apply(float* param, const float* grad, float* buf, size_t n, const SgdParams& hp, const UpdateScalars& s);
  void adamw_apply(float* param, const float* grad, float* m, float* v, size_t n, const AdamWParams& hp,
                   const UpdateScalars& s);
  double sum_of_squares(const float* x, size_t n) const;  // deterministic for a fixed thread count
  void decide(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale, float max_norm,
              const int* comm_failed);
  // Row-major C (M, N) = op(A) op(B) + beta C, op = transpose where asked.
  void sgemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
             float beta, float* C, int ldc);

  int threads_ = 1;
  CpuGemm gemm_ = CpuGemm::kAuto;
  CaptureRegistry<std::vector<std::function<void()>>> captures_;
  std::vector<std::function<void()>> recording_;  // of the capture in progress
  ReplayArgs replay_args_;                        // those of the replay in progress (read by the recorded calls)
};

// Number of hardware threads this process may use (affinity-aware).
int available_cpu_threads();

}  // namespace mgpu
