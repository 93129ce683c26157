// Optimizer step logic, written once; the per-element math is the backend's.
#include "optimizer.h"

#include <cmath>

#include "errors.h"

namespace mgpu {

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adamw") return OptimizerKind::kAdamW;
  throw ConfigError("unknown optimizer '" + name + "' (expected 'sgd' or 'adamw')");
}

Optimizer::Optimizer(std::shared_ptr<Backend> backend, size_t num_params, const OptimizerConfig& config)
    : backend_(std::move(backend)), n_(num_params), config_(config) {
  MGPU_CHECK(config_.weight_decay >= 0.0f, ConfigError, "weight_decay must be >= 0");
  if (config_.kind == OptimizerKind::kSGD) {
    MGPU_CHECK(config_.momentum >= 0.0f && config_.momentum < 1.0f, ConfigError, "momentum must be in [0, 1), got ",
               config_.momentum);
    if (config_.momentum > 0.0f) {
      state0_ = BackendArray<float>(backend_.get(), n_);
      backend_->zero(state0_.data(), n_);
    }
  } else {
    MGPU_CHECK(config_.beta1 >= 0.0f && config_.beta1 < 1.0f && config_.beta2 >= 0.0f && config_.beta2 < 1.0f,
               ConfigError, "AdamW betas must be in [0, 1)");
    MGPU_CHECK(config_.eps > 0.0f, ConfigError, "AdamW eps must be > 0");
    state0_ = BackendArray<float>(backend_.get(), n_);
    state1_ = BackendArray<float>(backend_.get(), n_);
    backend_->zero(state0_.data(), n_);
    backend_->zero(state1_.data(), n_);
  }
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
  backend_->copy_to_host(host_dst, state(name).data(), n_ * sizeof(float));
}
void Optimizer::set_state(const std::string& name, const float* host_src) {
  backend_->copy_to_backend(state(name).data(), host_src, n_ * sizeof(float));
}

}  // namespace mgpu
