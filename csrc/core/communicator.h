// Communicator: the seam for collectives between data-parallel ranks.
// Counts are element counts (float32), never bytes. Implementations:
// LocalCommunicator (one process, here), MpiCommunicator (csrc/mpi), and the
// NCCL communicator (csrc/cuda). Async calls return after enqueueing; wait_all()
// completes every outstanding one, progress() lets a host-driven transport
// (MPI) advance while the caller computes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"

namespace mgpu {

class Backend;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void allreduce_sum(float* data, size_t count) = 0;  // in place
  virtual void broadcast(float* data, size_t count, int root) = 0;
  virtual void barrier() = 0;
  virtual void allreduce_sum_async(float* data, size_t count) { allreduce_sum(data, count); }
  // Gradient compression: in-place sums of `count` bf16 / fp16 values in
  // device memory, queued like allreduce_sum_async, where the transport
  // reduces half types (NCCL); others throw ConfigError.
  virtual bool reduces_half_types() const { return false; }
  virtual void allreduce_sum_bf16_async(void*, size_t) { refuse_half_types(); }
  virtual void allreduce_sum_fp16_async(void*, size_t) { refuse_half_types(); }
  // A sharded optimizer's collectives (ZeRO), in place over a range of
  // sum(parts) elements cut into consecutive parts, parts[r] elements owned by
  // rank r (any may be 0; every rank passes the same parts). reduce_scatter_sum:
  // each rank's own part ends holding the sum over ranks, the rest of the range
  // is left unspecified. all_gather: every part ends holding its owner's values
  // on every rank. The defaults are correct but move more than they need (an
  // allreduce; a broadcast per part); transports override them. The *_async
  // forms are queued and completed like allreduce_sum_async.
  virtual void reduce_scatter_sum(float* data, const std::vector<size_t>& parts) {
    allreduce_sum(data, parts_total(parts));
  }
  virtual void all_gather(float* data, const std::vector<size_t>& parts) {
    parts_total(parts);
    size_t offset = 0;
    for (size_t r = 0; r < parts.size(); offset += parts[r], ++r)
      if (parts[r]) broadcast(data + offset, parts[r], static_cast<int>(r));
  }
  virtual void reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) {
    reduce_scatter_sum(data, parts);
  }
  virtual void all_gather_async(float* data, const std::vector<size_t>& parts) { all_gather(data, parts); }
  // Compressed gradients of a sharded step: bf16 / fp16 values in device memory, as allreduce_sum_bf16_async.
  virtual void reduce_scatter_sum_bf16_async(void*, const std::vector<size_t>&) { refuse_half_types(); }
  virtual void reduce_scatter_sum_fp16_async(void*, const std::vector<size_t>&) { refuse_half_types(); }
  // Partial completion, for a sharded step's parameters gathered layer by layer
  // while the next forward runs: fence(slot) launches what is queued and marks
  // the point after it; wait_fence(slot) makes the attached backend's later work
  // wait for that point (the host does not wait; the next wait_all() keeps the
  // deadline, as it covers everything before it). A slot is reused by the next
  // fence() of that number. Transports without it (fences_device_work() false)
  // complete their collectives in wait_all(). complete_all(): every collective
  // issued so far done, the host waiting under the deadline, failures raised;
  // after close(), nothing is in flight.
  virtual bool fences_device_work() const { return false; }
  virtual void fence(size_t /*slot*/) { wait_all(); }
  virtual void wait_fence(size_t /*slot*/) { wait_all(); }
  virtual void complete_all() { wait_all(); }
  // True when async collectives advance without the caller's help (NCCL kernels);
  // false when they need progress() calls from the host thread (MPI).
  virtual bool progresses_independently() const { return false; }
  virtual void progress() {}
  virtual void wait_all() {}
  // Per-bucket spans for traces (DataParallelStep's timed and traced steps only,
  // so other steps pay nothing): start_collective_timing() at the step's
  // start; each *_async collective after it is stamped, and collective_times(),
  // called once the step's results were read back, returns (launch, done) in
  // seconds since that start, in launch order, and stops the stamping. Empty:
  // the transport cannot tell, and the step falls back to its own clock.
  virtual void start_collective_timing() {}
  virtual std::vector<std::pair<double, double>> collective_times() { return {}; }
  // Throws CommError when a collective wait_all() left to complete in the
  // background (NCCL's watchdog) failed or timed out; call once its results
  // were read back (the read-back returns either way: the watchdog aborts).
  virtual void raise_if_failed() {}
  // Host-pinned memory a device backend can read, set nonzero before this
  // communicator ends collectives it could not complete (NCCL's watchdog
  // aborts them, and the compute stream then runs on over whatever they left):
  // the step's verdict refuses the update on it. Null where a failure throws
  // before wait_all() returns (nothing runs on over a failed collective).
  virtual const int* failure_flag() const { return nullptr; }
  // After an error unwound a step with collectives in flight: end them without
  // the peers (NCCL: ncclCommAbort), so memory they use can be freed and
  // nothing waits on them; later calls throw CommError. Local, never blocks.
  virtual void abort(const std::string& /*why*/) {}
  // After a timeout or an abort: whether a collective this transport could not
  // end may still write the memory it was given (MPI: a blocking call the worker
  // thread is inside); such memory must then outlive the communicator.
  virtual bool may_write_after_failure() const { return false; }
  // The normal end, called by every rank: completes what is in flight and
  // releases the transport (NCCL: ncclCommFinalize, then ncclCommDestroy, under
  // the timeout). Later calls throw CommError. Without it the destructor aborts.
  virtual void close() {}

  // Fault detection. begin_step announces that this rank reached training step
  // `step` (a heartbeat the peers can see); a collective that has not completed
  // timeout_seconds after it was waited on throws CommError naming the step and,
  // where the transport can tell, the ranks that never arrived. 0 disables.
  virtual void set_timeout(double seconds) { timeout_seconds_ = seconds; }
  double timeout() const { return timeout_seconds_; }
  virtual void begin_step(uint64_t step) { current_step_ = step; }
  uint64_t current_step() const { return current_step_; }
  // Ranks known not to have reached the current step (heartbeats); empty when
  // the transport cannot tell.
  virtual std::vector<int> missing_peers() { return {}; }
  // Call while waiting on peers: tells the watched ranks this one is alive, and
  // reads their heartbeats.
  virtual void heartbeat() {}
  // Whether heartbeat() may be called from another thread than the caller's
  // other calls (a watchdog thread); MPI needs MPI_THREAD_MULTIPLE for that.
  virtual bool heartbeat_from_any_thread() const { return true; }
  // Why a wait did not end, in words: which ranks never reached the current
  // step and which went silent for more than `silence` seconds while in it.
  virtual std::string diagnose_stall(double /*silence*/) { return "the missing ranks are unknown"; }

  // The backend whose memory the collectives will see: a device transport
  // (NCCL) orders its collectives after the backend's compute stream (and keeps
  // the backend alive while it may use that stream). Throws ConfigError when
  // the transport cannot work with that backend.
  virtual void attach(const std::shared_ptr<Backend>&) {}
  // Whether collectives may be handed device (non-host-accessible backend)
  // memory; those that cannot are wrapped in a StagedCommunicator.
  virtual bool accepts_device_memory() const { return false; }

  // The elements of a range cut into parts; ConfigError unless there is one part per rank.
  size_t parts_total(const std::vector<size_t>& parts) const {
    MGPU_CHECK(parts.size() == static_cast<size_t>(size()), ConfigError, parts.size(), " parts given for a world of ",
               size(), " (one part per rank)");
    size_t total = 0;
    for (size_t p : parts) total += p;
    return total;
  }

 protected:
  [[noreturn]] void refuse_half_types() const {
    throw ConfigError("the " + name() + " communicator reduces fp32 only (gradient compression needs NCCL)");
  }
  double timeout_seconds_ = 0.0;
  uint64_t current_step_ = 0;
};

