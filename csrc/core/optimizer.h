// Optimizers over the flat parameter buffer: SGD (momentum, weight decay) and
// AdamW, with PyTorch's update rules. State lives in backend memory; it can be
// read and written for checkpoints.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace mgpu {

enum class OptimizerKind { kSGD, kAdamW };
OptimizerKind parse_optimizer(const std::string& name);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSGD;
  float momentum = 0.0f;                            // SGD
  float weight_decay = 0.0f;                        // SGD: L2 added to the gradient; AdamW: decoupled
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // AdamW
};

class Optimizer {
 public:
  Optimizer(std::shared_ptr<Backend> backend, size_t num_params, const OptimizerConfig& config);
  // Queues params -= update(verdict->factor * grads) at learning rate lr as
  // step steps_taken() + 1, run on the backend only where verdict->apply
  // (backend memory, written by Backend::step_verdict before it in stream
  // order): no host wait. The factor is applied as the update reads each
  // gradient (grads are left as they are): the step's unscale and clip cost no
  // pass of their own. Identical on every rank.
  void step(float* params, const float* grads, float lr, const StepVerdict* verdict);
  // Once the caller has read the verdict back: the step count advances when the update ran.
  void count_step(bool applied) { steps_ += applied ? 1 : 0; }
  // The values step() would use at lr, for a replayed capture of it (ReplayArgs::update).
  UpdateScalars next_scalars(float lr) const;

  const OptimizerConfig& config() const { return config_; }
  int64_t steps_taken() const { return steps_; }
  size_t num_params() const { return num_params_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // A sharded step (ZeRO-1) keeps state for its own shard only: from
  // restrict_to(offset, count) on, step() updates parameters [offset, offset +
  // count) of the buffers it is given, and each state holds count values (the
  // state so far is sliced). State is allocated at its first use, so a shard
  // never holds the whole state, even for a moment.
  void restrict_to(size_t offset, size_t count);
  size_t shard_offset() const { return offset_; }
  size_t state_size() const { return n_; }  // values each state holds: num_params() unless restricted
  // Checkpoint access: SGD has "momentum_buffer" (when momentum > 0); AdamW has
  // "exp_avg" and "exp_avg_sq". Each holds state_size() floats.
  std::vector<std::string> state_names() const;
  void get_state(const std::string& name, float* host_dst);
  void set_state(const std::string& name, const float* host_src);

 private:
  BackendArray<float>& state(const std::string& name);
  void allocate_state();           // zeroed state_size() floats per state, once
  static void check_lr(float lr);  // ConfigError unless finite and >= 0
  SgdParams sgd_params(float lr) const;
  AdamWParams adamw_params(float lr) const;

  std::shared_ptr<Backend> backend_;
  size_t num_params_;
  size_t offset_ = 0;
  size_t n_;
  OptimizerConfig config_;
  int64_t steps_ = 0;
  BackendArray<float> state0_, state1_;
};

}  // namespace mgpu
