// ResidentData: a training set copied once into a backend's memory, and the order
// its rows are drawn in (an epoch's permutation, copied once an epoch), so that a
// step gathers its rows there (Backend::gather_rows) instead of copying them from
// the host every step.
#pragma once
#include <cstdint>
#include <memory>

#include "backend.h"
#include "model.h"

namespace mgpu {

class ResidentData {
 public:
  // all: every row (x, and targets or labels; labels checked in [0, out_features)).
  ResidentData(std::shared_ptr<Backend> backend, const HostBatch& all, int in_features, int out_features);

  // The order rows are drawn in: order[i] in [0, rows()) for each of n entries (checked).
  // Stream-ordered after the steps queued before it, which read the previous order.
  void set_order(const int64_t* host_order, int64_t n);

  int64_t rows() const { return rows_; }
  int64_t order_size() const { return order_size_; }
  int in_features() const { return in_features_; }
  int out_features() const { return out_features_; }
  bool has_targets() const { return targets_.size() > 0; }
  bool has_labels() const { return labels_.size() > 0; }
  // What it holds in the backend's memory (the order at its capacity).
  size_t bytes() const;
  const Backend* backend() const { return backend_.get(); }

  const float* x() const { return x_.data(); }
  const float* targets() const { return targets_.data(); }
  const int32_t* labels() const { return labels_.data(); }
  const int64_t* order() const { return order_.data(); }

 private:
  std::shared_ptr<Backend> backend_;
  int64_t rows_ = 0;
  int in_features_ = 0, out_features_ = 0;
  BackendArray<float> x_, targets_;
  BackendArray<int32_t> labels_;
  BackendArray<int64_t> order_;
  int64_t order_size_ = 0;
};

}  // namespace mgpu
