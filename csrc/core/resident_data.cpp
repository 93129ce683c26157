// ResidentData (resident_data.h): the checks, the one copy of the rows, the order.
#include "resident_data.h"

#include <vector>

#include "errors.h"

namespace mgpu {

ResidentData::ResidentData(std::shared_ptr<Backend> backend, const HostBatch& all, int in_features, int out_features)
    : backend_(std::move(backend)), rows_(all.rows), in_features_(in_features), out_features_(out_features) {
  MGPU_CHECK(backend_ != nullptr, ConfigError, "resident data needs a backend");
  MGPU_CHECK(all.rows >= 1 && all.x, ConfigError, "resident data needs at least one row of x");
  MGPU_CHECK(in_features >= 1 && out_features >= 1, ConfigError, "resident data needs in and out features >= 1");
  MGPU_CHECK((all.targets != nullptr) != (all.labels != nullptr), ConfigError,
             "resident data holds either float targets or int32 labels");
  if (all.labels) check_labels(all.labels, rows_, out_features);
  const size_t rows = static_cast<size_t>(rows_);
  x_ = BackendArray<float>(backend_.get(), rows * in_features);
  backend_->copy_to_backend(x_.data(), all.x, x_.size() * sizeof(float));
  if (all.targets) {
    targets_ = BackendArray<float>(backend_.get(), rows * out_features);
    backend_->copy_to_backend(targets_.data(), all.targets, targets_.size() * sizeof(float));
  } else {
    labels_ = BackendArray<int32_t>(backend_.get(), rows);
    backend_->copy_to_backend(labels_.data(), all.labels, labels_.size() * sizeof(int32_t));
  }
}

void ResidentData::set_order(const int64_t* host_order, int64_t n) {
  MGPU_CHECK(n >= 1 && host_order, ConfigError, "an order needs at least one row");
  for (int64_t i = 0; i < n; ++i)
    MGPU_CHECK(host_order[i] >= 0 && host_order[i] < rows_, ConfigError, "order entry ", i, " is row ", host_order[i],
               ", outside the ", rows_, " resident rows");
  order_size_ = 0;  // no step may gather by an order a failed copy left half written
  if (order_.size() < static_cast<size_t>(n)) order_ = BackendArray<int64_t>(backend_.get(), static_cast<size_t>(n));
  backend_->copy_to_backend(order_.data(), host_order, static_cast<size_t>(n) * sizeof(int64_t));
  order_size_ = n;
}

size_t ResidentData::bytes() const {
  return x_.size() * sizeof(float) + targets_.size() * sizeof(float) + labels_.size() * sizeof(int32_t) +
         order_.size() * sizeof(int64_t);
}

}  // namespace mgpu
