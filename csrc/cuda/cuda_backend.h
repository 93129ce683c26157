// CUDA backend: cuBLAS GEMMs and the kernels of kernels/ on one compute stream
// owned by the backend. Device memory from cudaMalloc (half-precision GEMM operands
// stream-ordered, cudaMallocAsync); scratch buffers (reduction
// partials, half-precision GEMM operands, the cuBLAS workspace) are allocated
// once and grow only when a larger shape first appears, so a training step in
// steady state allocates nothing. Every CUDA/cuBLAS failure throws DeviceError.
// Included by CUDA translation units only: the bindings use cuda_api.h.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <unordered_map>
#include <vector>

#include "../../kernels/kernels.cuh"
#include "../core/backend.h"
#include "../core/capture_registry.h"
#include "../core/numbered_queue.h"

namespace mgpu {

// Events numbered in the order they were recorded (trace marks, fences);
// forgotten ones are recorded again later.
class NumberedEvents {
 public:
  explicit NumberedEvents(unsigned flags) : flags_(flags) {}
  uint64_t record(cudaStream_t stream);
  cudaEvent_t find(uint64_t number) const {  // null once forgotten (or never recorded)
    const cudaEvent_t* e = events_.find(number);
    return e ? *e : nullptr;
  }
  bool forgotten(uint64_t number) const { return events_.dropped(number); }
  void forget_before(uint64_t number) {
    events_.drop_before(number, [this](cudaEvent_t e) { spare_.push_back(e); });
  }
  void destroy() noexcept;

 private:
  unsigned flags_;
  NumberedQueue<cudaEvent_t> events_;
  std::vector<cudaEvent_t> spare_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  bool host_accessible() const override { return false; }
  // Host threads do not matter to a GPU backend; kept for the interface.
  void set_threads(int threads) override;
  int threads() const override { return threads_; }

  void* allocate_bytes(size_t bytes) override;
  void free_bytes(void* ptr) noexcept override;
  // Both copies are complete when they return (they synchronise the compute
  // stream), so host buffers may be reused or read at once.
  void copy_to_backend(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void stage_to_backend(void* dst, const void* host_src, size_t bytes) override;
  void zero(float* x, size_t n) override;
  void synchronize() override;
  // Pinned host memory, copies queued on the compute stream, and fences
  // (events without timing) on it: see Backend.
  void* allocate_host(size_t bytes) override;
  void free_host(void* ptr) noexcept override;
  void copy_to_host_async(void* host_dst, const void* src, size_t bytes) override;
  void copy_to_backend_async(void* dst, const void* host_src, size_t bytes) override;
  uint64_t fence() override;
  bool fence_passed(uint64_t fence) override;
  void wait_fence(uint64_t fence) override;

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
  void prefetch_to_backend(void* dst, const void* host_src, size_t bytes) override;
  void prefetch_read() override;
  void wait_prefetched() override;
  void copy_within_backend(void* dst, const void* src, size_t bytes) override;

  void set_precision(Precision precision) override;
  Precision precision() const override { return precision_; }
  void set_master_weights(const float* params, size_t n) override;
  void parameters_changed(size_t offset, size_t count) override { stale_master_half(offset, count); }

  // CUDA graphs of the backend's stream (see Backend): instantiated once,
  // replayed with their ReplayArgs stored to replay_dev_ ahead of each launch.
  bool supports_capture() const override { return true; }
  void begin_capture() override;
  int end_capture() override;
  void abort_capture() noexcept override;
  void replay(int graph, const ReplayArgs& args) override;
  void release_captures() override;
  uint64_t capture_generation() const override { return captures_.generation(); }

  // Trace marks (see Backend): timing events on the compute stream, and the
  // clock mark on an idle stream of the backend's own, so it fires at once.
  uint64_t trace_mark() override { return record_mark(stream_); }
  uint64_t trace_clock_mark() override;
  double trace_elapsed(uint64_t from, uint64_t to) override;
  void trace_forget(uint64_t before) override;

  int device() const { return device_; }
  // The stream every kernel and GEMM of this backend runs on; a communicator
  // orders its collectives after it with events.
  cudaStream_t stream() const { return stream_; }

 private:
  void activate() const;
  // The GEMM operand `src` (n floats) in the precision's input type: src itself
  // for fp32/tf32; else the weights' persistent half copy, src's half operand
  // (see below: produced with it, or cast at its first use and kept), or a
  // bf16/fp16 copy in scratch `slot` (0 or 1) when there can be none.
  const void* gemm_input(int slot, const float* src, size_t n);
  // Half operands: bf16/fp16 copies of fp32 GEMM operands other than the
  // weights (activations, their gradients, the inputs), keyed by the fp32
  // array. The kernels producing activations and their gradients (ReLU and
  // dropout, forward and backward) write the copy as they write each value;
  // other operands are cast at their first use; every later GEMM reads the
  // copy, until a write to the fp32 values (writes()) makes it stale. Before a
  // capture, when it ends or fails (it recorded, ran nothing) and after a
  // replay all are stale: a graph makes its own.
  struct HalfOperand {
    const float* base = nullptr;
    size_t capacity = 0;  // elements of `half`
    size_t valid = 0;     // elements from base the copy holds; 0: stale
    void* half = nullptr;
  };
  // base's entry with room for n elements (grown outside captures), or null.
  HalfOperand* half_operand(const float* base, size_t n);
  kernels::HalfShadow produce_half_operand(float* base, size_t n);  // for a producing kernel; then mark it
  void stale_half_operands(const void* dst, size_t bytes);          // those overlapping dst: stale
  void stale_all_half_operands() noexcept;
  void free_half_operands(const void* allocation) noexcept;  // those within an allocation going
  // The precision's half type (bf16 or fp16): dst (n two-byte values) = src cast on the stream;
  // an array of n of them, stream-ordered (`what` names it in the error); `half`
  // (of `capacity`) replaced by one of n, the graphs that use it released first.
  void cast_half(void* dst, const float* src, size_t n);
  void* allocate_half(size_t n, const char* what);
  void regrow_half(void*& half, size_t& capacity, size_t n, const char* what);
  // Column-major C (m, n) = op(A) op(B) + beta C, fp32 output, inputs from gemm_input.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda, const void* B,
            int ldb, float beta, float* C, int ldc);
  void release() noexcept;
  // Throws the ConfigError of cross-entropy labels out of range that kernels
  // recorded (kernels::LabelErrors) since the last check; call after a
  // synchronisation of the stream.
  void raise_label_errors();
  // The persistent half copy of the master weights (see Backend::set_master_weights):
  // allocated while the precision is bf16/fp16, fresh once a cast or a full
  // update has written it since the parameters last changed.
  void size_master_half();                                   // allocate or free it for the precision
  const void* master_half_view(const float* src, size_t n);  // src's part of it, or null
  // Values [first, first + count) of it cast anew where stale (never inside a capture), or all of them.
  void refresh_master_half(size_t first, size_t count);
  void refresh_master_half() { refresh_master_half(0, master_n_); }
  void stale_master_half(size_t first, size_t count);  // clipped to master_n_
  void writes(const void* dst, size_t bytes);          // the half copies of what dst overlaps go stale
  void drained() { staging_used_ = 0; }                // the stream ran dry: its staged copies are done
  void ensure_copy_stream();  // the prefetch stream, its events and its areas' events, on first use
  char* pinned_slot(char*& area, size_t& capacity, std::vector<char*>& outgrown, size_t used, size_t need,
                    const char* what);
  uint64_t record_mark(cudaStream_t stream);
  kernels::HalfShadow shadow_for_update(const float* param, size_t n);
  // Where kernels being captured read their ReplayArgs; null outside a capture.
  const ReplayArgs* captured_args() const { return captures_.capturing() ? replay_dev_ : nullptr; }

