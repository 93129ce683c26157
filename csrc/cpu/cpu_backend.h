// CPU backend: BLAS sgemm (OpenBLAS) for the linear layers, OpenMP-parallel
// vectorisable loops for everything elementwise. The reference every other
// backend's kernels are tested against.
#pragma once
#include <functional>
#include <vector>

#include "../core/backend.h"
#include "../core/capture_registry.h"

namespace mgpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads);
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }
  void set_threads(int threads) override;
  int threads() const override { return threads_; }

  void* allocate_bytes(size_t bytes) override;
  void free_bytes(void* ptr) noexcept override;
  void copy_to_backend(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void zero(float* x, size_t n) override;
  void synchronize() override {}

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B,
                      int IN, int OUT) override;
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int B, int IN, int OUT,
                       bool accumulate) override;
  void relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key) override;
  void relu_dropout_backward(float* dh, const float* h, size_t n, float p) override;
  void mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target,
                            int B, int D, float grad_scale) override;
  void cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out,
                                      const float* logits, const int32_t* labels, int B, int C,
                                      float grad_scale) override;
  void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n,
                  const SgdParams& hp) override;
  void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                    const AdamWParams& hp) override;
  double sum_squares(const float* x, size_t n) override;
  void scale(float* x, size_t n, float alpha) override;
  void narrow(void* half, const float* x, size_t n, Precision dtype) override;
  void widen(float* x, const void* half, size_t n, Precision dtype) override;
  void axpy(float* y, const float* x, size_t n, float alpha) override;

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

  int threads_ = 1;
  CaptureRegistry<std::vector<std::function<void()>>> captures_;
  std::vector<std::function<void()>> recording_;  // of the capture in progress
  ReplayArgs replay_args_;  // those of the replay in progress (read by the recorded calls)
};

// Number of hardware threads this process may use (affinity-aware).
int available_cpu_threads();

}  // namespace mgpu
