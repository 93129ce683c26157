// The MLP written once against the Backend interface (see model.h).
#include "model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "async_signals.h"
#include "errors.h"
#include "philox.h"
#include "resident_data.h"

namespace mgpu {

LossKind parse_loss(const std::string& name) {
  if (name == "mse") return LossKind::kMSE;
  if (name == "cross_entropy") return LossKind::kCrossEntropy;
  throw ConfigError("unknown loss '" + name + "' (expected 'mse' or 'cross_entropy')");
}

std::string loss_name(LossKind loss) { return loss == LossKind::kMSE ? "mse" : "cross_entropy"; }

void check_labels(const int32_t* labels, int64_t rows, int classes) {
  for (int64_t i = 0; i < rows; ++i)
    MGPU_CHECK(labels[i] >= 0 && labels[i] < classes, ConfigError, "label ", labels[i], " at row ", i,
               " is out of range [0, ", classes, ")");
}

MLP::MLP(std::shared_ptr<Backend> backend, std::vector<int> sizes, float dropout, uint64_t seed)
    : backend_(std::move(backend)), sizes_(std::move(sizes)), dropout_(dropout), seed_(seed) {
  MGPU_CHECK(backend_, ConfigError, "MLP needs a backend");
  MGPU_CHECK(sizes_.size() >= 2, ConfigError, "layers must list at least input and output sizes, got ", sizes_.size(),
             " entries");
  for (int s : sizes_) MGPU_CHECK(s >= 1, ConfigError, "every layer size must be >= 1, got ", s);
  MGPU_CHECK(dropout_ >= 0.0f && dropout_ < 1.0f, ConfigError, "dropout must be in [0, 1), got ", dropout_);
  offsets_.push_back(0);
  for (int l = 0; l < num_layers(); ++l) {
    const size_t n = static_cast<size_t>(sizes_[l]) * sizes_[l + 1] + sizes_[l + 1];
    offsets_.push_back(offsets_.back() + n);
  }
  num_params_ = offsets_.back();
  params_ = BackendArray<float>(backend_.get(), num_params_);
  backend_->set_master_weights(params_.data(), num_params_);
  grads_ = BackendArray<float>(backend_.get(), grad_buffer_size());
  scratch_ = BackendArray<float>(backend_.get(), 2);
  backend_->zero(grads_.data(), grads_.size());
  initialize(seed_);
}

MLP::~MLP() {
  try {
    await_deferred_layers();  // the parameters are freed in stream order after writes still deferred
  } catch (...) {             // a failed transport drained its stream when it failed
  }
  try {
    if (prefetched_x_.size()) backend_->wait_prefetched();
  } catch (...) {  // a failed device frees everything anyway
  }
}

void MLP::initialize(uint64_t seed) {
  // Drawn on the host from Philox so every rank and backend gets the same bits.
  std::vector<float> host(num_params_);
  for (int l = 0; l < num_layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(sizes_[l]));
    const size_t begin = offsets_[l], count = offsets_[l + 1] - offsets_[l];
    for (size_t i = 0; i < count; i += 4) {
      const Philox4 r = philox_draw(seed, RngStream::kInit, static_cast<uint32_t>(i >> 2),
                                    static_cast<uint32_t>(i >> 34), static_cast<uint32_t>(l), 0u);
      for (size_t k = 0; k < 4 && i + k < count; ++k) host[begin + i + k] = (2.0f * uniform01(r.v[k]) - 1.0f) * bound;
    }
  }
  set_parameters(host.data());
}

void MLP::get_parameters(float* host_dst) {
  await_parameters();
  backend_->copy_to_host(host_dst, params_.data(), num_params_ * sizeof(float));
}
void MLP::set_parameters(const float* host_src) {
  await_parameters();
  backend_->copy_to_backend(params_.data(), host_src, num_params_ * sizeof(float));
}

void MLP::defer_parameter_writes(std::function<void(int)> wait) {
  await_deferred_layers();  // earlier writes: waited for before the later ones can be
  deferred_wait_ = std::move(wait);
  deferred_.assign(static_cast<size_t>(num_layers()), deferred_wait_ ? 1 : 0);
  deferred_layers_ = deferred_wait_ ? num_layers() : 0;
}

void MLP::await_layer(int layer) {
  if (!deferred_wait_ || !deferred_[static_cast<size_t>(layer)]) return;
  // Marked first: a wait that throws is not tried again at every later forward.
  std::function<void(int)> wait = deferred_wait_;
  deferred_[static_cast<size_t>(layer)] = 0;
  if (--deferred_layers_ == 0) deferred_wait_ = nullptr;
  wait(layer);
}

void MLP::await_deferred_layers() {
  for (int l = 0; l < num_layers() && deferred_wait_; ++l) await_layer(l);
}

