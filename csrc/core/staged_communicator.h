// StagedCommunicator: lets a host-memory transport (MPI) serve a device
// backend (CUDA). Each collective copies its range of backend memory to a host
// buffer, runs the wrapped communicator on it and copies the result back;
// async ranges are copied out when launched (after the backward kernels that
// wrote them, since copy_to_host synchronises the compute stream) and copied
// back in wait_all(). Host buffers are kept per launch slot and only grow, so
// steady-state steps allocate nothing. DataParallelStep wraps a communicator in
// one when the backend is not host-accessible and the communicator does not
// accept device memory.
#pragma once
#include <memory>
#include <vector>

#include "backend.h"
#include "communicator.h"

namespace mgpu {

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> inner, std::shared_ptr<Backend> backend)
      : inner_(std::move(inner)), backend_(std::move(backend)) {
    timeout_seconds_ = inner_->timeout();
  }
  std::string name() const override { return inner_->name() + "+staged"; }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  bool accepts_device_memory() const override { return true; }

  void allreduce_sum(float* data, size_t count) override {
    float* host = slot(pending_.size(), count);
    backend_->copy_to_host(host, data, count * sizeof(float));
    inner_->allreduce_sum(host, count);
    backend_->copy_to_backend(data, host, count * sizeof(float));
  }
  void broadcast(float* data, size_t count, int root) override {
    float* host = slot(pending_.size(), count);
    if (inner_->rank() == root) backend_->copy_to_host(host, data, count * sizeof(float));
    inner_->broadcast(host, count, root);
    backend_->copy_to_backend(data, host, count * sizeof(float));
  }
  void barrier() override { inner_->barrier(); }
  void allreduce_sum_async(float* data, size_t count) override {
    float* host = slot(pending_.size(), count);
    backend_->copy_to_host(host, data, count * sizeof(float));
    inner_->allreduce_sum_async(host, count);
    pending_.push_back({data, host, count});
  }
  bool progresses_independently() const override { return inner_->progresses_independently(); }
  void progress() override { inner_->progress(); }
  void wait_all() override {
    inner_->wait_all();
    for (const Pending& p : pending_) backend_->copy_to_backend(p.device, p.host, p.count * sizeof(float));
    pending_.clear();
  }
  void set_timeout(double seconds) override {
    Communicator::set_timeout(seconds);
    inner_->set_timeout(seconds);
  }
  void begin_step(uint64_t step) override {
    Communicator::begin_step(step);
    inner_->begin_step(step);
  }
  std::vector<int> missing_peers() override { return inner_->missing_peers(); }
  void heartbeat() override { inner_->heartbeat(); }
  std::string diagnose_stall(double silence) override { return inner_->diagnose_stall(silence); }
  void abort(const std::string& why) override { inner_->abort(why); }
  void raise_if_failed() override { inner_->raise_if_failed(); }
  void start_collective_timing() override { inner_->start_collective_timing(); }
  std::vector<std::pair<double, double>> collective_times() override { return inner_->collective_times(); }
  bool heartbeat_from_any_thread() const override { return inner_->heartbeat_from_any_thread(); }
  void close() override { inner_->close(); }

 private:
  struct Pending {
    float* device;
    float* host;
    size_t count;
  };
  // Host buffer for the i-th collective in flight; a moved std::vector keeps
  // its storage, so earlier slots stay valid while later ones are added.
  float* slot(size_t i, size_t count) {
    if (slots_.size() <= i) slots_.resize(i + 1);
    if (slots_[i].size() < count) slots_[i].resize(count);
    return slots_[i].data();
  }

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<Backend> backend_;
  std::vector<std::vector<float>> slots_;
  std::vector<Pending> pending_;
};

}  // namespace mgpu
