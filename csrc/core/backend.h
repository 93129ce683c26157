// Backend: the seam between the model/optimizer logic (written once, in
// csrc/core) and the hardware. A backend owns memory and implements every
// numeric kernel the MLP, its losses and its optimizers need. CPU: csrc/cpu,
// CUDA: csrc/cuda. All pointers passed to a backend are its own memory
// ("device" memory; host memory for the CPU backend). Matrices are row-major.
#pragma once
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "errors.h"
#include "numbered_queue.h"
#include "step_verdict.h"

namespace mgpu {

// The error every backend raises for cross-entropy labels outside [0, C):
// `first_row` is the smallest such row, `count` how many there were.
inline std::string label_range_error(long long first_row, int label, int C, unsigned long long count) {
  return detail::concat("cross_entropy: label ", label, " at row ", first_row, " is out of range [0, ", C, ")",
                        count > 1 ? detail::concat(" (", count, " rows had such labels)") : std::string(),
                        "; those rows were left out of the loss and its gradient");
}

// Identifies the dropout mask of one layer for one slice of the global batch.
// With G = dropout_groups(C), unit j of global sample i is kept iff
// uniform01(word j / G of philox(seed, counter = {j % G, i, layer, step})) >= p.
// Keyed by the global sample index, the mask does not depend on how the batch
// is split across ranks; every backend implements this same definition.
struct DropoutKey {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t layer = 0;
  int64_t first_sample = 0;  // global index of row 0 of this rank's shard
};

// An optimizer update's values that change from step to step (the rest of
// its hyper-parameters never do): computed on the host by update_scalars()
// from SgdParams / AdamWParams, and read by a replayed capture from backend
// memory instead of those it was captured with.
struct UpdateScalars {
  float lr = 0.0f;
  int32_t first_step = 0;     // SGD with momentum: the buffer starts as this step's gradient
  float step_size = 0.0f;     // AdamW: lr / (1 - beta1^t)
  float inv_sqrt_bc2 = 1.0f;  // AdamW: 1 / sqrt(1 - beta2^t)
  float decay = 1.0f;         // AdamW: 1 - lr * weight_decay (decoupled decay)
};

// What a replayed capture reads from backend memory instead of the arguments
// it was captured with (see Backend::replay): the dropout key's step and first
// sample, the losses' grad_scale (loss scale / global normaliser), and, where
// the capture holds the step's tail, the loss scale the verdict divides by
// and the update's per-step values.
struct ReplayArgs {
  uint64_t step = 0;
  int64_t first_sample = 0;
  float grad_scale = 1.0f;
  float loss_scale = 1.0f;
  UpdateScalars update;
};

// Philox counters per row of C units: each counter yields 4 words.
inline int dropout_groups(int C) { return (C + 3) / 4; }

// fp32; tf32 (fp32 storage, tensor-core GEMMs); bf16 and fp16 mixed precision
// (half-precision GEMM inputs, fp32 accumulation and master weights; fp16 needs
// loss scaling, see StepOptions).
enum class Precision { kFP32, kTF32, kBF16, kFP16 };
Precision parse_precision(const std::string& name);
std::string precision_name(Precision precision);

struct SgdParams {
  float lr = 0.01f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool first_step = true;  // PyTorch initialises the momentum buffer to the first gradient
  // Applied to each gradient as it is read (fp32, before weight decay): the
  // step's unscale and clip factor, which would otherwise cost a pass of its own.
  float grad_scale = 1.0f;
  // (backend memory) When set, the update runs only where verdict->apply, and
  // verdict->factor replaces grad_scale: decided on the backend, no host wait.
  const StepVerdict* verdict = nullptr;
};

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  int64_t step = 1;                      // 1-based, for bias correction
  float grad_scale = 1.0f;               // as SgdParams::grad_scale
  const StepVerdict* verdict = nullptr;  // as SgdParams::verdict
};