void MLP::await_parameters() {
  if (!deferred_wait_) return;
  std::function<void(int)> wait = std::move(deferred_wait_);
  deferred_wait_ = nullptr;
  deferred_.assign(deferred_.size(), 0);
  deferred_layers_ = 0;
  wait(-1);
}
void MLP::get_gradients(float* host_dst) {
  backend_->copy_to_host(host_dst, grads_.data(), num_params_ * sizeof(float));
}

void MLP::ensure_capacity(int rows) {
  if (rows <= capacity_) return;
  backend_->release_captures();  // captured steps point at the buffers about to move
  // Grow geometrically so a slowly growing batch does not reallocate every step.
  const int cap = std::max(rows, capacity_ + capacity_ / 2);
  activations_.clear();
  int widest = 0;
  for (int l = 0; l < num_layers(); ++l) {
    activations_.emplace_back(backend_.get(), static_cast<size_t>(cap) * sizes_[l + 1]);
    widest = std::max(widest, sizes_[l + 1]);
    if (l > 0) widest = std::max(widest, sizes_[l]);
  }
  for (auto& d : dact_) d = BackendArray<float>(backend_.get(), static_cast<size_t>(cap) * widest);
  // Staging buffers follow on first use at this capacity (host backends may never need them).
  staged_x_ = BackendArray<float>();
  staged_targets_ = BackendArray<float>();
  staged_labels_ = BackendArray<int32_t>();
  capacity_ = cap;
}

void MLP::ensure_staging() {
  if (staged_labels_.size() >= static_cast<size_t>(capacity_)) return;
  const size_t cap = static_cast<size_t>(capacity_);
  staged_x_ = BackendArray<float>(backend_.get(), cap * in_features());
  staged_targets_ = BackendArray<float>(backend_.get(), cap * out_features());
  staged_labels_ = BackendArray<int32_t>(backend_.get(), cap);
}

void MLP::stage(const HostBatch& batch, LossKind loss, bool own_copy) {
  MGPU_CHECK(batch.rows >= 0, ConfigError, "batch rows must be >= 0");
  ensure_capacity(std::max(batch.rows, 1));
  if (loss == LossKind::kCrossEntropy && batch.labels) check_labels(batch.labels, batch.rows, out_features());
  if (backend_->host_accessible() && !own_copy) {
    input_ = batch.x;
    targets_ = batch.targets;
    labels_ = batch.labels;
    return;
  }
  ensure_staging();
  const size_t rows = static_cast<size_t>(batch.rows);
  backend_->stage_to_backend(staged_x_.data(), batch.x, rows * in_features() * sizeof(float));
  input_ = staged_x_.data();
  targets_ = nullptr;
  labels_ = nullptr;
  if (batch.targets) {
    backend_->stage_to_backend(staged_targets_.data(), batch.targets, rows * out_features() * sizeof(float));
    targets_ = staged_targets_.data();
  }
  if (batch.labels) {
    backend_->stage_to_backend(staged_labels_.data(), batch.labels, rows * sizeof(int32_t));
    labels_ = staged_labels_.data();
  }
}

void MLP::check_rows(const ResidentData& data, int64_t order_offset, int rows, LossKind loss) const {
  MGPU_CHECK(data.backend() == backend_.get(), ConfigError, "resident data lives in another backend than the model's");
  MGPU_CHECK(data.in_features() == in_features() && data.out_features() == out_features(), ConfigError,
             "resident data of ", data.in_features(), " -> ", data.out_features(), " features does not fit a model of ",
             in_features(), " -> ", out_features());
  MGPU_CHECK(loss == LossKind::kCrossEntropy ? data.has_labels() : data.has_targets(), ConfigError,
             "resident data holds ", data.has_labels() ? "class labels" : "float targets", ", not what the ",
             loss_name(loss), " loss needs");
  MGPU_CHECK(rows >= 0 && order_offset >= 0 && order_offset + rows <= data.order_size(), ConfigError, "rows [",
             order_offset, ", ", order_offset + rows, ") are outside the resident order of ", data.order_size());
}

void MLP::stage_rows(const ResidentData& data, int64_t order_offset, int rows, LossKind loss) {
  check_rows(data, order_offset, rows, loss);
  ensure_capacity(std::max(rows, 1));
  ensure_staging();
  const int64_t* index = data.order() + order_offset;
  backend_->gather_rows(staged_x_.data(), data.x(), index, rows, in_features());
  input_ = staged_x_.data();
  targets_ = nullptr;
  labels_ = nullptr;
  if (data.has_targets()) {
    backend_->gather_rows(staged_targets_.data(), data.targets(), index, rows, out_features());
    targets_ = staged_targets_.data();
  } else {
    backend_->gather_rows(staged_labels_.data(), data.labels(), index, rows, 1);
    labels_ = staged_labels_.data();
  }
}

