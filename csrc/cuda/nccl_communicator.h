// NCCL communicator: collectives between the GPUs of a data-parallel job, one
// rank per process (ncclCommInitRank) or per thread of one process (init_all). Collectives run on a communication
// stream of their own, ordered after the attached CUDA backend's compute stream with an event; wait_all() makes the
// compute stream wait for them in turn (another event), so the host never blocks unless a timeout is set. With a
// timeout, wait_all() is a watchdog: it polls the completion event and ncclCommGetAsyncError against a deadline, and on
// expiry aborts the NCCL communicator and throws CommError naming the step and the ranks whose heartbeats (sent through
// the MPI sidecar) never reached it; the step's wait_all() leaves that to a watchdog thread.
//
// Setup has the same deadline: the communicator is created non-blocking
// (ncclCommInitRankConfig, blocking = 0) and polled against setup_timeout, so
// a rank that never arrives ends setup with a CommError, not a hang. close() is
// the collective end (finalize, destroy); the destructor only aborts, which is
// local (ncclCommDestroy is an intra-node collective).
//
// Several ranks on one GPU: NCCL before 2.30 refuses them ("duplicate GPU");
// NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1 in the environment.
// mgpu.ProcessGroup checks this before creating the communicator.
//
// Free of CUDA and NCCL types (the bindings include it): state lives in Impl.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../core/communicator.h"

namespace mgpu {

class NcclCommunicator final : public Communicator {
 public:
  // unique_id: the bytes of rank 0's ncclGetUniqueId (cuda::nccl_unique_id()),
  // shared by every rank; device_index: this rank's GPU. sidecar: an optional
  // host communicator over the same ranks (MpiCommunicator) for heartbeats.
  // setup_timeout: seconds the ranks may take to meet (0: forever); it also
  // becomes the collectives' timeout until set_timeout changes it.
  NcclCommunicator(const std::string& unique_id, int rank, int size, int device_index,
                   std::shared_ptr<Communicator> sidecar = nullptr, double setup_timeout = 0.0);
  // Single-process multi-GPU: one communicator per device of `devices`, all
  // made by one ncclCommInitAll (rank i drives devices[i]). Each is then used
  // by one thread of this process, like a rank of its own. Each GPU's
  // stream-ordered pool is opened to the others first: NCCL in one process
  // accesses peers' buffers directly.
  static std::vector<std::shared_ptr<NcclCommunicator>> init_all(const std::vector<int>& devices);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::string name() const override { return "nccl"; }
  int rank() const override;
  int size() const override;
  int device() const;

  // data may be device memory (the attached backend's) or host memory (staged
  // through a device buffer; synchronous). Counts are elements.
  void allreduce_sum(float* data, size_t count) override;
  void broadcast(float* data, size_t count, int root) override;
  void barrier() override;
  // Queued, then launched as one ncclGroupStart/End group at the next
  // progress() or wait_all(): the step calls progress() after each batch of
  // ready buckets, so buckets that become ready together launch together.
  void allreduce_sum_async(float* data, size_t count) override;
  // A sharded optimizer's collectives (Communicator's contract), in place: one
  // group of an ncclReduce to each nonzero part's owner, or of an ncclBroadcast
  // from it (NCCL has no uneven reduce-scatter or all-gather). Host memory is
  // staged and synchronous, as allreduce_sum; the *_async forms queue device memory.
  void reduce_scatter_sum(float* data, const std::vector<size_t>& parts) override;
  void all_gather(float* data, const std::vector<size_t>& parts) override;
  void reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) override;
  void all_gather_async(float* data, const std::vector<size_t>& parts) override;
  // Fences are events on the communication stream the compute stream waits on.
  bool fences_device_work() const override { return true; }
  void fence(size_t slot) override;
  void wait_fence(size_t slot) override;
  void complete_all() override;
  bool progresses_independently() const override { return true; }
  bool accepts_device_memory() const override { return true; }
  void progress() override;
  // With a timeout and an attached backend, returns at once: the compute
  // stream waits for the collectives, and a watchdog thread keeps the deadline
  // (polling with backoff, beating through the sidecar, aborting on expiry), so
  // the step's host thread never polls. raise_if_failed() after the step's
  // read-back throws what the watchdog found.
  void wait_all() override;
  void raise_if_failed() override;
  const int* failure_flag() const override;
  void start_collective_timing() override;
  std::vector<std::pair<double, double>> collective_times() override;
  void abort(const std::string& why) override;
  void close() override;

  // Compressed-gradient entries: in-place sums of `count` bf16 / fp16 values in
  // device memory, queued like allreduce_sum_async.
  bool reduces_half_types() const override { return true; }
  void allreduce_sum_bf16_async(void* data, size_t count) override;
  void allreduce_sum_fp16_async(void* data, size_t count) override;
  void reduce_scatter_sum_bf16_async(void* data, const std::vector<size_t>& parts) override;
  void reduce_scatter_sum_fp16_async(void* data, const std::vector<size_t>& parts) override;

  void begin_step(uint64_t step) override;
  std::vector<int> missing_peers() override;
  void heartbeat() override;
  std::string diagnose_stall(double silence) override;
  void attach(const std::shared_ptr<Backend>& backend) override;

 private:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu
