// StagedCommunicator: lets a host-memory transport (MPI) serve a device
// backend (CUDA) without draining the device per bucket. An async range is
// copied into pinned host memory on the backend's queue, behind the backward
// kernels that wrote it, with a fence after the copy; the wrapped collective
// starts once the host sees the fence passed (progress() polls; wait_all
// waits for the rest), in launch order, so every rank issues the same
// sequence. wait_all queues the copies back, which the next kernels on the
// queue follow: a step waits for the device once for its buckets and once for
// its read-back. Blocking collectives copy synchronously. Host buffers are
// kept per launch slot and only grow, so steady-state steps allocate nothing.
// A sharded step's collectives are staged alike, each copying only what it
// needs: a reduce-scatter all of its range to the host and its own part back,
// an all-gather its own part to the host and all of its range back.
// DataParallelStep wraps a communicator in one when the backend is not
// host-accessible and the communicator does not accept device memory.
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
  ~StagedCommunicator() override {
    try {
      backend_->synchronize();  // nothing queued may still copy into or out of a slot
    } catch (...) {
    }
    // A collective the transport could not end may still write a slot: kept (leaked) then.
    if (inner_->may_write_after_failure()) return;
    for (Slot& s : slots_) backend_->free_host(s.data);
  }
  StagedCommunicator(const StagedCommunicator&) = delete;
  StagedCommunicator& operator=(const StagedCommunicator&) = delete;
  std::string name() const override { return inner_->name() + "+staged"; }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  bool accepts_device_memory() const override { return true; }

  // A copy back queued by the last wait_all may still read the slot these reuse:
  // copy_to_host is queued behind it and waits for it; a broadcast's receivers
  // write the slot from the host, so they first let the device run dry.
  void allreduce_sum(float* data, size_t count) override {
    float* host = slot(pending_.size(), count);
    backend_->copy_to_host(host, data, count * sizeof(float));
    inner_->allreduce_sum(host, count);
    backend_->copy_to_backend(data, host, count * sizeof(float));
  }
  void broadcast(float* data, size_t count, int root) override {
    float* host = slot(pending_.size(), count);
    if (inner_->rank() == root)
      backend_->copy_to_host(host, data, count * sizeof(float));
    else
      backend_->synchronize();
    inner_->broadcast(host, count, root);
    backend_->copy_to_backend(data, host, count * sizeof(float));
  }
  void barrier() override { inner_->barrier(); }
  void reduce_scatter_sum(float* data, const std::vector<size_t>& parts) override {
    const size_t count = parts_total(parts);
    const Range mine = own(parts.data());
    float* host = slot(pending_.size(), count);
    backend_->copy_to_host(host, data, count * sizeof(float));
    inner_->reduce_scatter_sum(host, parts);
    backend_->copy_to_backend(data + mine.offset, host + mine.offset, mine.count * sizeof(float));
  }
  // Every rank copies its own part in (which waits for the queue, as copy_to_host
  // does) before the peers' parts are written into the slot from the host.
  void all_gather(float* data, const std::vector<size_t>& parts) override {
    const size_t count = parts_total(parts);
    const Range mine = own(parts.data());
    float* host = slot(pending_.size(), count);
    if (mine.count)
      backend_->copy_to_host(host + mine.offset, data + mine.offset, mine.count * sizeof(float));
    else
      backend_->synchronize();
    inner_->all_gather(host, parts);
    backend_->copy_to_backend(data, host, count * sizeof(float));
  }
  void allreduce_sum_async(float* data, size_t count) override { enqueue(Kind::kAllreduce, data, count, nullptr); }
  void reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) override {
    enqueue(Kind::kReduceScatter, data, parts_total(parts), parts.data());
  }
  void all_gather_async(float* data, const std::vector<size_t>& parts) override {
    enqueue(Kind::kAllGather, data, parts_total(parts), parts.data());
  }
  bool progresses_independently() const override { return inner_->progresses_independently(); }
  void progress() override {
    launch_copied();
    inner_->progress();
  }
  void wait_all() override {
    if (launched_ < pending_.size()) backend_->wait_fence(pending_.back().fence);
    launch_copied();
    inner_->wait_all();
    for (const Pending& p : pending_) {
      const Range out = p.kind == Kind::kReduceScatter ? own(&parts_[p.parts]) : Range{0, p.count};
      if (out.count)
        backend_->copy_to_backend_async(p.device + out.offset, p.host + out.offset, out.count * sizeof(float));
    }
    pending_.clear();
    parts_.clear();
    launched_ = 0;
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
  // After an error mid-step: the collectives started so far are ended by the
  // transport; what this rank had queued is forgotten, so a later step starts
  // clean instead of launching a stale, rank-dependent remainder.
  void abort(const std::string& why) override {
    inner_->abort(why);
    try {
      backend_->synchronize();  // no queued copy still uses a slot
    } catch (...) {
    }
    pending_.clear();
    parts_.clear();
    launched_ = 0;
  }
  void raise_if_failed() override { inner_->raise_if_failed(); }
  bool may_write_after_failure() const override { return inner_->may_write_after_failure(); }
  void start_collective_timing() override { inner_->start_collective_timing(); }
  std::vector<std::pair<double, double>> collective_times() override { return inner_->collective_times(); }
  bool heartbeat_from_any_thread() const override { return inner_->heartbeat_from_any_thread(); }
  void close() override { inner_->close(); }

 private:
  enum class Kind { kAllreduce, kReduceScatter, kAllGather };
  struct Pending {
    Kind kind;
    float* device;
    float* host;
    size_t count;    // elements of the range
    size_t parts;    // reduce-scatter, all-gather: where its size() parts start in parts_
    uint64_t fence;  // passed: the copy into host has landed
  };
  struct Range {
    size_t offset, count;
  };
  // This rank's part of a range cut into size() parts.
  Range own(const size_t* parts) const {
    size_t offset = 0;
    for (int r = 0; r < rank(); ++r) offset += parts[r];
    return {offset, parts[rank()]};
  }
  struct Slot {
    float* data = nullptr;
    size_t capacity = 0;  // floats
  };
  // Queues the copy of what the collective reads into its slot, and the collective
  // behind a fence (an all-gather with no own part still waits for the copies back
  // queued before, which may read its slot).
  void enqueue(Kind kind, float* data, size_t count, const size_t* parts) {
    float* host = slot(pending_.size(), count);
    const size_t at = parts_.size();
    if (parts) parts_.insert(parts_.end(), parts, parts + size());
    const Range in = kind == Kind::kAllGather ? own(parts) : Range{0, count};
    if (in.count) backend_->copy_to_host_async(host + in.offset, data + in.offset, in.count * sizeof(float));
    pending_.push_back({kind, data, host, count, at, backend_->fence()});
    launch_copied();
  }
  // Starts, in launch order, the collectives whose copy to the host has landed.
  void launch_copied() {
    while (launched_ < pending_.size() && backend_->fence_passed(pending_[launched_].fence)) {
      const Pending& p = pending_[launched_];
      if (p.kind != Kind::kAllreduce) launch_parts_.assign(&parts_[p.parts], &parts_[p.parts] + size());
      switch (p.kind) {
        case Kind::kAllreduce: inner_->allreduce_sum_async(p.host, p.count); break;
        case Kind::kReduceScatter: inner_->reduce_scatter_sum_async(p.host, launch_parts_); break;
        case Kind::kAllGather: inner_->all_gather_async(p.host, launch_parts_); break;
      }
      ++launched_;
    }
  }
  // Host buffer for the i-th collective in flight. Grown (the first steps) only
  // after the backend ran dry: a queued copy of an earlier step may still use it.
  float* slot(size_t i, size_t count) {
    if (slots_.size() <= i) slots_.resize(i + 1);
    Slot& s = slots_[i];
    if (s.capacity < count) {
      backend_->synchronize();
      backend_->free_host(s.data);
      s.data = nullptr;
      s.capacity = 0;
      s.data = static_cast<float*>(backend_->allocate_host(count * sizeof(float)));
      s.capacity = count;
    }
    return s.data;
  }

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<Backend> backend_;
  std::vector<Slot> slots_;
  std::vector<Pending> pending_;
  std::vector<size_t> parts_;         // the parts of pending_'s sharded collectives, size() each
  std::vector<size_t> launch_parts_;  // launch_copied's scratch: one collective's parts
  size_t launched_ = 0;               // pending_[0, launched_) were handed to inner_
};

}  // namespace mgpu