void MLP::check_prefetch(const HostBatch& batch, LossKind loss) const {
  MGPU_CHECK(batch.rows >= 1 && batch.x, ConfigError, "a prefetch needs at least one row of x");
  MGPU_CHECK(loss == LossKind::kCrossEntropy ? batch.labels != nullptr : batch.targets != nullptr, ConfigError,
             "a prefetch needs the ", loss_name(loss), " loss's ", loss == LossKind::kMSE ? "targets" : "labels");
  if (batch.labels) check_labels(batch.labels, batch.rows, out_features());
}

void MLP::prefetch(const HostBatch& batch, LossKind loss) {
  check_prefetch(batch, loss);
  const size_t rows = static_cast<size_t>(batch.rows);
  if (prefetched_x_.size() < rows * in_features()) {
    backend_->wait_prefetched();  // the buffers about to go may still be written
    prefetched_x_ = BackendArray<float>(backend_.get(), rows * in_features());
    prefetched_targets_ = BackendArray<float>(backend_.get(), rows * out_features());
    prefetched_labels_ = BackendArray<int32_t>(backend_.get(), rows);
    backend_->prefetch_read();  // the copies follow these allocations
  }
  backend_->prefetch_to_backend(prefetched_x_.data(), batch.x, rows * in_features() * sizeof(float));
  if (batch.targets)
    backend_->prefetch_to_backend(prefetched_targets_.data(), batch.targets, rows * out_features() * sizeof(float));
  else
    backend_->prefetch_to_backend(prefetched_labels_.data(), batch.labels, rows * sizeof(int32_t));
  prefetched_targets_kind_ = batch.targets != nullptr;
  prefetched_rows_ = batch.rows;
}

void MLP::stage_prefetched(int64_t offset, int rows, LossKind loss) {
  MGPU_CHECK(rows >= 0 && offset >= 0 && offset + rows <= prefetched_rows_, ConfigError, "rows [", offset, ", ",
             offset + rows, ") were not prefetched (", prefetched_rows_, " rows are)");
  MGPU_CHECK(prefetched_targets_kind_ == (loss == LossKind::kMSE), ConfigError, "the prefetched rows hold ",
             prefetched_targets_kind_ ? "float targets" : "class labels", ", not what the ", loss_name(loss),
             " loss needs");
  ensure_capacity(std::max(rows, 1));
  ensure_staging();
  backend_->wait_prefetched();
  const size_t first = static_cast<size_t>(offset), n = static_cast<size_t>(rows);
  // Into the staged buffers: their addresses stay put for captured steps.
  backend_->copy_within_backend(staged_x_.data(), prefetched_x_.data() + first * in_features(),
                                n * in_features() * sizeof(float));
  input_ = staged_x_.data();
  targets_ = nullptr;
  labels_ = nullptr;
  if (prefetched_targets_kind_) {
    backend_->copy_within_backend(staged_targets_.data(), prefetched_targets_.data() + first * out_features(),
                                  n * out_features() * sizeof(float));
    targets_ = staged_targets_.data();
  } else {
    backend_->copy_within_backend(staged_labels_.data(), prefetched_labels_.data() + first, n * sizeof(int32_t));
    labels_ = staged_labels_.data();
  }
  backend_->prefetch_read();  // the next batch may land once these copies have read this one
}

const float* MLP::forward(int rows, const DropoutKey* dropout, const std::function<void(int)>& layer_done,
                          bool by_layer) {
  if (!by_layer) await_parameters();
  const float* inp = input_;
  for (int l = 0; l < num_layers(); ++l) {
    if (by_layer) await_layer(l);
    float* out = activations_[l].data();
    const float* w = params_.data() + weight_offset(l);
    const float* b = params_.data() + bias_offset(l);
    // inp (rows, sizes[l]), w (sizes[l+1], sizes[l]) -> out (rows, sizes[l+1])
    backend_->linear_forward(out, inp, w, b, rows, sizes_[l], sizes_[l + 1]);
    if (l + 1 < num_layers()) {
      DropoutKey key = dropout ? *dropout : DropoutKey{};
      key.layer = static_cast<uint32_t>(l);
      backend_->relu_dropout_forward(out, rows, sizes_[l + 1], dropout ? layer_dropout(l) : 0.0f, key);
    }
    if (layer_done) layer_done(l);
    inp = out;
  }
  return output();
}

void MLP::loss_forward_backward(LossKind loss, int rows, float grad_scale, float* correct_out, bool accumulate) {
  float* dpred = dact_[(num_layers() - 1) % 2].data();
  float* loss_out = accumulate ? scratch_.data() : loss_slot();
  if (loss == LossKind::kMSE) {
    MGPU_CHECK(targets_, ConfigError, "mse loss needs float targets of shape (rows, ", out_features(), ")");
    backend_->mse_forward_backward(loss_out, dpred, output(), targets_, rows, out_features(), grad_scale);
  } else {
    MGPU_CHECK(labels_, ConfigError, "cross_entropy loss needs integer class labels");
    backend_->cross_entropy_forward_backward(loss_out, dpred, correct_out, output(), labels_, rows, out_features(),
                                             grad_scale);
  }
  if (accumulate) backend_->axpy(loss_slot(), loss_out, 1, 1.0f);
}

void MLP::backward(int rows, const std::function<void(int)>& layer_done, bool accumulate) {
  await_parameters();  // its forward waited already (then this is free)
  // dact_[l % 2] holds d(loss)/d(output of layer l); the parity matches the
  // buffer loss_forward_backward wrote for the last layer.
  for (int l = num_layers() - 1; l >= 0; --l) {
    const float* dout = dact_[l % 2].data();
    float* dinp = l > 0 ? dact_[(l - 1) % 2].data() : nullptr;
    const float* inp = l > 0 ? activations_[l - 1].data() : input_;
    backend_->linear_backward(dinp, grads_.data() + weight_offset(l), grads_.data() + bias_offset(l), dout, inp,
                              params_.data() + weight_offset(l), rows, sizes_[l], sizes_[l + 1], accumulate);
    if (l > 0)
      backend_->relu_dropout_backward(dinp, activations_[l - 1].data(), static_cast<size_t>(rows) * sizes_[l],
                                      layer_dropout(l - 1));
    if (layer_done) layer_done(l);
  }
}

float MLP::loss_and_grad(const HostBatch& batch, LossKind loss, uint64_t step, int64_t first_sample) {
  const AsynchronousSignalsHeld signals_after_the_call;  // async_signals.h
  MGPU_CHECK(batch.rows >= 1, ConfigError, "loss_and_grad needs at least one sample");
  stage(batch, loss);
  const DropoutKey key{seed_, step, 0, first_sample};
  forward(batch.rows, &key);
  const float normaliser = loss == LossKind::kMSE ? static_cast<float>(batch.rows) * out_features() : batch.rows;
  loss_forward_backward(loss, batch.rows, 1.0f / normaliser, nullptr);
  backward(batch.rows, nullptr);
  float value = 0.0f;
  backend_->copy_to_host(&value, loss_slot(), sizeof(float));
  return value;
}

void MLP::predict(const float* x, int rows, float* host_out) {
  const AsynchronousSignalsHeld signals_after_the_call;
  MGPU_CHECK(rows >= 0, ConfigError, "rows must be >= 0");
  for (int start = 0; start < rows; start += kEvalChunkRows) {
    const int chunk = std::min(kEvalChunkRows, rows - start);
    stage(HostBatch{x + static_cast<size_t>(start) * in_features(), nullptr, nullptr, chunk}, LossKind::kMSE);
    forward(chunk, nullptr);
    backend_->copy_to_host(host_out + static_cast<size_t>(start) * out_features(), output(),
                           static_cast<size_t>(chunk) * out_features() * sizeof(float));
  }
}

std::pair<double, int64_t> MLP::evaluate(const HostBatch& batch, LossKind loss) {
  const AsynchronousSignalsHeld signals_after_the_call;
  double loss_sum = 0.0;
  int64_t correct = 0;
  for (int start = 0; start < batch.rows; start += kEvalChunkRows) {
    const int rows = std::min(kEvalChunkRows, batch.rows - start);
    HostBatch chunk{batch.x + static_cast<size_t>(start) * in_features(),
                    batch.targets ? batch.targets + static_cast<size_t>(start) * out_features() : nullptr,
                    batch.labels ? batch.labels + start : nullptr, rows};
    stage(chunk, loss);
    forward(rows, nullptr);
    float* correct_dev = loss == LossKind::kCrossEntropy ? scratch_.data() + 1 : nullptr;
    if (loss == LossKind::kMSE) {
      MGPU_CHECK(targets_, ConfigError, "mse loss needs float targets");
      backend_->mse_forward_backward(scratch_.data(), nullptr, output(), targets_, rows, out_features(), 1.0f);
    } else {
      MGPU_CHECK(labels_, ConfigError, "cross_entropy loss needs integer class labels");
      backend_->cross_entropy_forward_backward(scratch_.data(), nullptr, correct_dev, output(), labels_, rows,
                                               out_features(), 1.0f);
    }
    float host[2] = {0.0f, 0.0f};
    backend_->copy_to_host(host, scratch_.data(), sizeof(host));
    loss_sum += host[0];
    if (correct_dev) correct += static_cast<int64_t>(host[1]);
  }
  return {loss_sum, correct};
}

}  // namespace mgpu
