// Optimizer step logic, written once; the per-element math is the backend's.
#include "optimizer.h"

#include <algorithm>
#include <cmath>

#include "errors.h"

namespace mgpu {

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adamw") return OptimizerKind::kAdamW;
  throw ConfigError("unknown optimizer '" + name + "' (expected 'sgd' or 'adamw')");
}

Optimizer::Optimizer(std::shared_ptr<Backend> backend, size_t num_params, const OptimizerConfig& config)
    : backend_(std::move(backend)), num_params_(num_params), n_(num_params), config_(config) {
  MGPU_CHECK(config_.weight_decay >= 0.0f, ConfigError, "weight_decay must be >= 0");
  if (config_.kind == OptimizerKind::kSGD) {
    MGPU_CHECK(config_.momentum >= 0.0f && config_.momentum < 1.0f, ConfigError, "momentum must be in [0, 1), got ",
               config_.momentum);
  } else {
    MGPU_CHECK(config_.beta1 >= 0.0f && config_.beta1 < 1.0f && config_.beta2 >= 0.0f && config_.beta2 < 1.0f,
               ConfigError, "AdamW betas must be in [0, 1)");
    MGPU_CHECK(config_.eps > 0.0f, ConfigError, "AdamW eps must be > 0");
  }
}

void Optimizer::allocate_state() {
  const size_t states = state_names().size();
  if (states == 0 || state0_.size() == n_) return;
  state0_ = BackendArray<float>(backend_.get(), n_);
  backend_->zero(state0_.data(), n_);
  if (states == 2) {
    state1_ = BackendArray<float>(backend_.get(), n_);
    backend_->zero(state1_.data(), n_);
  }
}

void Optimizer::restrict_to(size_t offset, size_t count) {
  MGPU_CHECK(offset <= num_params_ && count <= num_params_ - offset, ConfigError, "optimizer shard [", offset, ", ",
             offset + count, ") outside its ", num_params_, " parameters");
  MGPU_CHECK(offset >= offset_ && offset + count <= offset_ + n_, ConfigError,
             "an optimizer shard must lie within the parameters it holds state for");
  std::vector<std::vector<float>> kept;
  if (state0_.size()) {  // slice the state held so far
    for (const std::string& name : state_names()) {
      std::vector<float> whole(n_);
      get_state(name, whole.data());
      kept.emplace_back(whole.begin() + static_cast<std::ptrdiff_t>(offset - offset_),
                        whole.begin() + static_cast<std::ptrdiff_t>(offset - offset_ + count));
    }
  }
  state0_ = BackendArray<float>();
  state1_ = BackendArray<float>();
  offset_ = offset;
  n_ = count;
  std::vector<std::string> names = state_names();
  for (size_t i = 0; i < kept.size(); ++i) set_state(names[i], kept[i].data());
}

SgdParams Optimizer::sgd_params(float lr) const {
  return SgdParams{lr, config_.momentum, config_.weight_decay, steps_ == 0, 1.0f};
}

AdamWParams Optimizer::adamw_params(float lr) const {
  return AdamWParams{lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, steps_ + 1, 1.0f};
}

void Optimizer::check_lr(float lr) {
  MGPU_CHECK(lr >= 0.0f && std::isfinite(lr), ConfigError, "learning rate must be a finite number >= 0, got ", lr);
}

UpdateScalars Optimizer::next_scalars(float lr) const {
  check_lr(lr);
  return config_.kind == OptimizerKind::kSGD ? update_scalars(sgd_params(lr)) : update_scalars(adamw_params(lr));
}

void Optimizer::step(float* params, const float* grads, float lr, const StepVerdict* verdict) {
  check_lr(lr);
  MGPU_CHECK(verdict, ConfigError, "an optimizer step needs the step's verdict");
  allocate_state();
  params += offset_;
  grads += offset_;
  if (config_.kind == OptimizerKind::kSGD) {
    SgdParams hp = sgd_params(lr);
    hp.verdict = verdict;
    backend_->sgd_update(params, grads, state0_.data(), n_, hp);
  } else {
    AdamWParams hp = adamw_params(lr);
    hp.verdict = verdict;
    backend_->adamw_update(params, grads, state0_.data(), state1_.data(), n_, hp);
  }
}

std::vector<std::string> Optimizer::state_names() const {
  if (config_.kind == OptimizerKind::kSGD)
    return config_.momentum > 0.0f ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  return {"exp_avg", "exp_avg_sq"};
}

BackendArray<float>& Optimizer::state(const std::string& name) {
  if (config_.kind == OptimizerKind::kSGD && config_.momentum > 0.0f && name == "momentum_buffer") return state0_;
  if (config_.kind == OptimizerKind::kAdamW && name == "exp_avg") return state0_;
  if (config_.kind == OptimizerKind::kAdamW && name == "exp_avg_sq") return state1_;
  throw ConfigError("optimizer has no state named '" + name + "'");
}

void Optimizer::get_state(const std::string& name, float* host_dst) {
  BackendArray<float>& s = state(name);  // checks the name first
  if (!s.size()) {                       // never used: all zeros
    std::fill(host_dst, host_dst + n_, 0.0f);
    return;
  }
  backend_->copy_to_host(host_dst, s.data(), n_ * sizeof(float));
}
void Optimizer::set_state(const std::string& name, const float* host_src) {
  state(name);
  allocate_state();
  backend_->copy_to_backend(state(name).data(), host_src, n_ * sizeof(float));
}

}  // namespace mgpu