  int device_ = 0;
  int threads_ = 1;
  Precision precision_ = Precision::kFP32;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;
  double* partials_ = nullptr;        // kernels::kPartialsSize doubles
  float* column_partials_ = nullptr;  // kernels::kColumnPartialsSize floats (column_sums)
  double* sum_out_ = nullptr;         // device result of sum_squares
  void* half_[2] = {nullptr, nullptr};
  size_t half_capacity_[2] = {0, 0};  // elements
  std::vector<HalfOperand> half_operands_;
  bool reuse_half_operands_ = true;  // MGPU_CUDA_HALF_OPERANDS=0: a cast at every use (the reference)
  std::unordered_map<const void*, size_t> allocation_bytes_;  // of allocate_bytes, until freed
  CaptureRegistry<cudaGraphExec_t> captures_;
  ReplayArgs* replay_dev_ = nullptr;  // what captured kernels read (set by each replay)
  const float* master_ = nullptr;     // the model's parameters (master_n_ floats)
  size_t master_n_ = 0;
  void* master_half_ = nullptr;  // master_n_ two-byte values of the precision
  size_t master_half_n_ = 0;     // the values master_half_ has room for
  // Ranges [first, end) of it older than the parameters, disjoint and in order: a
  // sharded step's gather makes each layer's stale, and its forward refreshes each
  // layer's only once that layer arrived.
  std::vector<std::pair<size_t, size_t>> master_half_stale_;
  // Pinned staging of stage_to_backend: filled from the start after each point
  // where the stream has run dry (a synchronisation), so a region is never
  // rewritten under a pending copy; a chunk outgrown while copies may be pending
  // is kept until the backend goes (cudaFreeHost can synchronise the device).
  char* staging_ = nullptr;
  size_t staging_capacity_ = 0, staging_used_ = 0;
  std::vector<char*> staging_outgrown_;
  // Prefetch (prefetch_to_backend): its own stream, and two pinned areas used by turns, a
  // batch each (the prefetches between two wait_prefetched()): an area is refilled once
  // its last batch's copies are done (`done`; in a training loop long done: a step's
  // synchronisation passed them), so the host never waits on a steady step.
  // prefetch_read_ marks the compute work a prefetch must follow (the last reader of the
  // destinations, not the step's tail, so the copy overlaps the step); prefetched_ the last copy.
  struct PinnedArea {
    char* data = nullptr;
    size_t capacity = 0;
    std::vector<char*> outgrown;
    cudaEvent_t done = nullptr;
  };
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t prefetch_read_ = nullptr, prefetched_ = nullptr;
  bool prefetch_read_marked_ = false;  // prefetch_read() was called: prefetch_read_ holds its mark
  PinnedArea prefetch_areas_[2];
  int prefetch_area_ = 0;
  size_t prefetch_used_ = 0;
  bool prefetch_waited_ = true;             // wait_prefetched() since the last prefetch: the next one starts a batch
  NumberedEvents marks_{cudaEventDefault};  // trace marks: timing events
  cudaStream_t clock_stream_ = nullptr;     // trace_clock_mark's: nothing else runs on it
  NumberedEvents fences_{cudaEventDisableTiming};  // fences not yet seen passed
  kernels::LabelErrors label_errors_;              // device: 2 values, host: 3 pinned values
};

}  // namespace mgpu