// The words of Communicator::diagnose_stall, shared by the transports: ranks
// that have not reached the current step, ranks that reached it but went
// silent; none: the collective itself is stuck (every_rank_watched), or only
// rank 0 can tell.
inline constexpr char kStuckTail[] = ", but the collective is stuck";  // what a timeout adds, an error does not
inline std::string describe_stall(const std::vector<int>& missing, const std::vector<int>& silent,
                                  bool every_rank_watched) {
  auto join = [](const std::vector<int>& ranks) {
    std::string s;
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
    return s;
  };
  std::string msg;
  if (!missing.empty())
    msg += std::string("rank") + (missing.size() > 1 ? "s " : " ") + join(missing) +
           (missing.size() > 1 ? " have" : " has") + " not reached this step";
  if (!silent.empty())
    msg += std::string(missing.empty() ? "" : "; ") + "rank" + (silent.size() > 1 ? "s " : " ") + join(silent) +
           " stopped responding during it";
  if (!missing.empty() || !silent.empty()) return msg + " (stopped, hung or dead)";
  return every_rank_watched ? std::string("every rank reached this step and is responding") + kStuckTail
                            : "rank 0 reached this step; it names the missing rank";
}

// A world of one: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  std::string name() const override { return "local"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce_sum(float*, size_t) override {}
  void broadcast(float*, size_t, int) override {}
  void barrier() override {}
  bool accepts_device_memory() const override { return true; }  // never touches the data
  bool reduces_half_types() const override { return true; }
  void allreduce_sum_bf16_async(void*, size_t) override {}
  void allreduce_sum_fp16_async(void*, size_t) override {}
  void reduce_scatter_sum(float*, const std::vector<size_t>& parts) override { parts_total(parts); }
  void all_gather(float*, const std::vector<size_t>& parts) override { parts_total(parts); }
  void reduce_scatter_sum_bf16_async(void*, const std::vector<size_t>& parts) override { parts_total(parts); }
  void reduce_scatter_sum_fp16_async(void*, const std::vector<size_t>& parts) override { parts_total(parts); }
};

}  // namespace mgpu
