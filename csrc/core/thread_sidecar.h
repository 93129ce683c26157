// Heartbeats between the threads of one process (run_on_gpus): the sidecar of
// each in-process NCCL communicator (NcclCommunicator::init_all), so that a
// watchdog timeout names the threads that never reached the step or went
// silent in it, as the MPI sidecar does between processes. Not a transport:
// its collectives throw.
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "communicator.h"
#include "errors.h"

namespace mgpu {

// What every thread last announced: its step count and when it last beat.
struct ThreadHeartbeats {
  explicit ThreadHeartbeats(int n) : sequence(size_t(n), 0), beat_at(size_t(n), std::chrono::steady_clock::now()) {}
  std::mutex m;
  std::vector<uint64_t> sequence;  // begin_step calls so far, per rank
  std::vector<std::chrono::steady_clock::time_point> beat_at;
};

class ThreadSidecar final : public Communicator {
 public:
  ThreadSidecar(std::shared_ptr<ThreadHeartbeats> shared, int rank) : shared_(std::move(shared)), rank_(rank) {}
  std::string name() const override { return "thread heartbeats"; }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(shared_->sequence.size()); }
  void allreduce_sum(float*, size_t) override { refuse(); }
  void broadcast(float*, size_t, int) override { refuse(); }
  void barrier() override { refuse(); }

  void begin_step(uint64_t step) override {
    Communicator::begin_step(step);
    std::lock_guard<std::mutex> lock(shared_->m);
    ++shared_->sequence[size_t(rank_)];
    shared_->beat_at[size_t(rank_)] = std::chrono::steady_clock::now();
  }
  void heartbeat() override {
    std::lock_guard<std::mutex> lock(shared_->m);
    shared_->beat_at[size_t(rank_)] = std::chrono::steady_clock::now();
  }
  std::vector<int> missing_peers() override {
    std::lock_guard<std::mutex> lock(shared_->m);
    std::vector<int> missing;
    for (int r = 0; r < size(); ++r)
      if (r != rank_ && shared_->sequence[size_t(r)] < shared_->sequence[size_t(rank_)]) missing.push_back(r);
    return missing;
  }
  std::string diagnose_stall(double silence) override {
    const std::vector<int> missing = missing_peers();
    std::vector<int> silent;
    {
      std::lock_guard<std::mutex> lock(shared_->m);
      const auto now = std::chrono::steady_clock::now();
      for (int r = 0; r < size(); ++r)
        if (r != rank_ && shared_->sequence[size_t(r)] >= shared_->sequence[size_t(rank_)] &&
            std::chrono::duration<double>(now - shared_->beat_at[size_t(r)]).count() > silence)
          silent.push_back(r);
    }
    return describe_stall(missing, silent, true);
  }

 private:
  [[noreturn]] void refuse() const {
    throw ConfigError("the thread heartbeat sidecar carries heartbeats only, no collectives");
  }
  std::shared_ptr<ThreadHeartbeats> shared_;
  int rank_;
};

}  // namespace mgpu
