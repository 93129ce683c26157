// Model: a multi-layer perceptron (Linear, ReLU [, Dropout], ..., Linear) whose
// parameters and gradients each live in one flat backend buffer, in PyTorch
// nn.Linear order [W0 (out, in), b0 (out), W1, b1, ...]; layers are views.
// The math runs through a Backend, so this file is the whole model for every
// device. The gradient buffer has one extra slot after the parameters holding
// the loss, so the loss travels in the same allreduce as the gradients.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace mgpu {

enum class LossKind { kMSE, kCrossEntropy };
LossKind parse_loss(const std::string& name);
std::string loss_name(LossKind loss);

class ResidentData;  // resident_data.h

// ConfigError naming the first of `rows` class labels outside [0, classes).
void check_labels(const int32_t* labels, int64_t rows, int classes);

// One batch (or one rank's shard of it) in host memory.
struct HostBatch {
  const float* x = nullptr;         // (rows, in_features)
  const float* targets = nullptr;   // (rows, out_features), MSE
  const int32_t* labels = nullptr;  // (rows), cross-entropy
  int rows = 0;
};

class MLP {
 public:
  // sizes = [in, hidden..., out]; dropout in [0, 1) after every hidden ReLU.
  MLP(std::shared_ptr<Backend> backend, std::vector<int> sizes, float dropout, uint64_t seed);
  // A prefetch still in flight is waited for, so its buffers are freed after it.
  ~MLP();