// The per-step values, computed once on the host (bias corrections in double)
// for every backend, captured or not, so their updates agree bit for bit.
inline UpdateScalars update_scalars(const SgdParams& hp) {
  UpdateScalars s;
  s.lr = hp.lr;
  s.first_step = hp.first_step ? 1 : 0;
  return s;
}
inline UpdateScalars update_scalars(const AdamWParams& hp) {
  const double t = static_cast<double>(hp.step);
  UpdateScalars s;
  s.lr = hp.lr;
  s.step_size = static_cast<float>(hp.lr / (1.0 - std::pow(double(hp.beta1), t)));
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double(hp.beta2), t)));
  // In double: the product of two floats is exact there, so one rounding whatever
  // the compiler contracts (nvcc's host pass and g++ -march=native differ).
  s.decay = static_cast<float>(1.0 - double(hp.lr) * double(hp.weight_decay));
  return s;
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // True when backend memory is ordinary host memory (no staging copies needed).
  virtual bool host_accessible() const = 0;
  virtual void set_threads(int threads) = 0;
  virtual int threads() const = 0;

  // Memory. copy_to_backend may return before the copy ran, but host_src may
  // be reused at once; copy_to_host returns with the values (a device backend
  // waits for its queued work first: the step's one synchronisation).
  virtual void* allocate_bytes(size_t bytes) = 0;
  virtual void free_bytes(void* ptr) noexcept = 0;
  virtual void copy_to_backend(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  // copy_to_backend for the step's inputs, which must never wait for queued
  // work, not even inside the driver (which may, for pageable sources): a device
  // backend copies host_src into pinned staging memory of its own and queues the
  // copy from there.
  virtual void stage_to_backend(void* dst, const void* host_src, size_t bytes) {
    copy_to_backend(dst, host_src, bytes);
  }
  virtual void zero(float* x, size_t n) = 0;
  virtual void synchronize() = 0;

  // Host staging that never waits for the device (StagedCommunicator: MPI
  // beside a GPU). allocate_host: host memory a device copies to and from
  // while the host runs on (CUDA: pinned). The _async copies are queued in
  // order with the backend's work and return at once (a host backend copies
  // at once); the host memory must stay untouched until a fence queued after
  // the copy has passed. fence() marks the work queued so far; fence_passed
  // says, without waiting, whether it has all run; wait_fence waits for it.
  virtual void* allocate_host(size_t bytes) { return ::operator new(bytes); }
  virtual void free_host(void* ptr) noexcept { ::operator delete(ptr); }
  virtual void copy_to_host_async(void* host_dst, const void* src, size_t bytes) { copy_to_host(host_dst, src, bytes); }
  virtual void copy_to_backend_async(void* dst, const void* host_src, size_t bytes) {
    copy_to_backend(dst, host_src, bytes);
  }
  // Input prefetch: host rows copied into backend memory beside the compute work (device
  // backends: on a copy stream of their own, through pinned staging), so that the next
  // step's rows cross while this step computes. prefetch_to_backend returns once host_src
  // may be reused, and its copy starts after the compute work queued up to the last
  // prefetch_read() (which the caller calls once the compute work that reads or allocates
  // the destinations is queued; before any, after all the compute work queued before it);
  // wait_prefetched() orders later compute work after every prefetch so far.
  // Host backends: a copy, and nothing to wait for.
  virtual void prefetch_to_backend(void* dst, const void* host_src, size_t bytes) {
    copy_to_backend(dst, host_src, bytes);
  }
  virtual void prefetch_read() {}
  virtual void wait_prefetched() {}
  // dst = src (bytes) within backend memory, queued in order with the compute work.
  virtual void copy_within_backend(void* dst, const void* src, size_t bytes) = 0;

  virtual uint64_t fence() { return 0; }
  virtual bool fence_passed(uint64_t fence) {
    (void)fence;
    return true;
  }
  virtual void wait_fence(uint64_t fence) { (void)fence; }

  // src (n, W), index (rows) -> dst (rows, W): dst row r = src row index[r], rows of W 4-byte
  // words (float features or targets, int32 labels). A step's rows gathered from a dataset
  // resident in the backend's memory; every index is in [0, n) (ResidentData checks it).
  virtual void gather_rows(void* dst, const void* src, const int64_t* index, int rows, int W) = 0;

  // Linear layer. inp (B, IN), weight (OUT, IN), bias (OUT) -> out (B, OUT) = inp weight^T + bias
  virtual void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B, int IN,
                              int OUT) = 0;
  // dout (B, OUT) -> dweight (OUT, IN) = dout^T inp, dbias (OUT) = column sums of dout,
  // dinp (B, IN) = dout weight (skipped when dinp is null: the first layer needs none).
  // accumulate: dweight and dbias are added to (gradient accumulation) instead of overwritten.
  virtual void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, int B, int IN, int OUT, bool accumulate) = 0;

  // In place on h (B, C): h = relu(h), then inverted dropout with keep-probability 1-p.
  // A NaN stays NaN, as in PyTorch: a diverging step shows in its loss, not only in its gradients.
  virtual void relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key) = 0;
  // dh (n) *= d(relu_dropout)/dh given the forward output h (n): a unit passed
  // the gradient iff its output is not <= 0 (dropped and negative units are 0; a NaN
  // passes it, as PyTorch's threshold_backward does).
  virtual void relu_dropout_backward(float* dh, const float* h, size_t n, float p) = 0;

  // Losses on a shard of B rows. Each writes grad_scale * (sum of per-element
  // (MSE) or per-sample (CE) losses) to *loss_out, and, when dpred is not null,
  // dpred = grad_scale * d(sum)/dpred. With grad_scale = 1/normaliser these are
  // this shard's contributions to the global mean and its gradient.
  // pred (B, D), target (B, D)
  virtual void mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B, int D,
                                    float grad_scale) = 0;
  // logits (B, C), labels (B) in [0, C); *correct_out (nullable) counts argmax hits.
  // A row whose label is outside [0, C) is left out (no loss, no hit, a zero
  // gradient row) and the backend throws ConfigError(label_range_error(...)):
  // a host backend on return, a device backend from its next synchronising
  // call (copy_to_host, synchronize, sum_squares), as the kernel runs later.
  virtual void cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out, const float* logits,
                                              const int32_t* labels, int B, int C, float grad_scale) = 0;

  // Optimizers, elementwise over n parameters.
  virtual void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp) = 0;
  virtual void adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                            const AdamWParams& hp) = 0;

  // The step's health check and its decision, on the backend (no host wait):
  // verdict->sum_squares = sum of grads^2 (n), then decide_step() from the
  // loss and stop slots (`slots`, 2 floats), loss_scale and max_norm. The
  // update is refused when *comm_failed (Communicator::failure_flag, nullable)
  // is nonzero as this runs, and on a device backend when a loss kernel of
  // this step found invalid labels (it throws at its next synchronisation).
  // Captured, it reads loss_scale from the replay's ReplayArgs.
  virtual void step_verdict(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale,
                            float max_norm, const int* comm_failed) = 0;

  // A sharded step's health check (StepOptions::shard_optimizer), in two halves
  // around an all-gather of every rank's kShardSums floats: this rank's share
  // into `sums` (its loss and stop slots and the sum of squares of its shard's
  // n reduced gradients, see write_shard_sums), then the verdict from all
  // ranks' shares (decide_sharded_step). Captured, the second reads loss_scale
  // from the replay's ReplayArgs, as step_verdict does.
  virtual void shard_health_sums(float* sums, const float* grads, size_t n, const float* slots) = 0;
  virtual void step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale,
                                        float max_norm, const int* comm_failed) = 0;

  // Helpers for accumulation, clipping, loss scaling and health checks.
  // sum_squares is NaN/Inf when any element is.
  virtual double sum_squares(const float* x, size_t n) = 0;
  virtual void scale(float* x, size_t n, float alpha) = 0;
  // Gradient compression: x (n) fp32 -> half (n two-byte values of `dtype`,
  // kBF16 or kFP16; round to nearest even, beyond fp16's range +-Inf), and back (exact).
  virtual void narrow(void* half, const float* x, size_t n, Precision dtype) = 0;
  virtual void widen(float* x, const void* half, size_t n, Precision dtype) = 0;
  // For their implementations: true for kBF16, false for kFP16, ConfigError otherwise.
  static bool is_bf16_not_fp16(Precision dtype, const char* what) {
    MGPU_CHECK(dtype == Precision::kBF16 || dtype == Precision::kFP16, ConfigError, what,
               ": the half type is bf16 or fp16, not ", precision_name(dtype));
    return dtype == Precision::kBF16;
  }
  virtual void axpy(float* y, const float* x, size_t n, float alpha) = 0;  // y += alpha x

  // The model's parameters (fp32 master weights, n values). A backend whose
  // GEMMs read half-precision operands keeps a half copy of them, which the
  // optimizer update refreshes as it writes each parameter, instead of casting
  // every weight at every GEMM. Writes to the parameters by anything but this
  // backend (a communicator's broadcast) must be announced: parameters_changed(),
  // or of values [offset, offset + count) only (a sharded step's gather, layer by layer).
  virtual void set_master_weights(const float* params, size_t n) {
    (void)params;
    (void)n;
  }
  virtual void parameters_changed(size_t offset, size_t count) {
    (void)offset;
    (void)count;
  }
  void parameters_changed() { parameters_changed(0, static_cast<size_t>(-1)); }

  // Arithmetic of the linear layers. Parameters, gradients and optimizer state
  // stay fp32 (master weights) whatever the precision; backends that cannot
  // honour a precision throw ConfigError.
  virtual void set_precision(Precision precision) {
    MGPU_CHECK(precision == Precision::kFP32, ConfigError, "the ", name(), " backend computes in fp32 only (asked for ",
               precision_name(precision), ")");
  }
  virtual Precision precision() const { return Precision::kFP32; }

  // Step capture (CUDA graphs), for small models whose step is bound by kernel
  // launches. The work issued between begin_capture() and end_capture() is
  // recorded instead of run; replay(graph, args) runs it again with one launch.
  // While capturing nothing may synchronise, allocate or copy to or from the
  // host, and the captured dropout and loss kernels read ReplayArgs from backend
  // memory (written by replay) instead of their DropoutKey's step and first
  // sample and their grad_scale, so one graph serves every step, every
  // micro-batch of a shape and every loss scale. A
  // backend releases its graphs (capture_generation() changes) whenever memory
  // they use may move: scratch growth, precision changes, release_captures().
  virtual bool supports_capture() const { return false; }
  virtual void begin_capture() { throw ConfigError("the " + name() + " backend cannot capture steps (CUDA graphs)"); }
  virtual int end_capture() { throw ConfigError("no capture in progress"); }
  // Ends a capture that failed half-way; the stream is usable again afterwards.
  virtual void abort_capture() noexcept {}
  virtual void replay(int graph, const ReplayArgs& args) {
    (void)graph;
    (void)args;
    throw ConfigError("the " + name() + " backend has no captured steps");
  }
  virtual void release_captures() {}
  virtual uint64_t capture_generation() const { return 0; }

  // Trace marks (train --trace): timestamps in order with the backend's work,
  // so a step's phases are timed without synchronising anything. trace_mark()
  // stands for the moment the work queued before it has run (a host backend:
  // now; CUDA: an event on the compute stream). trace_clock_mark() stands for
  // "now" even while queued work still runs (CUDA: an event on an idle stream
  // of its own); read the host clock beside it to place the other marks on
  // the host's timeline. trace_elapsed(from, to): seconds from one mark to the
  // other, NaN while either has not happened yet (never waits). Marks are
  // numbered in the order they were taken; trace_forget(before) lets the
  // backend reuse those numbered below `before`. Never while capturing.
  virtual uint64_t trace_mark() { return host_mark(); }
  virtual uint64_t trace_clock_mark() { return host_mark(); }
  virtual double trace_elapsed(uint64_t from, uint64_t to) {
    const double *a = host_marks_.find(from), *b = host_marks_.find(to);
    return a && b ? *b - *a : std::numeric_limits<double>::quiet_NaN();
  }
  virtual void trace_forget(uint64_t before) { host_marks_.drop_before(before); }

 private:
  uint64_t host_mark() {
    return host_marks_.push(std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count());
  }
  NumberedQueue<double> host_marks_;  // the default trace marks: host clock readings
};

// Owning, move-only array in a backend's memory.
template <typename T>
class BackendArray {
 public:
  BackendArray() = default;
  BackendArray(Backend* backend, size_t n) : backend_(backend), size_(n) {
    if (n) data_ = static_cast<T*>(backend_->allocate_bytes(n * sizeof(T)));
  }
  ~BackendArray() { release(); }
  BackendArray(const BackendArray&) = delete;
  BackendArray& operator=(const BackendArray&) = delete;
  BackendArray(BackendArray&& o) noexcept { *this = std::move(o); }
  BackendArray& operator=(BackendArray&& o) noexcept {
    if (this != &o) {
      release();
      backend_ = std::exchange(o.backend_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release() noexcept {
    if (data_) backend_->free_bytes(data_);
    data_ = nullptr;
    size_ = 0;
  }
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Factory: "cpu" (always), "cuda" (when built with CUDA). Throws DeviceError otherwise.
std::shared_ptr<Backend> make_backend(const std::string& device, int device_index, int threads);

}  // namespace mgpu