  Backend& backend() { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }
  const std::vector<int>& sizes() const { return sizes_; }
  int num_layers() const { return static_cast<int>(sizes_.size()) - 1; }
  int in_features() const { return sizes_.front(); }
  int out_features() const { return sizes_.back(); }
  float dropout() const { return dropout_; }
  uint64_t seed() const { return seed_; }
  size_t num_params() const { return num_params_; }
  size_t weight_offset(int layer) const { return offsets_[layer]; }
  size_t bias_offset(int layer) const {
    return offsets_[layer] + static_cast<size_t>(sizes_[layer]) * sizes_[layer + 1];
  }
  size_t layer_end(int layer) const { return offsets_[layer + 1]; }

  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }
  // Extra slots after the gradients, summed by the same allreduce: the loss, and
  // the number of ranks asking to stop (a signal arrived) so all agree when.
  float* loss_slot() { return grads_.data() + num_params_; }
  float* stop_slot() { return grads_.data() + num_params_ + 1; }
  static constexpr size_t kGradExtraSlots = 2;
  // predict and evaluate run at most this many rows at a time, so that a large
  // validation set grows the activation buffers no further (train's memory check
  // prices activations at this many rows when it evaluates).
  static constexpr int kEvalChunkRows = 1024;
  size_t grad_buffer_size() const { return num_params_ + kGradExtraSlots; }

  // Re-draw the parameters from `seed` (PyTorch nn.Linear's default
  // distribution: U(-1/sqrt(in), 1/sqrt(in)) for weights and biases).
  void initialize(uint64_t seed);
  void get_parameters(float* host_dst);
  void set_parameters(const float* host_src);
  void get_gradients(float* host_dst);

  // Copies (or, for host backends, points at) the batch; validates labels.
  // own_copy: copy on host backends too, into buffers whose addresses stay put
  // (a captured step replays with the addresses it was captured with).
  void stage(const HostBatch& batch, LossKind loss, bool own_copy = false);
  // Gathers rows order[order_offset, order_offset + rows) of a dataset resident in
  // this model's backend into the staged buffers (addresses that stay put, as with
  // own_copy): no host memory is read. Its labels were checked when it was made.
  void stage_rows(const ResidentData& data, int64_t order_offset, int rows, LossKind loss);
  // ConfigError unless stage_rows can take those rows (the data's backend, features, loss, range).
  void check_rows(const ResidentData& data, int64_t order_offset, int rows, LossKind loss) const;
  // Copies a later step's rows into buffers of their own beside the compute work
  // (Backend::prefetch_to_backend; labels checked now); stage_prefetched then stages rows
  // [offset, offset + rows) of them, until the next prefetch or discard_prefetch().
  void prefetch(const HostBatch& batch, LossKind loss);
  // ConfigError unless prefetch can take batch (rows, the loss's targets or labels, their range).
  void check_prefetch(const HostBatch& batch, LossKind loss) const;
  void stage_prefetched(int64_t offset, int rows, LossKind loss);
  int64_t prefetched_rows() const { return prefetched_rows_; }
  void discard_prefetch() { prefetched_rows_ = 0; }
  // Parameters another stream is still writing (a sharded step's all-gather,
  // overlapping the next forward layer by layer): wait(l) makes this backend's
  // later work wait for layer l's values, wait(-1) for all of them, the host
  // waiting and failures raised. Until then every call here that reads or writes
  // parameters waits for them all first, except forward(..., by_layer = true),
  // which waits for each layer just before its GEMM.
  void defer_parameter_writes(std::function<void(int)> wait);
  void await_deferred_layers();  // each layer not yet waited for: wait(l), the host not waiting
  void await_parameters();       // wait(-1) if anything is deferred
  bool parameters_deferred() const { return static_cast<bool>(deferred_wait_); }

  // Forward pass over the staged rows; dropout is active iff `dropout` is set.
  // Returns the output (rows, out_features) in backend memory. layer_done(l),
  // when given, is called once layer l's output is written (a trace marks it).
  const float* forward(int rows, const DropoutKey* dropout, const std::function<void(int)>& layer_done = nullptr,
                       bool by_layer = false);
  // Writes the loss contribution to loss_slot() (adds to it when accumulating)
  // and its gradient to the head of the backward chain (see Backend loss
  // semantics for grad_scale).
  void loss_forward_backward(LossKind loss, int rows, float grad_scale, float* correct_out, bool accumulate = false);
  // Backward pass; calls layer_done(l) once layer l's gradients are written,
  // from the last layer to the first. accumulate: add to grads() instead of
  // overwriting them (micro-steps of gradient accumulation).
  void backward(int rows, const std::function<void(int)>& layer_done, bool accumulate = false);

  // Local (no communication) conveniences for the Python API.
  // Mean loss of the batch; fills grads() with its gradient.
  float loss_and_grad(const HostBatch& batch, LossKind loss, uint64_t step, int64_t first_sample);
  // Evaluation-mode output (rows, out) into host_out.
  void predict(const float* x, int rows, float* host_out);
  // Sum of per-sample losses (MSE: per-element sum) and argmax hits (CE) over
  // the batch, evaluated in chunks without dropout.
  std::pair<double, int64_t> evaluate(const HostBatch& batch, LossKind loss);

 private:
  void ensure_capacity(int rows);
  void ensure_staging();  // staged_* at capacity_
  float* output() { return activations_.back().data(); }
  float layer_dropout(int layer) const { return layer + 1 < num_layers() ? dropout_ : 0.0f; }
  void await_layer(int layer);

  std::shared_ptr<Backend> backend_;
  std::vector<int> sizes_;
  float dropout_;
  uint64_t seed_;
  std::vector<size_t> offsets_;  // offsets_[l] = start of layer l; offsets_[L] = num_params
  size_t num_params_ = 0;
  BackendArray<float> params_, grads_;

  int capacity_ = 0;
  std::vector<BackendArray<float>> activations_;  // output of layer l, (capacity, sizes[l+1])
  BackendArray<float> dact_[2];                   // ping-pong activation gradients
  BackendArray<float> staged_x_, staged_targets_;
  BackendArray<int32_t> staged_labels_;
  BackendArray<float> prefetched_x_, prefetched_targets_;  // prefetch()'s rows, at their own capacity
  BackendArray<int32_t> prefetched_labels_;
  int64_t prefetched_rows_ = 0;           // rows there not yet discarded (0: none)
  bool prefetched_targets_kind_ = false;  // the prefetched rows carry float targets (else labels)
  BackendArray<float> scratch_;           // loss/correct outputs outside training
  const float* input_ = nullptr;
  const float* targets_ = nullptr;
  const int32_t* labels_ = nullptr;
  std::function<void(int)> deferred_wait_;  // defer_parameter_writes' wait; empty once all were waited for
  std::vector<char> deferred_;              // per layer: not yet waited for
  int deferred_layers_ = 0;
};

}  // namespace mgpu
